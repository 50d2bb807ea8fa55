"""The sparse-MLA launcher's host time per call, eager (no CUDA graph), on a CUDA GPU: a table.

    PYTHONPATH=. python3 bench/sparse_mla_host.py

Under vLLM 0.32.0's piecewise CUDA graphs the attention runs eagerly between the captured pieces,
so every layer pays the launcher's Python (checks, allocations, Triton's JIT dispatch) on the host.
Each row: 300 fp8_ds_mla calls at 8 heads, topk 2048, back to back after a warm-up; "host" is the
time until the last call returned, "wall" until the GPU finished (host > GPU: host-bound), for the
Triton kernel (the launcher's choice outside SM12x) and the Gluon one (forced: SM12x's choice).
The H200 machines are shared: repeat runs moved by up to 1.6x (docs/perf-kernels.md, eighth pass).
"""

from __future__ import annotations

import time

import torch
import triton

from mlafleet.kernels import sparse_mla as sm
from tests.kernels import oracles  # the fp8 cache writer

CALLS = 300


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = 64 * 4096
    cache = oracles.quantize_fp8_ds_mla(torch.randn(slots, 576, device="cuda", generator=gen).bfloat16())
    cache = cache.view(slots // 64, 64, 1, sm.FP8_TOKEN_BYTES)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    print("| s_q x heads | Triton host us/call | Triton wall | Gluon host us/call | Gluon wall |")
    print("|---|---:|---:|---:|---:|")
    for s_q in (1, 32, 64, 256):
        q = torch.randn(s_q, 8, 576, device="cuda", generator=gen).bfloat16()
        idx = torch.randint(0, slots, (s_q, 1, 2048), device="cuda", dtype=torch.int32, generator=gen)
        cells = []
        for cfg in (None, sm.GLUON_FP8):
            for _ in range(20):
                sm.sparse_mla_fwd_fp8(q, cache, idx, 0.0625, config=cfg)
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(CALLS):
                sm.sparse_mla_fwd_fp8(q, cache, idx, 0.0625, config=cfg)
            host = (time.perf_counter() - started) / CALLS
            torch.cuda.synchronize()
            wall = (time.perf_counter() - started) / CALLS
            cells += [f"{host * 1e6:.1f}", f"{wall * 1e6:.1f}"]
        print(f"| {s_q} x 8 | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
