"""Lossless first: with greedy decoding every drafter emits exactly the tokens of `none`."""

import random

import pytest

from specscope.drafters import NgramDrafter, NoDrafter, OracleDrafter
from specscope.engine import Engine, encode_prompt
from specscope.workloads import load_workload

NGRAM_CONFIGS = [dict(k=1, n_min=1, n_max=1), dict(k=4, n_min=2, n_max=3), dict(k=10, n_min=1, n_max=5)]


def outputs(target, drafter, prompts, max_new_tokens):
    return [c.output_ids for c in Engine(target, drafter).generate(prompts, max_new_tokens)]


@pytest.fixture(scope="module")
def smol_prompts(smollm2):
    prompts = load_workload("humaneval", 3) + load_workload("sharegpt", 3)
    return [(p.id, encode_prompt(smollm2, p)) for p in prompts]


@pytest.fixture(scope="module")
def smol_plain(smollm2, smol_prompts):
    return outputs(smollm2, NoDrafter(), smol_prompts, 64)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", NGRAM_CONFIGS, ids=lambda c: f"k{c['k']}-n{c['n_min']}-{c['n_max']}")
def test_smollm2_ngram_equals_plain(smollm2, smol_prompts, smol_plain, cfg):
    engine = Engine(smollm2, NgramDrafter(**cfg))
    done = engine.generate(smol_prompts, 64)
    assert [c.output_ids for c in done] == smol_plain
    assert all(len(o) == 64 or o[-1] in smollm2.eos_ids for o in smol_plain)
    # The drafter must actually have been exercised, or equality proves nothing.
    assert sum(s.accepted for c in done for s in c.steps) > 0


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_smollm2_oracle_equals_plain(smollm2, smol_prompts, smol_plain, alpha):
    refs = {rid: out for (rid, _), out in zip(smol_prompts, smol_plain)}
    done = Engine(smollm2, OracleDrafter(refs, smollm2.model.vocab_size, k=6, alpha=alpha, seed=1)).generate(smol_prompts, 64)
    assert [c.output_ids for c in done] == smol_plain
    accepted = sum(s.accepted for c in done for s in c.steps)
    proposed = sum(s.proposed for c in done for s in c.steps)
    if alpha == 1.0:
        assert accepted == proposed > 0
    elif alpha == 0.0:
        assert accepted == 0 and proposed > 0


def random_prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]) for i in range(n)]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-moe"])
def test_tiny_models_many_prompts(make_random, preset):
    from specscope.models.loading import PRESETS

    # A small vocabulary makes repeats, so the n-gram drafter proposes often; weights
    # larger than the default init keep the outputs from collapsing into one repeated token.
    target = make_random(seed=5, **dict(PRESETS[preset], vocab_size=64, eos_token_id=None, bos_token_id=None,
                                        initializer_range=0.2))
    prompts = random_prompts(40, 64, seed=7)
    plain = outputs(target, NoDrafter(), prompts, 48)
    assert sum(len(set(o)) for o in plain) / len(plain) > 5, "degenerate outputs would make equality trivial"
    for cfg in NGRAM_CONFIGS:
        engine = Engine(target, NgramDrafter(**cfg))
        assert [c.output_ids for c in engine.generate(prompts, 48)] == plain
    refs = {rid: out for (rid, _), out in zip(prompts, plain)}
    for alpha in (0.0, 0.5, 1.0):
        assert outputs(target, OracleDrafter(refs, 64, k=5, alpha=alpha), prompts, 48) == plain


def test_tree_drafts_equal_plain_and_compact_kv(make_random):
    """ngram with branches proposes trees; accepting a later branch moves its KV entries."""
    from specscope.models.loading import PRESETS

    target = make_random(seed=3, **dict(PRESETS["tiny"], vocab_size=16, eos_token_id=None, bos_token_id=None))
    prompts = random_prompts(20, 16, seed=0)
    plain = outputs(target, NoDrafter(), prompts, 40)
    moved = []
    real_compact = target.model.compact_kv
    target.model.compact_kv = lambda slot, src, dst: (moved.append(src.tolist()), real_compact(slot, src, dst))
    for branches in (2, 4):
        engine = Engine(target, NgramDrafter(k=5, n_min=1, n_max=3, branches=branches))
        done = engine.generate(prompts, 40)
        assert [c.output_ids for c in done] == plain
        assert any(s.proposed > 5 for c in done for s in c.steps)  # some drafts were trees
    assert moved, "no step accepted a branch other than the first; compaction untested"
