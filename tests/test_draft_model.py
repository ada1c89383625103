"""Model-based drafters: a separate draft model and the target's own first layers
(self-draft). Greedy output equals plain decoding; sampled output is distributed as the
target's, with the draft's real q in play."""

import copy
import dataclasses

import pytest
import torch

from specscope.drafters import DraftModelDrafter, NoDrafter, self_draft
from specscope.engine import Engine, encode_prompt
from specscope.models import load_target
from specscope.models.loading import PRESETS
from specscope.sampling import SamplingParams
from specscope.workloads import load_workload
from test_greedy_equality import outputs, random_prompts
from test_sampling import NEW, PARAMS, PROMPT, SAMPLES, chi2_pvalue, exact_distribution, tiny  # noqa: F401

# Random weights at the default scale make every model predict its input token, so any
# draft would be always right; at this scale drafts are partly rejected.
SMALL = dict(PRESETS["tiny"], vocab_size=64, num_hidden_layers=4, eos_token_id=None, bos_token_id=None,
             initializer_range=0.05)


def accepted_and_proposed(done):
    return sum(s.accepted for c in done for s in c.steps), sum(s.proposed for c in done for s in c.steps)


def count_fed_rows(model):
    """Wrap the draft model's forward to record how many tokens each call feeds."""
    rows, real = [], model.forward
    model.forward = lambda tokens, *a, **kw: (rows.append(tokens.shape[1]), real(tokens, *a, **kw))[1]
    return rows


@pytest.mark.parametrize("draft_vocab", [64, 48, 80], ids=lambda v: f"draft-vocab{v}")
def test_draft_model_greedy_equals_plain(make_random, draft_vocab):
    target = make_random(seed=5, **SMALL)
    # A different random model (other seed, other depth) sharing the tokenizer; its
    # embedding table may be smaller or larger than the target's.
    draft = make_random(seed=6, **dict(SMALL, num_hidden_layers=2, vocab_size=draft_vocab))
    prompts = random_prompts(12, 64, seed=1)
    plain = outputs(target, NoDrafter(), prompts, 40)
    drafter = DraftModelDrafter(draft, target, k=4)
    rows = count_fed_rows(draft.model)
    done = Engine(target, drafter).generate(prompts, 40)
    assert [c.output_ids for c in done] == plain
    accepted, proposed = accepted_and_proposed(done)
    assert 0 < accepted < proposed
    # Catch-up never recomputes cached tokens: after each request's first call (prompt +
    # root) a proposal feeds at most the bonus and the last accepted, never-fed draft.
    assert max(rows) == max(len(p) for _, p in prompts) + 1
    assert sum(r > 2 for r in rows) <= len(prompts)
    assert not drafter.state  # every request's slot was given back
    assert sorted(drafter.free_slots) == list(range(draft.model.num_slots))


@pytest.mark.parametrize("layers,k", [(1, 3), (2, 4), (3, 6)])
def test_self_draft_tiny_greedy_equals_plain(make_random, layers, k):
    target = make_random(seed=5, **SMALL)
    prompts = random_prompts(12, 64, seed=2)
    plain = outputs(target, NoDrafter(), prompts, 40)
    drafter = self_draft(target, layers, k=k)
    done = Engine(target, drafter).generate(prompts, 40)
    assert [c.output_ids for c in done] == plain
    accepted, proposed = accepted_and_proposed(done)
    assert 0 < accepted < proposed
    # The draft runs the target's own tensors, not copies, over its own KV cache.
    full, part = target.model, drafter.model
    assert len(part.layers) == layers
    assert part.layers[0].attn.wqkv.weight is full.layers[0].attn.wqkv.weight
    assert part.lm_head.weight is full.lm_head.weight and part.norm.weight is full.norm.weight
    assert part.layers[0].attn.k_cache.data_ptr() != full.layers[0].attn.k_cache.data_ptr()


@pytest.mark.slow
def test_self_draft_smollm2_greedy_equals_plain(smollm2):
    prompts = [(p.id, encode_prompt(smollm2, p)) for p in load_workload("humaneval", 3)]
    plain = outputs(smollm2, NoDrafter(), prompts, 32)
    done = Engine(smollm2, self_draft(smollm2, 8, k=4)).generate(prompts, 32)
    assert [c.output_ids for c in done] == plain
    assert accepted_and_proposed(done)[0] > 0


@pytest.fixture(scope="module")
def tiny_draft(tiny):
    # Same shape as the vocab-6 target, other weights: q is a real, different distribution
    # (this seed accepts 40-50 % of drafts, so acceptance and rejection both run often).
    return load_target(f"random:{tiny.spec.split(':', 1)[1]}", device="cpu", dtype=torch.float32, max_seq_len=32,
                       seed=5)


def sample(target, drafter, params, n):
    """Output histogram of n requests, and the accepted / proposed draft tokens."""
    engine = Engine(target, drafter, params)
    counts: dict[tuple, int] = {}
    accepted = proposed = 0
    for i in range(n):
        c = engine.generate_one(f"s{i}", PROMPT, NEW)
        counts[tuple(c.output_ids)] = counts.get(tuple(c.output_ids), 0) + 1
        accepted += sum(s.accepted for s in c.steps)
        proposed += sum(s.proposed for s in c.steps)
    return counts, accepted, proposed


