"""CUDA-graph timing shared by the kernel benchmarks (bench/sparse_mla.py, bench/indexer.py), and
the sparse-MLA benchmarks' output comparison."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_graph(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median seconds per call: all calls captured in one CUDA graph, the graph replayed (no
    launch gaps; for kernels of tens of microseconds, where per-launch overhead dominates)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()  # warm-up: compilation, scheduler metadata, allocator pools
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-(token, head) relative error over rows with a non-zero reference."""
    out, ref = out.float(), ref.float()
    norms = ref.norm(dim=-1)
    keep = norms > 0
    if out.isnan().any():
        return float("nan")
    return float(((out - ref).norm(dim=-1)[keep] / norms[keep]).max()) if keep.any() else 0.0
