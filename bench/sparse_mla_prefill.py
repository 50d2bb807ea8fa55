"""fp8_ds_mla prefill: the fp8 kernel on the cache against a bf16 workspace of the context.

    PYTHONPATH=. python3 bench/sparse_mla_prefill.py --out sparse_mla_prefill.json

Issue 16 (CUDA GPU only). The kernel benchmark (bench/sparse_mla.py) draws every
token's 2048 rows from a 2M-slot cache, the bandwidth-bound case. A prefill chunk reads only
its own request's context: every row of it is read by many of the chunk's tokens, and by each
16-head block of a token, so the fp8 kernel dequantises each context row thousands of times.
The workspace path (sparse_mla.attend_prefill_fp8_ds_mla, what the 0.32.0 backend runs for
fp8_ds_mla prefill batches) dequantises the context once into a bf16 workspace (one row per
context position), maps the indexer's positions onto its rows and runs the bf16 kernel over it.

Model: contexts of L tokens lying in random 64-token pages of a 1M-slot paged cache (bf16 and
fp8_ds_mla copies of the same values); the chunk is the context's last s_q tokens; the token at
position p has min(p + 1, 2048) valid positions in [0, p] (all of them while p < 2048, else
2048 drawn at random), then -1, as the indexer leaves prompt rows. Four contexts per CUDA graph
(one per "layer"), so a call finds little of its context in L2 from the call before.

Columns (us per call, CUDA-graph replay, bench/cuda_timing.py):
- bf16: the launcher over the bf16 cache (the bf16 KV cache's prefill);
- fp8: the launcher over the fp8_ds_mla cache (today's fp8_ds_mla prefill);
- dequant: the context dequantised into the workspace (dequantize_context_fp8_ds_mla) alone;
- ws: the bf16 launcher over the filled workspace alone;
- ws path: attend_prefill_fp8_ds_mla, all of it (dequantise, map the positions, attend);
- rule: whether the backend's rule (use_prefill_workspace) takes the workspace for the shape.
The workspace's output is checked against the fp8 kernel's (relative row error, bf16 noise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import row_error, time_graph  # noqa: E402

from mlafleet.kernels import sparse_mla as sm  # noqa: E402
from tests.kernels import oracles  # noqa: E402  (the fp8 cache writer and reader)

S_KV = 1 << 20  # cache slots (16384 pages of 64)
PAGE = 64
TOPK = 2048
SCALE = 1.0 / math.sqrt(256)
N_CTX = 4
SHAPES = [(4096, 4096, 8), (4096, 4096, 32), (16384, 4096, 8), (16384, 4096, 16), (16384, 4096, 32),
          (16384, 4096, 128), (65536, 4096, 8), (65536, 4096, 32),
          (16384, 64, 8), (65536, 256, 8), (131072, 1024, 8)]  # (context L, chunk s_q, heads)


def prompt_positions(ctx: int, s_q: int, gen: torch.Generator) -> torch.Tensor:
    """[s_q, 1, TOPK] int32: the chunk's rows of context positions, -1 past each row's valid ones."""
    pos = torch.arange(ctx - s_q, ctx, device="cuda")
    cols = torch.arange(TOPK, device="cuda")
    drawn = (torch.rand((s_q, TOPK), generator=gen, device="cuda") * (pos[:, None] + 1)).long()
    rows = torch.where((pos[:, None] + 1) > TOPK, drawn, cols[None, :])
    rows = torch.where(cols[None, :] <= pos[:, None], rows, -1)
    return rows.to(torch.int32).view(s_q, 1, TOPK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sparse_mla_prefill.json")
    parser.add_argument("--shapes", default="", help="comma-separated LxS_QxH (default: the study's)")
    args = parser.parse_args()
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else SHAPES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn((S_KV, 1, 576), generator=gen, device="cuda").bfloat16()
    cache = oracles.quantize_fp8_ds_mla(kv[:, 0])  # [S_KV, 656]
    kv = oracles.dequantize_fp8_ds_mla(cache).bfloat16().view(S_KV, 1, 576)  # the same values in bf16
    fp8_cache = cache.view(S_KV // PAGE, PAGE, 1, sm.FP8_TOKEN_BYTES)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{'L':>6s} {'s_q':>5s} {'h':>4s} {'bf16':>9s} {'fp8':>9s} {'dequant':>8s} {'ws':>9s} "
          f"{'ws path':>9s} {'path/fp8':>8s} {'path/bf16':>9s} {'rule':>5s} {'row err':>8s}")
    results = []
    for ctx, s_q, h_q in shapes:
        cases = []
        for _ in range(N_CTX):
            pages = torch.randperm(S_KV // PAGE, generator=gen, device="cuda")[: -(-ctx // PAGE)]
            ctx_slots = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:ctx]
            pos = prompt_positions(ctx, s_q, gen)
            slots = torch.where(pos >= 0, ctx_slots[pos.clamp_min(0).long()], -1).to(torch.int32)
            q = (torch.randn((s_q, h_q, 576), generator=gen, device="cuda") * 0.5).bfloat16()
            seg = sm.prefill_segment_rows(ctx)
            block_table = pages.to(torch.int32).view(1, -1)
            ws = torch.empty((seg, 576), dtype=torch.bfloat16, device="cuda")
            cases.append((q, pos, slots, block_table, ws, seg))
        seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        seg_of_token = torch.zeros(s_q, dtype=torch.int32, device="cuda")
        f_bf16 = [lambda c=c: sm.sparse_mla_fwd(c[0], kv, c[2], SCALE) for c in cases]
        f_fp8 = [lambda c=c: sm.sparse_mla_fwd_fp8(c[0], fp8_cache, c[2], SCALE) for c in cases]
        f_deq = [lambda c=c: sm.dequantize_context_fp8_ds_mla(cache, PAGE, c[3], seq_lens, c[4], c[5]) for c in cases]
        f_ws = [lambda c=c: sm.sparse_mla_fwd(c[0], c[4].unsqueeze(1), c[1], SCALE) for c in cases]
        f_path = [lambda c=c: sm.attend_prefill_fp8_ds_mla(c[0], cache, PAGE, c[3], seq_lens, seg_of_token, c[1],
                                                           SCALE, c[4], c[5]) for c in cases]
        err = row_error(f_path[0](), f_fp8[0]()[0])
        t = {name: time_graph(fns) * 1e6 for name, fns in
             (("bf16", f_bf16), ("fp8", f_fp8), ("dequant", f_deq), ("ws", f_ws), ("path", f_path))}
        rule = sm.use_prefill_workspace(s_q, 1, ctx, 1 << 30)
        row = {"ctx": ctx, "s_q": s_q, "h_q": h_q, **{f"{k}_us": v for k, v in t.items()},
               "rule_takes_workspace": rule, "row_error_path_vs_fp8": err}
        results.append(row)
        print(f"{ctx:6d} {s_q:5d} {h_q:4d} {t['bf16']:9.1f} {t['fp8']:9.1f} {t['dequant']:8.1f} {t['ws']:9.1f} "
              f"{t['path']:9.1f} {t['path'] / t['fp8']:8.2f} {t['path'] / t['bf16']:9.2f} "
              f"{'yes' if rule else 'no':>5s} {err:8.1e}", flush=True)
        del cases, f_bf16, f_fp8, f_deq, f_ws, f_path
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
