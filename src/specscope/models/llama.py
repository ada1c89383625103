"""Native PyTorch model for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM)
and Qwen3-MoE, with a static per-slot KV cache.

One `forward(tokens[B,T], positions[B,T], slots[B], tree_mask=None)` serves prefill,
decode and verify. The cache of slot s holds the keys/values of its committed tokens at
their storage index; everything at or past `positions[b, 0]` is treated as stale, so the
engine rolls back rejected drafts just by feeding the next step at the right position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
# RoPE variants whose frequencies do not depend on the sequence length; those can be
# precomputed once for the whole cache.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedArchitecture(ValueError):
    pass


@dataclass(frozen=True)
class Arch:
    """The handful of numbers the native model needs, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_positions: int
    n_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0 = none)

    @classmethod
    def from_config(cls, cfg) -> "Arch":
        if cfg.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"architecture '{cfg.model_type}' is not supported by the native backend "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use --backend hf for other "
                "architectures (slower transformers fallback)"
            )
        rope = _rope_parameters(cfg)
        if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
            raise UnsupportedArchitecture(
                f"RoPE type '{rope['rope_type']}' is not supported by the native backend "
                f"(supported: {', '.join(STATIC_ROPE_TYPES)}); use --backend hf"
            )
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        # Qwen-MoE names the expert count num_experts, Mixtral num_local_experts.
        n_experts = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0) or 0
        sparse = ()
        if n_experts:
            only_dense = set(getattr(cfg, "mlp_only_layers", []) or [])
            step = getattr(cfg, "decoder_sparse_step", 1) or 1
            sparse = tuple(
                i not in only_dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)
            )
        return cls(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            # Qwen2 always has q/k/v biases; Llama-style configs say so in attention_bias.
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
            or bool(getattr(cfg, "qkv_bias", False)),
            qk_norm=cfg.model_type in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_positions=cfg.max_position_embeddings,
            n_experts=n_experts,
            experts_per_token=getattr(cfg, "num_experts_per_tok", 0) or 0,
            # Mixtral's experts are intermediate_size wide and always renormalise the top-k.
            moe_intermediate=getattr(cfg, "moe_intermediate_size", 0) or (cfg.intermediate_size if n_experts else 0),
            norm_topk_prob=cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", True)),
            sparse_layers=sparse,
            shared_intermediate=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
        )


