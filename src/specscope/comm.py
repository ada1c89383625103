"""All-reduce latency sweep through torch.distributed (NCCL on GPUs, gloo on CPU), for the
payloads tensor parallelism sends per verify step: T tokens × hidden × 2 bytes (bf16).

Reports per payload the median and p90 latency and the bus bandwidth as nccl-tests'
all_reduce_perf defines it (algbw × 2(n−1)/n), eager and, on GPUs, inside a CUDA graph
(where launch overhead is gone, as in a graph-captured decode step).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class CommResult:
    bytes: int
    tokens: int | None
    mode: str  # eager | graph
    median_us: float
    p90_us: float
    busbw_GBps: float


def payload_sizes(hidden: int, tokens: list[int], dtype_bytes: int = 2) -> list[tuple[int, int]]:
    """(bytes, tokens) per verify width."""
    return [(t * hidden * dtype_bytes, t) for t in tokens]


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    return nbytes / seconds * 2 * (world - 1) / world / 1e9 if seconds > 0 else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_eager(x: torch.Tensor, iters: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(iters):
        dist.barrier()  # start together, so the time is the collective's, not a straggler's wait
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
    return times


def _time_graph(x: torch.Tensor, iters: int, per_graph: int = 20) -> list[float]:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # NCCL needs a warm-up outside capture
        dist.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(per_graph):
            dist.all_reduce(x)
    times = []
    for _ in range(max(1, iters // per_graph)):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / per_graph)
    return times


def _worker(rank: int, world: int, port: int, sizes, iters: int, warmup: int, graph: bool, out_path: str):
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results = []
    try:
        for nbytes, tokens in sizes:
            x = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16, device=device)
            _time_eager(x, warmup, cuda)
            modes = [("eager", _time_eager(x, iters, cuda))]
            if graph and cuda:
                modes.append(("graph", _time_graph(x, iters)))
            for mode, times in modes:
                # The slowest rank sets the step time: reduce each sample with MAX.
                t = torch.tensor(times, dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times = t.tolist()
                median = statistics.median(times)
                p90 = sorted(times)[int(0.9 * (len(times) - 1))]
                results.append(CommResult(nbytes, tokens, mode, median * 1e6, p90 * 1e6,
                                          bus_bandwidth(nbytes, median, world)))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"backend": dist.get_backend(), "world": world, "device": str(device),
                           "results": [asdict(r) for r in results]}, f)
    finally:
        dist.destroy_process_group()


def sweep(world: int, sizes: list[tuple[int, int | None]], iters: int = 50, warmup: int = 5,
          graph: bool = False) -> dict:
    """Runs `world` processes on this machine and returns rank 0's report."""
    if world < 2:
        raise ValueError(f"--world must be >= 2 (an all-reduce over one process moves nothing), got {world}")
    if torch.cuda.is_available() and 1 < torch.cuda.device_count() < world:
        raise ValueError(f"--world {world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    if not sizes:
        raise ValueError("no payload sizes given")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_worker, args=(world, free_port(), sizes, iters, warmup, graph, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)
