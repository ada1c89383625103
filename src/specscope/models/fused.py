"""The native Transformer's forward through the fused kernels of kernels.py.

Same weights, same KV cache tensors and the same contract as Transformer.forward, but
every input is a device tensor and nothing is read back to the host, so a call can be
captured as a CUDA graph (cuda_graphs.py). A dense layer is 7 launches:

    qkv   = [RMSNorm →] x @ Wqkv (+ bias)          linear, norm in the prologue
    q     = RoPE(q), cache ← RoPE(k), v             rope_store (+ Qwen3 q/k norm)
    o     = attention over the live cache           attention (split-KV + combine)
    x    += o @ Wo                                   linear, residual in the epilogue
    h     = SiLU(RMSNorm(x) @ Wg) · (… @ Wu)         linear, norm + SiLU·up fused
    x    += h @ Wd                                   linear, residual in the epilogue

and a MoE layer routes on the device (kernels.moe_route) and runs grouped GEMMs over the
distinct experts the tokens touched.
"""

from __future__ import annotations

import torch

from . import kernels as K
from .llama import MoE, Transformer

MAX_ROWS = 64  # B·T rows the skinny kernels are built for; larger (prefill) goes eager


def supported(model: Transformer) -> str | None:
    """Why the fused path cannot run this model, or None if it can."""
    a = model.arch
    if a.head_dim & (a.head_dim - 1) or a.head_dim < 16:
        return f"head_dim {a.head_dim} is not a power of two >= 16"
    for n in {a.hidden, a.n_heads * a.head_dim, a.intermediate, a.moe_intermediate or 16}:
        if K._largest_divisor(n) == 0:
            return f"dimension {n} has no power-of-two factor >= 16"
    if model.num_slots == 0:
        return "the KV cache is not set up"
    return None


class FusedForward:
    def __init__(self, model: Transformer):
        reason = supported(model)
        if reason:
            raise ValueError(f"fused GPU forward unavailable: {reason}")
        self.model = model
        self.arch = model.arch
        if model.device.type == "cuda":
            K.ensure_scratch(model.device)  # split-K scratch, before any graph capture
        # Distinct experts touched per MoE layer in the last call (device, no sync).
        n_moe = sum(isinstance(layer.mlp, MoE) for layer in model.layers)
        self.experts_touched = torch.zeros(max(n_moe, 1), dtype=torch.int32, device=model.device)

    def __call__(self, tokens, positions, slots, nvalid, tree_mask=None, taps=None, last_only=False):
        """tokens, positions [B, T] int64; slots [B] int32; nvalid [1] int32 (rows t >=
        nvalid are padding: computed, never stored); tree_mask [B, T, T] int8 or None.
        Returns fp32 logits [B, T, V] ([B, 1, V] with last_only)."""
        m, a = self.model, self.arch
        B, T = tokens.shape
        eps = a.eps
        x = m.embed(tokens).view(B * T, a.hidden)
        hidden = []
        cos, sin = m.rope_cos, m.rope_sin
        moe_i = 0
        for i, layer in enumerate(m.layers):
            at = layer.attn
            qkv = K.linear(x, at.wqkv.weight, bias=at.wqkv.bias, norm=layer.attn_norm.weight, eps=eps)
            q = K.rope_store(
                qkv, cos, sin, positions, slots, nvalid, at.k_cache, at.v_cache, n_heads=a.n_heads, n_kv=a.n_kv_heads,
                head_dim=a.head_dim, q_norm=at.q_norm.weight if at.q_norm is not None else None,
                k_norm=at.k_norm.weight if at.k_norm is not None else None, eps=eps, tree=tree_mask is not None,
            )
            o = K.attention(q, at.k_cache, at.v_cache, slots, positions, nvalid, n_heads=a.n_heads,
                            n_kv=a.n_kv_heads, head_dim=a.head_dim, tree_mask=tree_mask)
            x = K.linear(o, at.wo.weight, residual=x, out=x)
            if isinstance(layer.mlp, MoE):
                x = self._moe(layer.mlp, layer.mlp_norm.weight, x, moe_i)
                moe_i += 1
            else:
                h = K.linear(x, layer.mlp.w_gate_up.weight, norm=layer.mlp_norm.weight, eps=eps, silu_mul=True)
                x = K.linear(h, layer.mlp.w_down.weight, residual=x, out=x)
            if taps and i in taps:
                hidden.append(x.view(B, T, a.hidden).clone())
        rows = x.view(B, T, a.hidden)[:, -1] if last_only else x
        logits = K.linear(rows, m.lm_head.weight, norm=m.norm.weight, eps=eps, out_dtype=torch.float32)
        logits = logits.view(B, 1 if last_only else T, a.vocab_size)
        return (logits, hidden) if taps else logits

    def _moe(self, moe: MoE, norm_w, x, moe_i: int):
        a = self.arch
        xn = torch.empty_like(x)
        logits = K.linear(x, moe.router.weight, norm=norm_w, eps=a.eps, xn_out=xn, out_dtype=torch.float32)
        r = K.moe_route(logits, moe.top_k, moe.norm_topk_prob, n_groups=self.experts_touched[moe_i : moe_i + 1])
        y = K.moe_experts(xn, moe.gate_up, moe.down, r)
        shared = gate = None
        if moe.shared is not None:
            h = K.linear(xn, moe.shared.w_gate_up.weight, silu_mul=True)
            shared = K.linear(h, moe.shared.w_down.weight)
            gate = K.linear(xn, moe.shared_gate.weight, out_dtype=torch.float32)
        return K.moe_combine(y, r, x, out=x, shared=shared, shared_gate=gate)