@pytest.mark.slow
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-k4-p0.9"])
def test_draft_model_sampling_matches_target(tiny, tiny_draft, params):
    dist = exact_distribution(tiny, params)
    drafter = DraftModelDrafter(tiny_draft, tiny, k=2, sampling=params, seed=7)
    counts, accepted, proposed = sample(tiny, drafter, params, SAMPLES)
    # Both branches of the acceptance rule must have run many times.
    assert 0.1 < accepted / proposed < 0.9, accepted / proposed
    p = chi2_pvalue(counts, dist)
    assert p > 1e-3, f"output distribution differs from the target's (chi-square p={p:.2e})"


class WrongQ(DraftModelDrafter):
    """Samples from the draft's distribution but reports a flatter q."""

    def propose(self, req, budget):
        draft = super().propose(req, budget)
        draft.q = torch.softmax(draft.q.log() * 0.5, dim=-1)
        return draft


def test_sampling_check_catches_a_wrong_q(tiny, tiny_draft):
    # Dropping q would not do: a sampled draft verified as a point mass is still lossless
    # (only accepted less often). A q that is not the sampling distribution is not.
    params = PARAMS[0]
    counts, _, _ = sample(tiny, WrongQ(tiny_draft, tiny, k=2, sampling=params, seed=7), params, SAMPLES // 4)
    assert chi2_pvalue(counts, exact_distribution(tiny, params)) < 1e-6


def test_sampling_q_is_the_draft_distribution_over_the_target_vocab(make_random):
    target = make_random(seed=5, **SMALL)
    draft = make_random(seed=6, **dict(SMALL, vocab_size=48))
    drafter = DraftModelDrafter(draft, target, k=3, sampling=SamplingParams(temperature=1.0))
    drafter.begin("r", [3, 4, 5])
    drafter.observe("r", [6])
    d = drafter.propose("r", 8)
    assert len(d) == 3 and d.q.shape == (3, 64)
    assert torch.allclose(d.q.sum(-1), torch.ones(3)) and (d.q[:, 48:] == 0).all()
    assert all(d.q[i, t] > 0 for i, t in enumerate(d.tokens))
    assert len(drafter.propose("r", 2)) == 2  # the engine's budget caps k


def test_tokenizer_mismatch_is_refused(make_random):
    target = make_random(seed=5, **SMALL)
    draft = make_random(seed=6, **SMALL)
    extra = copy.deepcopy(target.tokenizer)
    extra.add_tokens(["<draft_only>"])
    with pytest.raises(ValueError, match=r"tokenizers differ.*only in the draft's.*<draft_only>"):
        DraftModelDrafter(dataclasses.replace(draft, tokenizer=extra), target)
    other_eos = copy.deepcopy(target.tokenizer)
    other_eos.eos_token = "<|endoftext|>"
    with pytest.raises(ValueError, match="eos_token_id 0 vs 2"):
        DraftModelDrafter(dataclasses.replace(draft, tokenizer=other_eos), target)


def test_bad_arguments(make_random):
    target = make_random(seed=5, **SMALL)
    for layers in (0, 4, -1):
        with pytest.raises(ValueError, match=r"--draft-layers must be between 1 and 3 .*\(4 layers\)"):
            self_draft(target, layers)
    with pytest.raises(ValueError, match="--k"):
        self_draft(target, 2, k=0)
    with pytest.raises(ValueError, match="native backend"):
        self_draft(make_random(seed=5, backend="hf", **SMALL), 2)


def test_draft_model_on_hf_backend_equals_plain(make_random):
    # The drafter relies only on the forward contract, which the hf fallback also keeps.
    target = make_random(seed=5, **SMALL)
    draft = make_random(seed=6, backend="hf", **dict(SMALL, num_hidden_layers=2))
    prompts = random_prompts(6, 64, seed=3)
    done = Engine(target, DraftModelDrafter(draft, target, k=4)).generate(prompts, 32)
    assert [c.output_ids for c in done] == outputs(target, NoDrafter(), prompts, 32)
    accepted, proposed = accepted_and_proposed(done)
    assert 0 < accepted < proposed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_drafters_on_gpu_graphs_are_exactly_lossless():
    # On the GPU the self-draft runs through the CUDA-graph runner and fused kernels, over
    # the target's own bf16 tensors.
    from test_gpu import LLAMA, target

    t = target(LLAMA)
    other = target(LLAMA)
    other.model.inner.init_random(1, std=0.05)
    other = dataclasses.replace(other, tokenizer=t.tokenizer)
    prompt = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    none = Engine(t, NoDrafter()).generate_one("p", prompt, 96)
    sd = self_draft(t, 2, k=4)
    assert sd.model.fused is not None
    assert sd.model.inner.layers[1].mlp.w_down.weight is t.model.inner.layers[1].mlp.w_down.weight
    for drafter in (sd, DraftModelDrafter(other, t, k=3)):
        c = Engine(t, drafter).generate_one("p", prompt, 96)
        assert c.output_ids == none.output_ids, drafter.name
        assert sum(s.proposed for s in c.steps) > 0
    assert sum(s.accepted for s in Engine(t, self_draft(t, 3, k=4)).generate_one("p", prompt, 96).steps) > 0
