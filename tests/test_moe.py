"""Native MoE (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral) against
transformers on the same weights, and the sort-by-expert paths against each other."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specscope.models.llama import Arch, MoE, Transformer, load_hf_weights
from specscope.models.loading import config_from_dict

BASE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
MIXTRAL = dict(BASE, model_type="mixtral", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
QWEN2_MOE = dict(BASE, model_type="qwen2_moe", intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                 decoder_sparse_step=1, mlp_only_layers=[])


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config_from_dict(cfg), dtype=torch.float32).eval()
    with torch.no_grad():  # larger than the default init so routing and every layer matter
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    return hf


def mixtral_checkpoint_names(sd, n_layers, n_experts, inter):
    """transformers-5 in-memory names → the per-expert names of Mixtral checkpoints."""
    out = {k: v for k, v in sd.items() if ".mlp." not in k}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out[p + "block_sparse_moe.gate.weight"] = sd[p + "mlp.gate.weight"]
        for e in range(n_experts):
            gate_up = sd[p + "mlp.experts.gate_up_proj"][e]
            out[p + f"block_sparse_moe.experts.{e}.w1.weight"] = gate_up[:inter]
            out[p + f"block_sparse_moe.experts.{e}.w3.weight"] = gate_up[inter:]
            out[p + f"block_sparse_moe.experts.{e}.w2.weight"] = sd[p + "mlp.experts.down_proj"][e]
    return out


@pytest.mark.parametrize("cfg", [MIXTRAL, QWEN2_MOE], ids=["mixtral", "qwen2-moe-shared-expert"])
def test_moe_architectures_match_transformers(cfg):
    hf = hf_model(cfg)
    native = Transformer(config_from_dict(cfg))
    load_hf_weights(native, hf.state_dict())
    native.setup_cache(num_slots=1, max_seq_len=64)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert rel_err(native(ids, torch.arange(24)[None], [0]), ref) <= 1e-4
    assert native.arch.shared_intermediate == cfg.get("shared_expert_intermediate_size", 0)
    if cfg is MIXTRAL:  # and from a checkpoint's per-expert layout
        again = Transformer(config_from_dict(cfg))
        load_hf_weights(again, mixtral_checkpoint_names(hf.state_dict(), 2, 4, 32))
        again.setup_cache(num_slots=1, max_seq_len=64)
        assert rel_err(again(ids, torch.arange(24)[None], [0]), ref) <= 1e-4


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_gemm_matches_expert_loop_and_counts_touched_experts():
    a = Arch.from_config(config_from_dict(dict(QWEN2_MOE, num_experts=16, num_experts_per_tok=4)))
    moe = MoE(a)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(3, a.hidden, generator=g)  # 12 picks: some of the 16 experts stay idle
    probs = torch.softmax(moe.router(x), -1)
    w, e = probs.topk(4, -1)
    order = torch.argsort(e.flatten(), stable=True)
    counts = torch.bincount(e.flatten(), minlength=16)
    try:
        grouped = moe._grouped(x, order, order // 4, counts, w)
    except (RuntimeError, NotImplementedError) as err:  # CPU grouped GEMM missing in this build
        pytest.skip(f"torch._grouped_mm unavailable on CPU: {err}")
    looped = moe._looped(x, order, order // 4, counts.tolist(), w)
    assert rel_err(grouped, looped) <= 1e-5
    moe(x[None])
    assert int(moe.last_touched) == int((counts > 0).sum()) and int(moe.last_touched) < 16
