"""Tensor parallelism for the native model (Megatron-style), through torch.distributed.

Launched with torchrun: every rank runs the same engine loop on the same inputs and holds
a slice of every layer. QKV and gate/up are column-parallel (each rank owns whole heads and
a slice of the intermediate width) and need no communication; o_proj and the MLP (or MoE)
are row-parallel, so their outputs are partial sums, all-reduced once each: 2 all-reduces
per layer. The embedding is vocab-parallel (one more all-reduce) and the lm_head's vocab
slices are all-gathered into full logits. MoE experts are split the same way: every rank
holds a slice of every expert's intermediate width, so routing is unchanged and the MoE
output is one partial sum.

Every collective is counted (calls and bytes) so a step trace can say what the verify paid
in communication; with `timed` on, each one is also timed (that adds a synchronisation).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .llama import MLP, MoE, Transformer


@dataclass
class CommStats:
    count: int = 0
    bytes: int = 0
    ms: float | None = None


class TPGroup:
    def __init__(self, rank: int, world: int, timed: bool = False):
        self.rank, self.world, self.timed = rank, world, timed
        self.stats = CommStats(ms=0.0 if timed else None)

    def take_stats(self) -> CommStats:
        stats, self.stats = self.stats, CommStats(ms=0.0 if self.timed else None)
        return stats

    def _account(self, x: torch.Tensor, op) -> None:
        self.stats.count += 1
        self.stats.bytes += x.numel() * x.element_size()
        if not self.timed:
            op()
            return
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        op()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.stats.ms += (time.perf_counter() - t0) * 1e3

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._account(x, lambda: dist.all_reduce(x))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._account(x, lambda: dist.all_gather(parts, x.contiguous()))
        return torch.cat(parts, dim=-1)


def init_from_env(device: str) -> TPGroup | None:
    """The torchrun environment → a process group, or None when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return TPGroup(rank, world, timed=os.environ.get("SPECSCOPE_TP_TIMED") == "1")


class AllReduceAfter(nn.Module):
    """A row-parallel part: each rank's output is a partial sum."""

    def __init__(self, inner: nn.Module, tp: TPGroup):
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, x):
        return self.tp.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup):
        super().__init__()
        self.weight, self.start, self.tp = nn.Parameter(weight, requires_grad=False), start, tp

    def forward(self, ids):
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(x)


class GatheredHead(nn.Module):
    def __init__(self, weight: torch.Tensor, tp: TPGroup):
        super().__init__()
        self.weight, self.tp = nn.Parameter(weight, requires_grad=False), tp

    def forward(self, x):
        return self.tp.all_gather_last(F.linear(x, self.weight))


def _split(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].contiguous()


def _shard_gate_up(w: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    gate, up = w.chunk(2, dim=dim)
    return torch.cat([_split(gate, dim, rank, world), _split(up, dim, rank, world)], dim=dim)


def _shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    mlp.w_gate_up.weight = nn.Parameter(_shard_gate_up(mlp.w_gate_up.weight.data, 0, rank, world), requires_grad=False)
    mlp.w_down.weight = nn.Parameter(_split(mlp.w_down.weight.data, 1, rank, world), requires_grad=False)


def shard(model: Transformer, tp: TPGroup) -> Transformer:
    """Keep this rank's slice of every weight (in place) and insert the collectives.
    Call before setup_cache: the cache holds only this rank's KV heads."""
    a, rank, world = model.arch, tp.rank, tp.world
    for what, n in (("attention heads", a.n_heads), ("KV heads", a.n_kv_heads), ("vocabulary", a.vocab_size),
                    ("MLP width", a.intermediate if not a.n_experts else a.moe_intermediate)):
        if n % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs the {what} ({n}) divisible by {world}")
    hd = a.head_dim
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.attn
            q, k, v = attn.wqkv.weight.data.split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd])
            attn.wqkv.weight = nn.Parameter(torch.cat([_split(t, 0, rank, world) for t in (q, k, v)]), requires_grad=False)
            if attn.wqkv.bias is not None:
                qb, kb, vb = attn.wqkv.bias.data.split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd])
                attn.wqkv.bias = nn.Parameter(torch.cat([_split(t, 0, rank, world) for t in (qb, kb, vb)]),
                                              requires_grad=False)
            attn.n_heads, attn.n_kv = a.n_heads // world, a.n_kv_heads // world
            attn.wo.weight = nn.Parameter(_split(attn.wo.weight.data, 1, rank, world), requires_grad=False)
            attn.wo = AllReduceAfter(attn.wo, tp)
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                mlp.gate_up = nn.Parameter(_shard_gate_up(mlp.gate_up.data, 1, rank, world), requires_grad=False)
                mlp.down = nn.Parameter(_split(mlp.down.data, 2, rank, world), requires_grad=False)
                if mlp.shared is not None:
                    _shard_mlp(mlp.shared, rank, world)
            else:
                _shard_mlp(mlp, rank, world)
            layer.mlp = AllReduceAfter(mlp, tp)
        per_rank = a.vocab_size // world
        embed = _split(model.embed.weight.data, 0, rank, world)
        head = embed if a.tie_embeddings else _split(model.lm_head.weight.data, 0, rank, world)
        model.embed = VocabParallelEmbedding(embed, rank * per_rank, tp)
        model.lm_head = GatheredHead(head, tp)
    model.tp = tp
    return model