def _rope_parameters(cfg) -> dict:
    # transformers 5 keeps RoPE settings in `rope_parameters`; older configs in
    # rope_theta + rope_scaling.
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_tables(cfg, head_dim: int, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, head_dim] in fp32, laid out for rotate-half (as transformers does)."""
    params = _rope_parameters(cfg)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        scale = 1.0
    else:
        # Scaled variants (llama3, yarn, linear) come from transformers so the numbers
        # match the reference implementation exactly.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, D]; cos/sin [B, T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: Arch, **factory):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        # q, k and v in one matmul: one weight read, one kernel launch.
        self.wqkv = nn.Linear(a.hidden, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias, **factory)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=False, **factory)
        self.q_norm = RMSNorm(a.head_dim, a.eps, **factory) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.eps, **factory) if a.qk_norm else None
        self.k_cache: torch.Tensor | None = None  # [slots, n_kv, max_len, hd]
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, cos, sin, slots, store_idx, kv_len, mask):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        v = v.view(B, T, self.n_kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        for b in range(B):
            s = slots[b]
            self.k_cache[s].index_copy_(1, store_idx[b], k[b])
            self.v_cache[s].index_copy_(1, store_idx[b], v[b])
        if B == 1:
            keys = self.k_cache[slots[0], :, :kv_len].unsqueeze(0)
            values = self.v_cache[slots[0], :, :kv_len].unsqueeze(0)
        else:
            keys = self.k_cache[slots, :, :kv_len]
            values = self.v_cache[slots, :, :kv_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, **factory):
        super().__init__()
        self.w_gate_up = nn.Linear(hidden, 2 * intermediate, bias=False, **factory)
        self.w_down = nn.Linear(intermediate, hidden, bias=False, **factory)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class MoE(nn.Module):
    """Softmax top-k routing (Qwen3-MoE, Qwen2-MoE, Mixtral), with Qwen2-MoE's gated shared
    expert. Tokens are sorted by expert, so the cost follows the number of distinct experts
    the T tokens touch, not the number of experts: on the GPU one grouped GEMM per
    projection (empty groups cost nothing, no host sync), on the CPU a loop over the
    touched experts."""

    def __init__(self, a: Arch, **factory):
        super().__init__()
        self.top_k, self.norm_topk_prob = a.experts_per_token, a.norm_topk_prob
        self.router = nn.Linear(a.hidden, a.n_experts, bias=False, **factory)
        self.gate_up = nn.Parameter(torch.empty(a.n_experts, 2 * a.moe_intermediate, a.hidden, **factory))
        self.down = nn.Parameter(torch.empty(a.n_experts, a.hidden, a.moe_intermediate, **factory))
        self.shared = MLP(a.hidden, a.shared_intermediate, **factory) if a.shared_intermediate else None
        self.shared_gate = nn.Linear(a.hidden, 1, bias=False, **factory) if a.shared_intermediate else None
        self.last_touched: torch.Tensor | None = None  # distinct experts in the last call (device)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        # scatter_add, not bincount: bincount reads the maximum back to the host.
        counts = torch.zeros(self.gate_up.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        self.last_touched = (counts > 0).sum()
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            out = self._grouped(x, order, token_of, counts, weights)
        else:
            out = self._looped(x, order, token_of, counts.tolist(), weights)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out.view(shape)

    def _grouped(self, x, order, token_of, counts, weights):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        # The weights' transposed views are column-major [E, K, N], the layout the grouped
        # GEMM wants.
        gate, up = torch._grouped_mm(x[token_of], self.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=offs)
        y = y * weights.view(-1)[order, None]
        # Back to (token, k) order and a sum over k: unlike index_add_ (atomics on CUDA) this
        # is deterministic, so every run's prefill writes bitwise the same KV cache.
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(x.shape[0], self.top_k, x.shape[1]).sum(dim=1)

    def _looped(self, x, order, token_of, counts, weights):
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start : start + n]
            tokens = token_of[start : start + n]
            gate, up = F.linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights.view(-1)[rows, None]
            out.index_add_(0, tokens, y)
            start += n
        return out


class Block(nn.Module):
    def __init__(self, a: Arch, sparse: bool, **factory):
        super().__init__()
        self.attn_norm = RMSNorm(a.hidden, a.eps, **factory)
        self.attn = Attention(a, **factory)
        self.mlp_norm = RMSNorm(a.hidden, a.eps, **factory)
        self.mlp = MoE(a, **factory) if sparse else MLP(a.hidden, a.intermediate, **factory)

    def forward(self, x, cos, sin, slots, store_idx, kv_len, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, slots, store_idx, kv_len, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, config, dtype=torch.float32, device="cpu"):
        super().__init__()
        a = self.arch = Arch.from_config(config)
        self.config = config
        # Built on the meta device so no time is spent on an init we overwrite anyway.
        factory = {"dtype": dtype, "device": "meta"}
        self.embed = nn.Embedding(a.vocab_size, a.hidden, **factory)
        self.layers = nn.ModuleList(
            Block(a, bool(a.sparse_layers and a.sparse_layers[i]), **factory) for i in range(a.n_layers)
        )
        self.norm = RMSNorm(a.hidden, a.eps, **factory)
        self.lm_head = nn.Linear(a.hidden, a.vocab_size, bias=False, **factory)
        self.to_empty(device=device)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.tp = None  # a TPGroup once sharded (models/tp.py)
        self.num_slots = 0
        self.max_seq_len = 0

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def setup_cache(self, num_slots: int, max_seq_len: int) -> None:
        a = self.arch
        if max_seq_len > a.max_positions:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {a.max_positions} positions")
        for layer in self.layers:
            # Per layer: under tensor parallelism a rank caches only its own KV heads.
            shape = (num_slots, layer.attn.n_kv, max_seq_len, a.head_dim)
            layer.attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cos, sin = rope_tables(self.config, a.head_dim, max_seq_len, self.device)
        self.rope_cos, self.rope_sin = cos.to(self.dtype), sin.to(self.dtype)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len

    def reset_slot(self, slot: int) -> None:
        """Nothing to free: a slot's stale entries are masked by position."""

    def compact_kv(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the KV entries of an accepted tree path (stored where the verify put the
        nodes) to consecutive positions after the root."""
        for layer in self.layers:
            for cache in (layer.attn.k_cache[slot], layer.attn.v_cache[slot]):
                cache.index_copy_(1, dst, cache.index_select(1, src))

    @torch.inference_mode()
    def forward(self, tokens, positions, slots, tree_mask=None, taps=None, last_only=False, kv_len=None):
        """tokens, positions [B, T] (int64), slots [B] (ints); tree_mask [B, T, T] bool
        (node i may see node j) or None for causal. Returns logits [B, T, V] fp32
        ([B, 1, V] with last_only), and with `taps` also the listed layers' outputs.
        `kv_len` (cache entries after this call, the longest sequence's) is read from the
        positions when not given; a caller that knows it saves that host sync, which also
        makes the forward capturable in a CUDA graph (for that one length)."""
        B, T = tokens.shape
        slots = slots.tolist() if torch.is_tensor(slots) else list(slots)
        if tree_mask is None:
            store_idx = positions
        else:
            # Tree nodes share RoPE positions (depth), so they are stored side by side
            # after the root instead of at their position.
            start = positions[:, :1]
            store_idx = start + torch.arange(T, device=positions.device)
        kv_len = kv_len or int(store_idx.max()) + 1
        if kv_len > self.max_seq_len:
            raise ValueError(f"context of {kv_len} tokens exceeds the cache ({self.max_seq_len})")
        mask = self._mask(positions, store_idx, kv_len, tree_mask)
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        x = self.embed(tokens)
        hidden = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, slots, store_idx, kv_len, mask)
            if taps and i in taps:
                hidden.append(x)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x)).float()
        return (logits, hidden) if taps else logits

    @staticmethod
    def _mask(positions, store_idx, kv_len, tree_mask):
        B, T = positions.shape
        if tree_mask is None and T == 1:
            return None  # one new token sees the whole valid prefix
        cache_idx = torch.arange(kv_len, device=positions.device)
        if tree_mask is None:
            mask = cache_idx[None, None, :] <= store_idx[:, :, None]  # [B, T, L]
        else:
            rel = (cache_idx[None, :] - store_idx[:, :1]).unsqueeze(1)  # [B, 1, L]
            in_tree = torch.gather(tree_mask, 2, rel.clamp(0, T - 1).expand(B, T, kv_len))
            mask = (rel < 0) | ((rel < T) & in_tree)
        return mask.unsqueeze(1)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=gen)


def load_hf_weights(model: Transformer, sd: dict[str, torch.Tensor]) -> None:
    a = model.arch
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()

    def take(name):
        if name not in sd:
            raise KeyError(f"checkpoint lacks tensor '{name}'")
        used.add(name)
        return sd[name]

    def put(param, value):
        if param.shape != value.shape:
            raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, checkpoint has {tuple(value.shape)}")
        param.copy_(value.to(param.dtype))

    with torch.no_grad():
        put(model.embed.weight, take("model.embed_tokens.weight"))
        put(model.norm.weight, take("model.norm.weight"))
        if not a.tie_embeddings:
            put(model.lm_head.weight, take("lm_head.weight"))
        elif "lm_head.weight" in sd:
            used.add("lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.attn_norm.weight, take(p + "input_layernorm.weight"))
            put(layer.mlp_norm.weight, take(p + "post_attention_layernorm.weight"))
            att = p + "self_attn."
            put(layer.attn.wqkv.weight, torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"]))
            if a.qkv_bias:
                put(layer.attn.wqkv.bias, torch.cat([take(att + f"{n}_proj.bias") for n in "qkv"]))
            put(layer.attn.wo.weight, take(att + "o_proj.weight"))
            if a.qk_norm:
                put(layer.attn.q_norm.weight, take(att + "q_norm.weight"))
                put(layer.attn.k_norm.weight, take(att + "k_norm.weight"))
            mlp = p + "mlp."
            if isinstance(layer.mlp, MoE):
                if p + "block_sparse_moe.gate.weight" in sd:  # Mixtral checkpoint naming
                    mlp = p + "block_sparse_moe."
                put(layer.mlp.router.weight, take(mlp + "gate.weight"))
                if mlp + "experts.gate_up_proj" in sd:  # transformers 5 in-memory layout
                    put(layer.mlp.gate_up, take(mlp + "experts.gate_up_proj"))
                    put(layer.mlp.down, take(mlp + "experts.down_proj"))
                else:  # checkpoint layout: one module per expert (Mixtral: w1 gate, w3 up, w2 down)
                    e_range = range(a.n_experts)
                    names = ("w1", "w3", "w2") if mlp + "experts.0.w1.weight" in sd else ("gate_proj", "up_proj", "down_proj")
                    put(layer.mlp.gate_up, torch.stack([
                        torch.cat([take(mlp + f"experts.{e}.{names[0]}.weight"), take(mlp + f"experts.{e}.{names[1]}.weight")])
                        for e in e_range
                    ]))
                    put(layer.mlp.down, torch.stack([take(mlp + f"experts.{e}.{names[2]}.weight") for e in e_range]))
                if layer.mlp.shared is not None:
                    sh = mlp + "shared_expert."
                    put(layer.mlp.shared.w_gate_up.weight,
                        torch.cat([take(sh + "gate_proj.weight"), take(sh + "up_proj.weight")]))
                    put(layer.mlp.shared.w_down.weight, take(sh + "down_proj.weight"))
                    put(layer.mlp.shared_gate.weight, take(mlp + "shared_expert_gate.weight"))
            else:
                put(layer.mlp.w_gate_up.weight, torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]))
                put(layer.mlp.w_down.weight, take(mlp + "down_proj.weight"))
    unused = sorted(set(sd) - used)
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensors the native model does not use, e.g. {unused[:3]}")

