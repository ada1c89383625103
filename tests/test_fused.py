"""The fused forward and the CUDA-graph runner against the eager native forward, in fp32.

On the CPU the kernels run in Triton's interpreter and the runner runs its bucketing and
padding logic without graphs; on a GPU the same tests run the compiled kernels (and the
runner captures CUDA graphs)."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from specscope.models.cuda_graphs import GraphModel, bucket  # noqa: E402
from specscope.models.fused import FusedForward  # noqa: E402
from specscope.models.llama import Transformer  # noqa: E402
from specscope.models.loading import PRESETS, config_from_dict  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(vocab_size=512, max_position_embeddings=512)
CONFIGS = {
    "llama": dict(PRESETS["tiny"], **SMALL),
    "qwen3": dict(PRESETS["tiny-qwen3"], **SMALL),
    "qwen3-moe": dict(PRESETS["tiny-moe"], **SMALL),
    "qwen2-moe-shared": dict(PRESETS["tiny-moe"], model_type="qwen2_moe", shared_expert_intermediate_size=48,
                             norm_topk_prob=False, **SMALL),
    "qwen2-bias": dict(PRESETS["tiny"], model_type="qwen2", tie_word_embeddings=False, **SMALL),
}


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def build(cfg, seed=0):
    model = Transformer(config_from_dict(cfg), device=DEV)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = torch.randn(p.shape, generator=gen) * 0.1 if p.dim() > 1 else 1 + 0.3 * torch.randn(p.shape, generator=gen)
            p.copy_(v)
    model.setup_cache(num_slots=3, max_seq_len=128)
    return model


def dev_args(positions, slots, nvalid):
    return (positions.to(DEV), torch.tensor(slots, dtype=torch.int32, device=DEV),
            torch.tensor([nvalid], dtype=torch.int32, device=DEV))


# The interpreter is slow (ms per program): llama runs every shape, the others one each.
# (causal verify of a dense model is also covered by the runner test below)
CASES = [("llama", "decode"), ("llama", "tree"), ("qwen3", "tree"), ("qwen3-moe", "verify"),
         ("qwen2-moe-shared", "verify"), ("qwen2-bias", "decode")]
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize("name,shape", CASES)
def test_fused_matches_eager(name, shape):
    model = build(CONFIGS[name])
    fused = FusedForward(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 512, (2, 70), generator=g).to(DEV)
    model(prompt, torch.arange(70, device=DEV).expand(2, 70), [0, 2])  # eager prefill of both slots
    T = {"decode": 1, "verify": 3, "tree": 4}[shape]
    tok = torch.randint(0, 512, (2, T), generator=g).to(DEV)
    mask = None
    if shape == "tree":  # root, two depth-1 siblings, a child of the second: stored side by side
        pos = torch.tensor([[70, 71, 71, 72]] * 2, device=DEV)
        mask = TREE[None].expand(2, 4, 4).to(DEV)
    else:
        pos = torch.arange(70, 70 + T, device=DEV).expand(2, T).contiguous()
    ref = model(tok, pos, [0, 2], tree_mask=mask)
    cache = [layer.attn.k_cache.clone() for layer in model.layers] + [layer.attn.v_cache.clone() for layer in model.layers]
    for layer in model.layers:  # poison the new entries: the fused path must write them
        layer.attn.k_cache[[0, 2], :, 70:70 + T] = float("nan")
        layer.attn.v_cache[[0, 2], :, 70:70 + T] = float("nan")
    out = fused(tok, *dev_args(pos, [0, 2], T), tree_mask=None if mask is None else mask.to(torch.int8).contiguous())
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-4
    after = [layer.attn.k_cache for layer in model.layers] + [layer.attn.v_cache for layer in model.layers]
    for a, b in zip(after, cache):  # the same keys and values the eager path stored (slot 1 untouched)
        assert torch.allclose(a[[0, 2]], b[[0, 2]], atol=1e-5) and torch.equal(a[1], b[1])
    if "moe" in name:
        touched = [int(layer.mlp.last_touched) for layer in model.layers]
        assert fused.experts_touched.tolist() == touched  # same routing as the eager path


@pytest.mark.parametrize("graphs", [False, True] if DEV == "cuda" else [False])
def test_graph_model_pads_to_buckets_without_touching_the_cache(graphs):
    assert [bucket(t) for t in (1, 2, 3, 5, 9, 33, 64, 65)] == [1, 2, 4, 8, 16, 64, 64, None]
    model = build(CONFIGS["llama"])
    runner = GraphModel(model, graphs=graphs)
    assert runner.num_slots == 3 and runner.vocab_size == 512 and runner.device.type == DEV
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 512, (1, 100), generator=g).to(DEV)
    ref_prefill = model(prompt, torch.arange(100, device=DEV)[None], [1], last_only=True)
    assert runner.runs_fused(1, 100) is False  # prefill goes eager
    assert rel_err(runner(prompt, torch.arange(100, device=DEV)[None], [1], last_only=True), ref_prefill) <= 1e-5
    k_before = model.layers[0].attn.k_cache[1, :, 60:64].clone()
    tok = torch.randint(0, 512, (1, 3), generator=g).to(DEV)
    pos = torch.arange(57, 60, device=DEV)[None]  # a rollback: rewrite 57..59 (bucket 4 pads row 60)
    ref = model(tok, pos, [1])
    out = runner(tok, pos, [1])
    assert out.shape == (1, 3, 512) and rel_err(out, ref) <= 1e-4
    assert torch.equal(model.layers[0].attn.k_cache[1, :, 60:64], k_before)  # padding never stored
    last = runner(tok, pos, [1], last_only=True)
    assert last.shape == (1, 1, 512) and rel_err(last, ref[:, -1:]) <= 1e-4
    tok2 = torch.randint(0, 512, (1, 2), generator=g).to(DEV)  # the same bucket again (graph replay)
    pos2 = torch.arange(58, 60, device=DEV)[None]
    ref2 = model(tok2, pos2, [1])
    assert rel_err(runner(tok2, pos2, [1]), ref2) <= 1e-4
