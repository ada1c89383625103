"""SuffixDecoding (Oliaro et al., 2024; ArcticInference's suffix_decoding, vLLM's
`suffix` method): drafts from occurrence counts of the context's suffixes.

Two suffix structures: one per request over its prompt + output, and one global over
the outputs of the requests that have ended. For every suffix of the context that
occurred before (match length m, 1 <= m < max_depth) a candidate draft is grown below
the match: best-first by estimated probability, a path's probability being the
product of count(child) / count(parent) along it (with `tree=False`, one path that
always takes the most frequent child). Nodes below `min_token_prob` are not drafted;
a candidate has at most min(max_spec_tokens, budget, max_spec_factor * m) nodes and
reaches at most depth max_depth below the root. Its score is the sum of its nodes'
probabilities (their expected accepted tokens); the best score wins, ties going to the
request's own structure, then to the longer match, as in ArcticInference.

Counts are those of a suffix tree whose suffixes are cut at max_depth tokens: count(w)
is the number of occurrences of w (at most max_depth tokens) in the sequences,
including the context's own latest one. So after one earlier occurrence of the
context's suffix, its continuation gets probability 1/2.

The structure is a suffix automaton (one state per set of substrings that end at the
same positions; 2 states per token at most), not ArcticInference's suffix tree: it
gives the same counts, for strings of up to max_depth tokens, in O(1) amortized
states per new token. Counts are kept online: a new token adds an occurrence to each
suffix of at most max_depth tokens, i.e. to each state on one path of at most
max_depth states, in practice a handful (suffixes that occur equally often share a
state); each state also keeps its most frequent next token, fixed on the same walk.
So a step costs the same at 1K and 128K tokens of context, and also when the context
repeats itself (a suffix tree or trie would add up to max_depth nodes per token the
second time a stretch occurs). The global structure is matched incrementally the same
way. Candidates are tried in order of an upper bound on their score (at most cap
nodes each as likely as the best first token, at most max_depth - m levels each
summing to at most the share of occurrences that continue) and the rest skipped once
the bound falls below the best score found, so usually one draft is built.

Differences from ArcticInference: the global structure takes a request's output when
the request ends (ArcticInference adds it token by token, which only matters for
requests running concurrently), and it has no cap on cached requests
(ArcticInference's max_cached_requests, FIFO eviction); probabilities are doubles.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import count

from .base import Draft, check_int

END = -1  # closes a sequence in the global text; never equal to a token
ROOT = 0


class _Automaton:
    """Suffix automaton of a token sequence (or of sequences joined by END), with the
    occurrence count of every state that holds strings of at most max_depth tokens.

    States are ids into flat lists, not objects: millions of small objects would make
    every garbage collection of the process scan them (a dict of ints is not tracked,
    and a few long lists are a few objects). nxt[v]: token -> state; link[v]: the state of the longest suffix of
    v's strings that ends at more positions; v holds the strings of
    length[link[v]] + 1 .. length[v] tokens, all with the same end positions, so the
    same count and the same continuations.
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.nxt: list[dict[int, int]] = [{}]
        self.link, self.length, self.count = [-1], [0], [0]
        self.top, self.top_count = [-1], [0]  # the most frequent next token (the first to get there)
        self.last = ROOT  # the state of the whole text
        self.tail = ROOT  # the state of its last min(max_depth - 1, size) tokens
        self.size = 0
        self.version = 0  # bumped when a sequence is added to a shared structure

    def _state(self, length: int, link: int, nxt: dict, count: int, top: int, top_count: int) -> int:
        self.nxt.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        self.top.append(top)
        self.top_count.append(top_count)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        nxt, link, length, count, top, top_count = self.nxt, self.link, self.length, self.count, self.top, self.top_count
        # The textbook online construction (amortized O(1) states and transitions).
        cur = len(length)  # a new state for the whole text (_state inlined: the hot path)
        nxt.append({})
        link.append(ROOT)
        length.append(length[self.last] + 1)
        count.append(0)
        top.append(-1)
        top_count.append(0)
        p = self.last
        while p != -1:
            step = nxt[p]
            if token in step:
                break
            step[token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # q also holds longer strings that did not just occur: split them off
                clone = self._state(length[p] + 1, link[q], dict(nxt[q]), count[q], top[q], top_count[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        # One more occurrence of each suffix of <= max_depth tokens: they are the old
        # suffixes of < max_depth tokens (the path from the old tail to the root)
        # followed by `token`. The same walk updates the old states' top next token.
        limit = self.max_depth - 1
        old = min(limit, self.size)
        need = min(limit, self.size + 1) - 1  # the new tail is the old suffix of `need` tokens + token
        v = self.tail
        while v and length[link[v]] >= old:
            v = link[v]  # the split above may have moved the old tail's strings up
        counted, tail, real = -1, -1, token != END
        while True:
            u = nxt[v][token]
            if u != counted:
                count[u] += 1
                counted = u
            if real and count[u] > top_count[v]:
                top[v], top_count[v] = token, count[u]
            if tail < 0 and (not v or length[link[v]] < need):
                tail = u
            if not v:
                break
            v = link[v]
        self.tail, self.size = tail, self.size + 1

    def add_sequence(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)
        self.append(END)
        self.version += 1

    def advance(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """The longest suffix (< max_depth tokens) of a context that occurs here, after
        one more context token: (its state, its length)."""
        nxt, link, length = self.nxt, self.link, self.length
        while state and token not in nxt[state]:
            state = link[state]
            matched = length[state]
        if token not in nxt[state]:
            return ROOT, 0
        state, matched = nxt[state][token], matched + 1
        if matched > self.max_depth - 1:
            matched = self.max_depth - 1
            while length[link[state]] >= matched:
                state = link[state]
        return state, matched

    def match(self, context: list[int]) -> tuple[int, int]:
        state, matched = ROOT, 0
        for token in context[-(self.max_depth - 1):]:
            state, matched = self.advance(state, matched, token)
        return state, matched

    def find(self, gram) -> int | None:
        """The state of a string of at most max_depth tokens, or None (tests, tools)."""
        state = ROOT
        for token in gram:
            state = self.nxt[state].get(token)
            if state is None:
                return None
        return state

    def next_counts(self, state: int) -> dict[int, int]:
        return {tok: self.count[u] for tok, u in self.nxt[state].items() if tok != END}

    # ----------------------------------------------------------------------- drafting

    def bounds(self, state: int, is_open: bool) -> tuple[float, float]:
        """(probability of the likeliest first token, share of occurrences that go on):
        the context's own latest occurrence (is_open) and sequence ends do not."""
        n = self.count[state]
        end = self.nxt[state].get(END)
        stopped = is_open + (self.count[end] if end is not None else 0)
        return self.top_count[state] / n, (n - stopped) / n

    def draft_tree(self, state: int, depth: int, cap: int, min_prob: float) -> tuple[Draft, float]:
        """Best-first: the most probable continuations first, each node emitted when it
        is popped (ties: the first pushed; for the last node, the child that reached
        its count first)."""
        tokens, parents, score = [], [], 0.0
        nxt, count_of, max_depth, top, top_count = self.nxt, self.count, self.max_depth, self.top, self.top_count
        push, pop = heapq.heappush, heapq.heappop
        # (-probability, arrival, token, state, depth, parent); the start emits nothing.
        heap: list = [(-1.0, 0, END, state, depth, -1)]
        arrival = count(1)
        while heap:
            neg, _, token, state, depth, parent = pop(heap)
            while True:
                if token != END:
                    tokens.append(token)
                    parents.append(parent)
                    score -= neg
                    if len(tokens) == cap:
                        return Draft(tokens, parents), score
                    parent = len(tokens) - 1
                if depth >= max_depth:
                    break
                prob, total, only = -neg, count_of[state], None
                if len(tokens) == cap - 1:
                    # One token to go: only this state's likeliest child can beat the
                    # heap (a child as likely as the heap's top loses: pushed later).
                    p = prob * top_count[state] / total
                    if p >= min_prob and p > 0.0 and (not heap or -p < heap[0][0]):
                        tokens.append(top[state])
                        parents.append(parent)
                        return Draft(tokens, parents), score + p
                    break
                # `only` holds the first qualifying child until a second one shows up
                # (then both go to the heap and `only` becomes ()).
                for tok, u in nxt[state].items():
                    p = prob * count_of[u] / total
                    if p >= min_prob and tok != END:
                        if only is None:
                            only = (-p, next(arrival), tok, u, depth + 1, parent)
                        else:
                            if only:
                                push(heap, only)
                                only = ()
                            push(heap, (-p, next(arrival), tok, u, depth + 1, parent))
                # A lone child more probable than everything waiting would be popped
                # next: take it without the heap (the common case, a chain).
                if only and (not heap or only[0] < heap[0][0]):
                    neg, _, token, state, depth, parent = only
                    continue
                if only:
                    push(heap, only)
                break
        return Draft(tokens, parents), score

    def draft_chain(self, state: int, depth: int, cap: int, min_prob: float) -> tuple[Draft, float]:
        """One path, always to the most frequent next token."""
        tokens, score, prob = [], 0.0, 1.0
        nxt, count_of, top, top_count = self.nxt, self.count, self.top, self.top_count
        while len(tokens) < cap and depth < self.max_depth and top_count[state]:
            token = top[state]
            u = nxt[state][token]
            p = prob * count_of[u] / count_of[state]
            if p < min_prob:
                break
            prob, state, depth = p, u, depth + 1
            tokens.append(token)
            score += prob
        return Draft.chain(tokens), score


class _Request:
    __slots__ = ("local", "recent", "output", "match", "version")

    def __init__(self, depth: int):
        self.local = _Automaton(depth)  # prompt + output
        self.recent: deque[int] = deque(maxlen=depth - 1)  # to match the context again
        self.output: list[int] = []
        self.match = (ROOT, 0)  # the context's longest suffix in the global structure
        self.version = -1  # the global structure's version the match is for


class SuffixDrafter:
    name = "suffix"

    def __init__(
        self,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_spec_tokens: int = 12,
        tree: bool = True,
    ):
        check_int("--suffix-max-depth", max_depth, 2, " (match plus draft)")
        if isinstance(max_spec_factor, bool) or not isinstance(max_spec_factor, (int, float)) or not max_spec_factor > 0:
            raise ValueError(f"--max-spec-factor must be a number > 0, got {max_spec_factor!r}")
        if isinstance(min_token_prob, bool) or not isinstance(min_token_prob, (int, float)) or not 0 <= min_token_prob <= 1:
            raise ValueError(f"--min-token-prob must be a number in [0, 1], got {min_token_prob!r}")
        check_int("--max-spec-tokens", max_spec_tokens, 1)
        if not isinstance(tree, bool):
            raise ValueError(f"--suffix-tree must be true or false, got {tree!r}")
        self.max_depth, self.max_spec_factor = max_depth, float(max_spec_factor)
        self.min_token_prob, self.max_spec_tokens, self.tree = float(min_token_prob), max_spec_tokens, tree
        self.glob = _Automaton(max_depth)  # outputs of the requests that have ended
        self.requests: dict[str, _Request] = {}
        self._tables: dict[int, tuple[list[int], list[int]]] = {}

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        state = self.requests[req] = _Request(self.max_depth)
        for token in prompt_ids:
            state.local.append(token)
        state.recent.extend(prompt_ids)

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        state = self.requests[req]
        self._sync(state)
        for token in emitted_ids:
            state.local.append(token)
            state.match = self.glob.advance(*state.match, token)
        state.recent.extend(emitted_ids)
        state.output.extend(emitted_ids)

    def _sync(self, state: _Request) -> None:
        if state.version != self.glob.version:
            # A request ended since: match the context afresh (max_depth tokens).
            state.match = self.glob.match(list(state.recent))
            state.version = self.glob.version

    def end(self, req: str) -> None:
        state = self.requests.pop(req, None)
        if state is not None and state.output:
            self.glob.add_sequence(state.output)

    def propose(self, req: str, budget: int) -> Draft:
        return self.choose(req, budget)[0]

    def _limits(self, cap_all: int) -> tuple[list[int], list[int]]:
        """Per match length m: the node cap min(cap_all, max_spec_factor * m) and the
        levels it can fill, min(cap, max_depth - m)."""
        if cap_all not in self._tables:
            caps = [min(cap_all, int(m * self.max_spec_factor + 1e-6)) for m in range(self.max_depth)]
            self._tables[cap_all] = caps, [min(c, self.max_depth - m) for m, c in enumerate(caps)]
        return self._tables[cap_all]

    def choose(self, req: str, budget: int, prune: bool = True) -> tuple[Draft, float, int, int]:
        """(draft, score, 0 if it comes from the request's own structure, 1 if from the
        global one, -1 if empty, match length). prune=False builds every candidate."""
        state = self.requests[req]
        self._sync(state)
        cap_all = min(self.max_spec_tokens, budget)
        if cap_all <= 0:
            return Draft(), 0.0, -1, 0
        min_prob, max_depth, tree = self.min_token_prob, self.max_depth, self.tree
        local = state.local
        caps, levels = self._limits(cap_all)
        # (-bound, rank, -m, ...): the most promising first; rank 0 is the request's own.
        # Every suffix of the match is a candidate; a state holds several lengths.
        # Each node is at most as likely as the best first token, and each level's
        # probabilities sum to at most the share of occurrences that go on. (1 + 1e-9):
        # drafts multiply ratios, whose rounding may exceed the bound.
        candidates = []
        for rank, sam, (v, upper) in (
            (0, local, (local.tail, min(max_depth - 1, local.size))),
            (1, self.glob, state.match),
        ):
            link, length = sam.link, sam.length
            while v:
                p1, go_on = sam.bounds(v, rank == 0)
                if p1 >= min_prob and p1 > 0.0:
                    ms = range(upper, length[link[v]], -1)
                    if tree:
                        p1, go_on = p1 * (1 + 1e-9), go_on * (1 + 1e-9)
                        candidates.extend((-min(caps[m] * p1, levels[m] * go_on), rank, -m, sam, v) for m in ms if caps[m])
                    else:
                        p1 *= 1 + 1e-9
                        candidates.extend((-levels[m] * p1, rank, -m, sam, v) for m in ms if caps[m])
                v = link[v]
                upper = length[v]
        candidates.sort(key=lambda c: c[:3])
        best, best_score, best_key = Draft(), 0.0, (2, 0)
        for neg_bound, rank, neg_m, sam, v in candidates:
            if prune and (-neg_bound < best_score or (-neg_bound == best_score and (rank, neg_m) >= best_key)):
                break  # sorted: nothing after this can win
            grow = sam.draft_tree if tree else sam.draft_chain
            draft, score = grow(v, -neg_m, caps[-neg_m], min_prob)
            if score > best_score or (score == best_score and (rank, neg_m) < best_key):
                best, best_score, best_key = draft, score, (rank, neg_m)
        if not best.tokens:
            return best, 0.0, -1, 0
        return best, best_score, best_key[0], -best_key[1]
