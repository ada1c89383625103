"""SGLang's NGRAM drafter: one n-gram trie shared by every request.

What SGLang does (python/sglang/srt/speculative/cpp_ngram, read 2026-11):
- After every verify step it inserts, for each running request, the last
  `max_trie_depth` tokens of prompt + output: every suffix of that window becomes a
  trie path of at most `max_trie_depth` tokens. The body of the prompt is never
  inserted (`insert_prompt=True` here inserts it too).
- The anchors of a draft are the trie nodes of the context's suffixes (1 up to
  `max_trie_depth` tokens) that have children, the longest match first.
- "BFS" (`match_type="bfs"`): from each anchor a breadth-first walk over children in
  recency order, most recently seen first. The breadth is `max_bfs_breadth` for short
  matches and shrinks linearly to `min_bfs_breadth` for the longest, and by the same
  step at each level further down: a long match is trusted, so it grows a chain.
- "PROB" (`match_type="prob"`): best-first by estimated path probability; a node's top
  `max_bfs_breadth` children by frequency share its probability in proportion.
- The anchors' trees merge into one (the same token under the same parent is one
  node) until it holds `num_draft_tokens` - 1 nodes: like SGLang's
  --speculative-num-draft-tokens, the count includes the root (the last emitted token).
- At most `capacity` nodes; the least recently used ones are evicted.

Where this file differs, and why:
- No zero padding: SGLang always verifies exactly num_draft_tokens tokens (fixed shapes
  for CUDA graphs) and pads a short draft with token 0. We return only real nodes; a
  replay of SGLang's verify cost must add the padding back.
- Counts: SGLang re-inserts the whole window every step, so an occurrence of an n-gram
  is counted once per step it stays inside the window (max_trie_depth - n + 1 times at
  one token per step, fewer when steps emit several). We count each occurrence once:
  max_trie_depth node visits per new token instead of about max_trie_depth**2 / 2 per
  step. Recency order is the same (the most recent occurrence wins), and PROB's
  shares among siblings differ only through occurrences still inside the window.
  SGLang also misses the long n-grams that start before the window of a step that
  emitted several tokens; we insert them.
- Eviction: SGLang evicts least recently used leaves one by one. We evict the least
  recently used node with its subtree: a node is touched when its n-gram occurs,
  so its descendants were last touched at most max_trie_depth tokens later.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from itertools import count, islice

from .base import Draft, check_int

MATCH_TYPES = ("bfs", "prob")
ROOT = 0


class TrieDrafter:
    name = "trie"

    def __init__(
        self,
        max_trie_depth: int = 18,
        max_bfs_breadth: int = 10,
        num_draft_tokens: int = 12,
        match_type: str = "bfs",
        capacity: int = 10_000_000,
        insert_prompt: bool = False,
        min_bfs_breadth: int = 1,
    ):
        check_int("--max-trie-depth", max_trie_depth, 2, " (a match needs one more level to draft from)")
        check_int("--min-bfs-breadth", min_bfs_breadth, 1)
        check_int("--max-bfs-breadth", max_bfs_breadth, min_bfs_breadth, " (--min-bfs-breadth)")
        check_int("--num-draft-tokens", num_draft_tokens, 2, " (it counts the root, as SGLang's does)")
        # With this many nodes the n-grams of the live context (touched within the last
        # max_trie_depth tokens) are never the least recently used, so a request's
        # cursors survive its own insertions.
        check_int("--capacity", capacity, max_trie_depth**2, f" (--max-trie-depth squared, {max_trie_depth}**2)")
        if not isinstance(match_type, str) or match_type.lower() not in MATCH_TYPES:
            raise ValueError(f"--match-type must be one of {', '.join(MATCH_TYPES)} (SGLang's BFS, PROB), got {match_type!r}")
        if not isinstance(insert_prompt, bool):
            raise ValueError(f"--insert-prompt must be true or false, got {insert_prompt!r}")
        self.max_trie_depth, self.min_bfs_breadth, self.max_bfs_breadth = max_trie_depth, min_bfs_breadth, max_bfs_breadth
        self.num_draft_tokens, self.match_type = num_draft_tokens, match_type.lower()
        self.capacity, self.insert_prompt = capacity, insert_prompt
        # SGLang's breadth schedule: (max - min) spread over the possible match lengths.
        self.longest_match = max(1, max_trie_depth - 1)
        self.breadth_step = (max_bfs_breadth - min_bfs_breadth) / self.longest_match
        # Node i lives in flat lists, not in an object per node: with millions of node
        # objects every garbage collection scanned them all (measured: 2.5x the cost
        # of the drafting itself), while a dict of ints is not tracked at all and a
        # few long lists are a few objects. kids[i]: token -> child, least recently
        # seen first (None until the first child: most nodes are deep and never get
        # one); depth -1: evicted.
        self.kids: list[dict[int, int] | None] = [None]
        self.freq, self.token, self.parent, self.depth = [0], [-1], [-1], [0]
        self.free: list[int] = []  # ids of evicted nodes, for reuse
        self.lru: OrderedDict[int, None] = OrderedDict()  # every node but the root, oldest first
        self.evicted = 0  # nodes evicted so far
        # Per request, the nodes of the n-grams that end at its last token, longest
        # first: where its next token's n-grams go, and its draft's anchors.
        self.cursors: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ the protocol

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        self.cursors[req] = []
        # SGLang's first insertion is the window at the end of the prompt.
        self.observe(req, prompt_ids if self.insert_prompt else prompt_ids[-self.max_trie_depth:])

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        for token in emitted_ids:
            self.cursors[req] = self._insert(self.cursors[req], token)
            if len(self.lru) > self.capacity:
                self._evict()

    def propose(self, req: str, budget: int) -> Draft:
        n = min(budget, self.num_draft_tokens - 1)
        if n <= 0:
            return Draft()
        kids = self.kids
        anchors = [c for c in self.cursors[req] if kids[c]]
        if self.match_type == "bfs":
            return self._bfs(anchors, n)
        return self._prob(anchors, n)

    def end(self, req: str) -> None:
        self.cursors.pop(req, None)

    # --------------------------------------------------------------------- insertion

    def _insert(self, cursors: list[int], token: int) -> list[int]:
        """One more occurrence of each n-gram ending at `token`: the cursors' children."""
        max_depth, kids, freq, depth, lru = self.max_trie_depth, self.kids, self.freq, self.depth, self.lru
        token_of, parent_of, free, touch = self.token, self.parent, self.free, lru.move_to_end
        nxt = []
        for node in (*cursors, ROOT):
            d = depth[node]
            if d == max_depth:
                continue  # the n-gram would be longer than the trie is deep
            k = kids[node]
            if k is None:
                k = kids[node] = {}
                child = None
            else:
                child = k.pop(token, None)
            if child is None:
                # A new node (_new_node inlined: this is the hot path of a step).
                if free:
                    child = free.pop()
                    kids[child], freq[child], token_of[child], parent_of[child], depth[child] = None, 1, token, node, d + 1
                else:
                    child = len(depth)
                    kids.append(None)
                    freq.append(1)
                    token_of.append(token)
                    parent_of.append(node)
                    depth.append(d + 1)
                lru[child] = None
            else:
                freq[child] += 1
                touch(child)
            k[token] = child  # re-inserted last: the dict stays in recency order
            nxt.append(child)
        return nxt

    def _evict(self) -> None:
        lru, kids, depth = self.lru, self.kids, self.depth
        while len(lru) > self.capacity:
            node, _ = lru.popitem(last=False)
            del kids[self.parent[node]][self.token[node]]
            stack = [node]
            while stack:
                n = stack.pop()
                if kids[n]:
                    for child in kids[n].values():
                        del lru[child]
                        stack.append(child)
                kids[n], depth[n] = None, -1
                self.free.append(n)
                self.evicted += 1
        # Another request's insertions can evict a request's cursors (its own cannot, see
        # capacity): drop them now, before their ids are reused.
        for req, cursors in self.cursors.items():
            self.cursors[req] = [c for c in cursors if depth[c] >= 0]

    # ----------------------------------------------------------------------- drafting

    def _bfs(self, anchors: list[int], n: int) -> Draft:
        tokens, parents = [], []
        index: dict[tuple[int, int], int] = {}  # (parent draft node, token) -> draft node: anchors' trees merge
        kids, depth, token_of = self.kids, self.depth, self.token
        step, longest, low = self.breadth_step, self.longest_match, self.min_bfs_breadth
        for anchor in anchors:
            queue = deque([(-1, (longest - depth[anchor]) * step + low, anchor)])
            while queue:
                parent, breadth, node = queue.popleft()
                k = kids[node]
                if not k:
                    continue
                # The most recent children first; int() truncates like SGLang's cast.
                width = int(breadth)
                for token, child in islice(reversed(k.items()), width if width > 1 else 1):
                    key = (parent, token)
                    i = index.get(key)
                    if i is None:
                        i = index[key] = len(tokens)
                        tokens.append(token)
                        parents.append(parent)
                        if len(tokens) == n:
                            return Draft(tokens, parents)
                    queue.append((i, breadth - step, child))
        return Draft(tokens, parents)

    def _prob(self, anchors: list[int], n: int) -> Draft:
        tokens, parents = [], []
        index: dict[tuple[int, int], int] = {}
        # (-probability, arrival, parent draft node, trie node): ties go to the first
        # pushed. As in SGLang the heap is shared by the anchors: a shorter anchor only
        # adds what the longer ones left room for.
        heap: list = []
        arrival = count()
        for anchor in anchors:
            self._push_children(heap, arrival, -1, anchor, 1.0)
            while heap and len(tokens) < n:
                neg, _, parent, child = heapq.heappop(heap)
                key = (parent, self.token[child])
                i = index.get(key)
                if i is None:
                    i = index[key] = len(tokens)
                    tokens.append(key[1])
                    parents.append(parent)
                self._push_children(heap, arrival, i, child, -neg)
            if len(tokens) >= n:
                break
        return Draft(tokens, parents)

    def _push_children(self, heap: list, arrival, parent: int, node: int, prob: float) -> None:
        """The node's top max_bfs_breadth children by frequency (then token), sharing prob."""
        if not self.kids[node]:
            return
        freq = self.freq
        best = heapq.nsmallest(self.max_bfs_breadth, self.kids[node].items(), key=lambda kv: (-freq[kv[1]], kv[0]))
        total = sum(freq[child] for _, child in best)
        for _, child in best:
            heapq.heappush(heap, (-freq[child] / total * prob, next(arrival), parent, child))
