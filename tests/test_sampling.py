"""Lossless sampling: speculation's output distribution equals the target's, checked by a
chi-square test against the exact distribution of short continuations of a tiny model."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specscope.drafters.base import Draft
from specscope.drafters import NoDrafter
from specscope.drafters.ngram import trie_draft
from specscope.engine import Engine
from specscope.sampling import SamplingParams, probs

VOCAB, NEW, SAMPLES = 6, 3, 20_000
PROMPT = [1, 4, 2]


class FixedDrafter:
    """Point-mass drafter proposing the continuation of fixed token paths at the current
    output position: one path is a chain, several merge into a tree."""

    name = "fixed"

    def __init__(self, *paths):
        self.paths, self.n = paths, 0

    def begin(self, req, prompt_ids):
        self.n = 0

    def propose(self, req, budget):
        return trie_draft([list(p[self.n : self.n + budget]) for p in self.paths], budget)

    def observe(self, req, emitted_ids):
        self.n += len(emitted_ids)

    def end(self, req):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import json

    from specscope.models import load_target
    from specscope.models.loading import PRESETS

    path = tmp_path_factory.mktemp("cfg") / "tiny6.json"
    # Large random weights give a peaked, position-dependent distribution.
    path.write_text(json.dumps(dict(PRESETS["tiny"], vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                    eos_token_id=None, bos_token_id=None, initializer_range=0.6)))
    return load_target(f"random:{path}", device="cpu", dtype=torch.float32, max_seq_len=32, seed=3)


def exact_distribution(target, params):
    """P(output | prompt) over every output of up to NEW tokens (ending early at EOS),
    by enumeration with fresh prefills — no engine involved."""
    m, eos = target.model, target.eos_ids
    dist = {}

    def expand(prefix, p_prefix):
        ids = torch.tensor([PROMPT + list(prefix)])
        logits = m(ids, torch.arange(ids.shape[1])[None], [0], last_only=True)[0, -1]
        p = probs(logits, params)
        for x in range(VOCAB):
            seq, px = prefix + (x,), p_prefix * float(p[x])
            if px == 0.0:
                continue
            if len(seq) == NEW or x in eos:
                dist[seq] = px
            else:
                expand(seq, px)

    expand((), 1.0)
    return dist


def sample_counts(target, drafter, params, n=SAMPLES):
    engine = Engine(target, drafter, params)
    counts: dict[tuple, int] = {}
    for i in range(n):
        out = tuple(engine.generate_one(f"s{i}", PROMPT, NEW).output_ids)
        counts[out] = counts.get(out, 0) + 1
    return counts


def chi2_pvalue(counts, dist):
    n = sum(counts.values())
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for seq, p in dist.items():
        if n * p >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(n * p)
        else:  # pool rare outcomes so the chi-square approximation holds
            rest_o += counts.get(seq, 0)
            rest_e += n * p
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    assert sum(counts.values()) == n and set(counts) <= set(dist)
    scale = n / sum(expected)  # fp32 probabilities sum to 1 only up to rounding
    return chisquare(observed, [e * scale for e in expected]).pvalue


PARAMS = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=12)]


@pytest.mark.slow
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-k4-p0.9"])
def test_speculative_sampling_matches_target(tiny, params):
    # The reference is the exact target distribution, a stronger check than comparing
    # with plain sampling's (noisy) histogram; test_chi_square_has_power shows it can fail.
    dist = exact_distribution(tiny, params)
    mode = max(dist, key=dist.get)
    worst = min(dist, key=dist.get)
    ranked = sorted(dist, key=dist.get, reverse=True)
    drafters = {
        "chain, good (mode path)": FixedDrafter(mode),
        "chain, bad (least likely path)": FixedDrafter(worst),
        # Trees: siblings are tried in turn with the residual distribution (SpecInfer).
        "tree, good (3 most likely paths)": FixedDrafter(*ranked[:3]),
        "tree, bad (3 least likely paths)": FixedDrafter(*ranked[-3:]),
    }
    for name, drafter in drafters.items():
        p = chi2_pvalue(sample_counts(tiny, drafter, params), dist)
        assert p > 1e-3, f"{name}: output distribution differs from the target's (chi-square p={p:.2e})"


def test_draft_probabilities_q_keep_sampling_lossless():
    """verify with a chain drafter that samples from its own q: with context-free logits the
    emitted tokens must be distributed as the product of the target's per-position p."""
    from specscope.verify import verify

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(NEW, VOCAB, generator=gen) * 1.5  # row i scores output position i
    q = torch.softmax(torch.randn(NEW - 1, VOCAB, generator=gen) * 2, dim=-1)
    params = SamplingParams(temperature=1.0)
    p = probs(logits, params)
    dist = {seq: float(p[0, seq[0]] * p[1, seq[1]] * p[2, seq[2]])
            for seq in itertools.product(range(VOCAB), repeat=NEW)}
    counts: dict[tuple, int] = {}
    for _ in range(SAMPLES):
        out: list[int] = []
        while len(out) < NEW:  # each round drafts the rest from q and verifies it
            pos = len(out)
            drafted = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(pos, NEW - 1)]
            path, nxt = verify(logits[pos:], Draft.chain(drafted, q=q[pos:]), params, gen)
            out += drafted[: len(path)] + [nxt]
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert chi2_pvalue(counts, dist) > 1e-3


def test_chi_square_has_power(tiny):
    # The same test must reject samples from a slightly different distribution.
    dist = exact_distribution(tiny, SamplingParams(temperature=0.8))
    counts = sample_counts(tiny, NoDrafter(), SamplingParams(temperature=1.0, seed=5), n=SAMPLES // 2)
    assert chi2_pvalue(counts, dist) < 1e-6


def test_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (p[0, 1:] == 0).all()  # the top token alone holds > 0.5
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
