"""CUDA graphs over the fused forward: the native model with the host out of the way.

`GraphModel` wraps a native Transformer and keeps its forward contract
(`forward(tokens[B,T], positions[B,T], slots, tree_mask=None, taps=None, last_only=False)
-> fp32 logits`). A call with B·T ≤ 64 rows runs as a captured CUDA graph of the fused
forward (fused.py): one graph per bucket (B, T rounded up to 1, 2, 4, …, 64, causal or
tree), captured on first use, over static input buffers. T is padded up to its bucket;
padding rows are computed but never stored in the KV cache (the kernels skip rows past
`nvalid`) and never seen by real rows, so a 5-token verify runs the 8-token graph at the
8-token price — which is about the 1-token price, since the step streams the weights
once either way. Nothing in a call reads back to the host; the engine's one sync per
step is its own read of the accepted tokens.

Prefill (more rows), hidden-state taps and CPU runs go to the wrapped model's eager
forward, which shares the KV cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from .llama import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_ROWS = 64


def bucket(t: int) -> int | None:
    return next((b for b in BUCKETS if b >= t), None)


@dataclass
class _Bucket:
    tokens: torch.Tensor  # [B, Tb] int64
    positions: torch.Tensor  # [B, Tb] int64
    slots: torch.Tensor  # [B] int32
    nvalid: torch.Tensor  # [1] int32: real rows of this call
    tree: torch.Tensor | None  # [B, Tb, Tb] int8
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    slots_list: list | None = None  # host copy of `slots`, to skip re-uploading


class GraphModel(nn.Module):
    def __init__(self, model: Transformer, graphs: bool = True, fused: bool = True):
        super().__init__()
        self.inner = model
        self.use_graphs = graphs and model.device.type == "cuda"
        self.use_fused = fused
        self._reset()

    def _reset(self) -> None:
        from .fused import FusedForward, supported

        self.fused = None
        self.fused_unavailable = supported(self.inner) if self.use_fused else "disabled"
        if self.fused_unavailable is None:
            self.fused = FusedForward(self.inner)
        self._buckets: dict[tuple, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def __getattr__(self, name):
        # Everything else (device, dtype, arch, num_slots, max_seq_len, …) is the model's.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def setup_cache(self, num_slots: int, max_seq_len: int) -> None:
        self.inner.setup_cache(num_slots, max_seq_len)
        self._reset()  # graphs hold pointers to the old cache

    def reset_slot(self, slot: int) -> None:
        self.inner.reset_slot(slot)

    @property
    def experts_touched(self) -> torch.Tensor | None:
        """Distinct experts per MoE layer in the last fused call (device tensor)."""
        return self.fused.experts_touched if self.fused is not None else None

    def runs_fused(self, batch: int, t: int, taps=None) -> bool:
        tb = bucket(t)
        return self.fused is not None and not taps and tb is not None and batch * tb <= MAX_ROWS

    @torch.inference_mode()
    def forward(self, tokens, positions, slots, tree_mask=None, taps=None, last_only=False):
        B, T = tokens.shape
        if not self.runs_fused(B, T, taps):
            return self.inner(tokens, positions, slots, tree_mask=tree_mask, taps=taps, last_only=last_only)
        key = (B, bucket(T), tree_mask is not None)
        b = self._buckets.get(key)
        fresh = b is None
        if fresh:
            b = self._buckets[key] = self._new_bucket(*key)
        self._load(b, tokens, positions, slots, tree_mask, T)
        if not self.use_graphs:
            b.logits = self._run(b)
        elif fresh:
            self._capture(b)
            b.graph.replay()
        else:
            b.graph.replay()
        # A copy: the graph's output buffer is overwritten by the next call.
        return (b.logits[:, T - 1 : T] if last_only else b.logits[:, :T]).clone()

    def _new_bucket(self, B: int, tb: int, tree: bool) -> _Bucket:
        dev = self.inner.device
        return _Bucket(
            tokens=torch.zeros((B, tb), dtype=torch.int64, device=dev),
            positions=torch.zeros((B, tb), dtype=torch.int64, device=dev),
            slots=torch.zeros(B, dtype=torch.int32, device=dev),
            nvalid=torch.full((1,), tb, dtype=torch.int32, device=dev),
            tree=torch.zeros((B, tb, tb), dtype=torch.int8, device=dev) if tree else None,
        )

    def _load(self, b: _Bucket, tokens, positions, slots, tree_mask, T: int) -> None:
        b.tokens[:, :T].copy_(tokens, non_blocking=True)
        b.positions[:, :T].copy_(positions, non_blocking=True)
        if torch.is_tensor(slots):
            b.slots.copy_(slots, non_blocking=True)
            b.slots_list = None
        else:
            slots = list(slots)
            if slots != b.slots_list:
                b.slots.copy_(torch.tensor(slots, dtype=torch.int32))
                b.slots_list = slots
        b.nvalid.fill_(T)
        if tree_mask is not None:
            # Columns past T may hold an earlier call's mask; the kernels ignore them (nvalid).
            b.tree[:, :T, :T].copy_(tree_mask, non_blocking=True)

    def _run(self, b: _Bucket) -> torch.Tensor:
        return self.fused(b.tokens, b.positions, b.slots, b.nvalid, tree_mask=b.tree)

    def _capture(self, b: _Bucket) -> None:
        # Warm up on a side stream first: Triton compiles its kernels and the allocator
        # settles. The warm-up writes this call's KV entries, which the replay rewrites
        # with the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(b)
        torch.cuda.current_stream().wait_stream(side)
        b.graph = torch.cuda.CUDAGraph()
        # One memory pool for all buckets: they never run concurrently, so their
        # intermediates can share memory; each bucket's output buffer stays its own.
        with torch.cuda.graph(b.graph, pool=self._pool):
            b.logits = self._run(b)


def wrap(model: Transformer) -> nn.Module:
    """The model to hand to the engine: on a GPU the CUDA-graph runner (unless
    SPECSCOPE_CUDA_GRAPHS=0), else the model itself."""
    if model.device.type != "cuda" or os.environ.get("SPECSCOPE_CUDA_GRAPHS", "1") == "0":
        return model
    if getattr(model, "tp", None) is not None:  # the fused kernels do not run tensor-parallel
        return model
    return GraphModel(model)
