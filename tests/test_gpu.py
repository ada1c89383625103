"""GPU-only paths: the CUDA-graph runner in bf16 end to end, exact greedy losslessness
of speculative methods on the GPU, the grouped-GEMM MoE, and the profiler's graph path.
(test_kernels.py and test_fused.py also run on the GPU, with the compiled kernels.)"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LLAMA = dict(model_type="llama", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
MOE = dict(LLAMA, model_type="qwen3_moe", num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


class IdsOnly:
    eos_token_id = None
    chat_template = None

    def decode(self, ids, **kw):
        return ""


def target(cfg, graphs=True, max_seq_len=1024):
    from specscope.models.cuda_graphs import GraphModel
    from specscope.models.llama import Transformer
    from specscope.models.loading import Target, config_from_dict

    config = config_from_dict(cfg)
    model = Transformer(config, dtype=torch.bfloat16, device="cuda")
    model.init_random(0, std=0.05)
    model.setup_cache(2, max_seq_len)
    return Target("test", "native", GraphModel(model) if graphs else model, IdsOnly(), config)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("cfg", [LLAMA, MOE], ids=["llama", "qwen3-moe"])
def test_graphs_match_eager_bf16(cfg):
    from specscope.models.cuda_graphs import GraphModel

    t = target(cfg)
    runner, eager = t.model, t.model.inner
    plain = GraphModel(eager, graphs=False)  # the same kernels, launched one by one
    ids = torch.randint(0, 4096, (1, 200), device="cuda")
    pos = torch.arange(200, device="cuda")[None]
    runner(ids[:, :150], pos[:, :150], [0])  # eager prefill
    for T in (1, 7, 16, 50):
        ref = eager(ids[:, 150:150 + T], pos[:, 150:150 + T], [0])
        out = runner(ids[:, 150:150 + T], pos[:, 150:150 + T], [0])
        assert torch.equal(out, runner(ids[:, 150:150 + T], pos[:, 150:150 + T], [0]))  # replay
        assert torch.equal(out, plain(ids[:, 150:150 + T], pos[:, 150:150 + T], [0]))
        if cfg is LLAMA:  # (a MoE may route a near-tie token differently in bf16)
            assert rel_err(out, ref) < 3e-2
    assert (1, 1, False) in runner._buckets and runner._buckets[(1, 64, False)].graph is not None


@pytest.mark.parametrize("cfg", [LLAMA, MOE], ids=["llama", "qwen3-moe"])
def test_speculative_methods_are_exactly_lossless_on_gpu(cfg):
    # A token gets bitwise the same logits in a decode step and inside a verify step, so
    # greedy speculation reproduces plain decoding exactly, not only up to bf16 near-ties.
    from specscope.drafters import NgramDrafter, NoDrafter, OracleDrafter
    from specscope.engine import Engine

    t = target(cfg)
    prompt = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    none = Engine(t, NoDrafter()).generate_one("p", prompt, 96)
    for drafter in (OracleDrafter({"p": none.output_ids}, 4096, k=7), NgramDrafter(k=8),
                    OracleDrafter({"p": none.output_ids}, 4096, k=7, alpha=0.6, seed=3)):
        c = Engine(t, drafter).generate_one("p", prompt, 96)
        assert c.output_ids == none.output_ids, drafter.name
    assert c.accept_len > 1


def test_grouped_mm_moe_matches_loop():
    from specscope.models.llama import Arch, MoE
    from specscope.models.loading import config_from_dict

    a = Arch.from_config(config_from_dict(MOE))
    moe = MoE(a, dtype=torch.bfloat16, device="cuda")
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, 37, a.hidden, device="cuda", dtype=torch.bfloat16)
    out = moe(x)  # grouped GEMM on the GPU
    flat = x.reshape(-1, a.hidden)
    probs = torch.softmax(moe.router(flat), -1, dtype=torch.float32)
    w, e = probs.topk(a.experts_per_token, -1)
    w = (w / w.sum(-1, keepdim=True)).to(flat.dtype)
    order = torch.argsort(e.flatten(), stable=True)
    counts = torch.bincount(e.flatten(), minlength=a.n_experts).tolist()
    ref = moe._looped(flat, order, order // a.experts_per_token, counts, w)
    assert rel_err(out.reshape(-1, a.hidden), ref) < 1e-2
    assert int(moe.last_touched) == sum(c > 0 for c in counts)


def test_profile_runs_graphs_and_reports_experts():
    from specscope.profile import profile_verify

    t = target(MOE, max_seq_len=600)
    result = profile_verify(t.model, [1, 8, 64], [512], [1, 2], reps=3)
    rows = {(r["batch"], r["tokens"]): r for r in result["rows"]}
    assert rows[(1, 1)]["path"] == "graph" and rows[(2, 64)]["path"] == "eager"
    assert 4 <= rows[(1, 1)]["experts_touched"] <= 4.0 + 1e-9  # one token: exactly top-k experts
    assert rows[(1, 64)]["experts_touched"] > rows[(1, 8)]["experts_touched"] > 4
    assert 0 < rows[(1, 1)]["roofline_frac"] < 1.5 and result["copy_TBps"] > 0.5
