"""The native model against transformers on the same weights, and its KV cache contract."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specscope.models import PRESETS, ModelSpecError, UnsupportedArchitecture, load_target
from specscope.models.hf import HFModel
from specscope.models.llama import Transformer, load_hf_weights
from specscope.models.loading import config_from_dict


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def hf_and_native(cfg_dict, seed=0):
    cfg = config_from_dict(cfg_dict)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger than the default init so every layer matters
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    native = Transformer(cfg)
    load_hf_weights(native, hf.state_dict())
    native.setup_cache(num_slots=2, max_seq_len=256)
    return hf, native


LLAMA3_SCALED = dict(PRESETS["tiny"], rope_theta=500000.0, max_position_embeddings=4096,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=64))
QWEN2 = dict(PRESETS["tiny"], model_type="qwen2", tie_word_embeddings=False)


@pytest.mark.parametrize("cfg", [PRESETS["tiny"], PRESETS["tiny-qwen3"], PRESETS["tiny-moe"], LLAMA3_SCALED, QWEN2],
                         ids=["llama", "qwen3", "qwen3-moe", "llama3-rope-scaling", "qwen2-bias"])
def test_native_logits_match_transformers(cfg):
    hf, native = hf_and_native(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (1, 48))
    ref = hf(input_ids=ids).logits
    out = native(ids, torch.arange(48)[None], [0])
    assert rel_err(out, ref) <= 1e-4
    # Incremental: prefill, then one token, then a 7-token verify-shaped chunk.
    pos = torch.arange(48)[None]
    parts = [native(ids[:, :40], pos[:, :40], [1]), native(ids[:, 40:41], pos[:, 40:41], [1]),
             native(ids[:, 41:], pos[:, 41:], [1])]
    assert rel_err(torch.cat(parts, 1), ref) <= 1e-4


def test_native_smollm2_matches_transformers(smollm2):
    hf = AutoModelForCausalLM.from_config(smollm2.config, dtype=torch.float32).eval()
    hf.load_state_dict({k: v for k, v in _hf_state(smollm2).items()}, strict=False)
    hf.tie_weights()
    ids = torch.tensor([smollm2.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.").input_ids])
    ref = hf(input_ids=ids).logits
    out = smollm2.model(ids, torch.arange(ids.shape[1])[None], [0])
    assert rel_err(out, ref) <= 1e-4


def _hf_state(target):
    from specscope.models.loading import gguf_as_hf_dir, read_hf_dir, smollm2_gguf

    return read_hf_dir(gguf_as_hf_dir(smollm2_gguf()))[1]


def test_a_wrong_weight_is_detected():
    # Guards the parity test itself: a perturbed weight must break the match.
    hf, native = hf_and_native(PRESETS["tiny"])
    with torch.no_grad():
        native.layers[1].mlp.w_down.weight[0, 0] += 1.0
    ids = torch.randint(0, 100, (1, 16))
    assert rel_err(native(ids, torch.arange(16)[None], [0]), hf(input_ids=ids).logits) > 1e-4


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_rollback_equals_fresh_prefill(make_random, backend):
    target = make_random(backend=backend)
    m = target.model
    prompt = torch.randint(0, 1000, (1, 20))
    m(prompt, torch.arange(20)[None], [0])
    root = torch.tensor([[7]])
    # A verify step with 5 drafts of which only the first is accepted...
    drafts = torch.tensor([[7, 11, 12, 13, 14, 15]])
    m(drafts, torch.arange(20, 26)[None], [0])
    # ...commits root and draft 11; the next step feeds the bonus token at position 22.
    after = m(torch.tensor([[99]]), torch.tensor([[22]]), [0])
    fresh_ids = torch.cat([prompt, root, torch.tensor([[11, 99]])], 1)
    fresh = m(fresh_ids, torch.arange(23)[None], [1])[:, -1:]
    assert rel_err(after, fresh) <= 1e-5


def test_kv_len_given_by_the_caller_equals_the_one_read_from_positions(make_random):
    m = make_random().model
    m(torch.randint(0, 1000, (1, 20)), torch.arange(20)[None], [0])
    step, pos = torch.tensor([[3, 4, 5]]), torch.arange(20, 23)[None]
    read = m(step, pos, [0])
    given = m(step, pos, [0], kv_len=23)
    assert torch.equal(read, given)


def test_tree_mask_matches_chain_along_each_path(make_random):
    m = make_random().model
    prompt = torch.randint(0, 1000, (1, 12))
    m(prompt, torch.arange(12)[None], [0])
    # root r with children a, b; a has child c. Nodes: [r, a, b, c], depths 0,1,1,2.
    r, a, b, c = 5, 6, 7, 8
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j != -1:
            mask[0, i, j] = True
            j = parents[j]
    tree = m(torch.tensor([[r, a, b, c]]), torch.tensor([[12 + d for d in depth]]), [0], tree_mask=mask)
    for path, nodes in (([r, a, c], [0, 1, 3]), ([r, b], [0, 2])):
        m(prompt, torch.arange(12)[None], [1])
        chain = m(torch.tensor([path]), torch.arange(12, 12 + len(path))[None], [1])
        assert rel_err(tree[:, nodes], chain) <= 1e-5


def test_hf_backend_matches_native(make_random):
    native = make_random(seed=3)
    hf = make_random(seed=3, backend="hf")
    load_hf_weights(native.model, hf.model.hf.state_dict())
    ids = torch.randint(0, 1000, (1, 30))
    pos = torch.arange(30)[None]
    assert rel_err(native.model(ids, pos, [0]), hf.model(ids, pos, [0])) <= 1e-4
    assert isinstance(hf.model, HFModel)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100}')
    with pytest.raises(UnsupportedArchitecture, match=r"gpt2.*supported: llama.*--backend hf"):
        load_target(f"random:{path}", device="cpu")
    # ...and the fallback runs it.
    target = load_target(f"random:{path}", device="cpu", backend="hf", max_seq_len=64)
    assert target.model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], [0]).shape == (1, 3, 100)


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown model 'nope'"),
    ("random:nope", "unknown random model 'nope'"),
    ("missing.gguf", "GGUF file not found"),
])
def test_bad_model_specs(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        load_target(spec, device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        load_target(str(tmp_path), device="cpu")


def test_hf_checkpoint_directory_and_offline_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf, native = hf_and_native(PRESETS["tiny-qwen3"])
    hf.save_pretrained(tmp_path)
    from specscope.models.loading import gguf_as_hf_dir, load_tokenizer, smollm2_gguf

    load_tokenizer(gguf_as_hf_dir(smollm2_gguf())).save_pretrained(tmp_path)
    target = load_target(str(tmp_path), device="cpu")
    ids = torch.randint(0, 1000, (1, 10))
    assert rel_err(target.model(ids, torch.arange(10)[None], [0]), hf(input_ids=ids).logits) <= 1e-4
