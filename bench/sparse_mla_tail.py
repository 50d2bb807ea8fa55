"""Sparse-MLA kernels with and without the trimmed key loop (TRIM_TAIL) on a CUDA GPU: a table.

    PYTHONPATH=. python3 bench/sparse_mla_tail.py --out sparse_mla_tail.json

Two index layouts, topk 2048, over a 1,000,000-slot cache (bf16 and fp8_ds_mla):
- full: every entry valid (decode past 2048 tokens of context, the prompt's later tokens);
- prompt: the rows of 3000-token prompts as the indexer leaves them, row t with min(t + 1, 2048)
  valid positions then -1 (the engine's prefill; 66% of the entries valid on average).
Each time is the median of CUDA-graph replays of calls over enough index sets to stream about
256 MB of gathered rows past the 60 MB L2 (bench/cuda_timing.py). Trimmed and untrimmed
outputs are checked equal (the skipped blocks hold no valid index). `fp8-gluon` is the Gluon
fp8_ds_mla kernel (the launcher's choice on SM12x, forced here), also checked against the Triton fp8
kernel's output (relative row error under 1e-2).
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
from cuda_timing import time_graph  # noqa: E402

from mlafleet.kernels import sparse_mla as sm  # noqa: E402
from tests.kernels import oracles  # noqa: E402  (the fp8 cache writer)

S_KV = 1_000_000
TOPK = 2048
PROMPT = 3000
SCALE = 1.0 / math.sqrt(256)
STREAM_BYTES = 256 << 20
SHAPES = [(8, 8), (64, 8), (1024, 8), (4096, 8), (4096, 32)]


def indices(s_q: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, S_KV, (s_q, 1, TOPK), generator=gen, device="cuda", dtype=torch.int32)
    if layout == "prompt":
        valid = torch.clamp(torch.arange(s_q, device="cuda") % PROMPT + 1, max=TOPK)
        idx[:, 0][torch.arange(TOPK, device="cuda")[None, :] >= valid[:, None]] = -1
    return idx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sparse_mla_tail.json")
    parser.add_argument("--kinds", default="bf16,fp8,fp8-gluon", help="comma-separated: bf16, fp8, fp8-gluon")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn((S_KV, 1, 576), generator=gen, device="cuda").bfloat16()
    cache = oracles.quantize_fp8_ds_mla(kv[:, 0]).view(S_KV // 64, 64, 1, sm.FP8_TOKEN_BYTES)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results = []
    print(f"{'kv':9s} {'s_q x h':>9s} {'layout':7s} {'valid':>6s} {'untrimmed us':>13s} {'trimmed us':>11s} {'ratio':>6s}")
    for kind in args.kinds.split(","):
        fwd = {"bf16": lambda q, i: sm.sparse_mla_fwd(q, kv, i, SCALE),
               "fp8": lambda q, i: sm.sparse_mla_fwd_fp8(q, cache, i, SCALE),
               "fp8-gluon": lambda q, i: sm.sparse_mla_fwd_fp8(q, cache, i, SCALE, config=sm.GLUON_FP8)}[kind]
        row_bytes = 1152 if kind == "bf16" else sm.FP8_TOKEN_BYTES
        for s_q, h in SHAPES:
            q = torch.randn((s_q, h, 576), generator=gen, device="cuda").bfloat16()
            for layout in ("full", "prompt"):
                sets = [indices(s_q, layout, gen) for _ in range(max(2, min(64, STREAM_BYTES // (s_q * TOPK * row_bytes))))]
                valid = float((sets[0] >= 0).float().mean())
                times, outs = {}, {}
                for mode, threshold in (("untrimmed", 10**9), ("trimmed", 0)):
                    sm.TRIM_TAIL_MIN_TOKENS = threshold
                    outs[mode] = fwd(q, sets[0])
                    times[mode] = time_graph([lambda i=i: fwd(q, i) for i in sets]) * 1e6
                same = all(torch.equal(a, b) for a, b in zip(outs["untrimmed"], outs["trimmed"]))
                if kind == "fp8-gluon":  # and the Triton kernel's output
                    triton_out = sm.sparse_mla_fwd_fp8(q, cache, sets[0], SCALE)[0].float()
                    err = (outs["trimmed"][0].float() - triton_out).norm(dim=-1) / triton_out.norm(dim=-1).clamp_min(1e-6)
                    same = same and float(err.max()) < 1e-2
                row = {"kv": kind, "s_q": s_q, "heads": h, "layout": layout, "valid_fraction": round(valid, 3),
                       "untrimmed_us": round(times["untrimmed"], 2), "trimmed_us": round(times["trimmed"], 2),
                       "ratio": round(times["trimmed"] / times["untrimmed"], 3), "outputs_equal": same}
                results.append(row)
                print(f"{kind:9s} {f'{s_q}x{h}':>9s} {layout:7s} {valid:6.2f} {times['untrimmed']:13.1f} "
                      f"{times['trimmed']:11.1f} {row['ratio']:6.2f}{'' if same else '  OUTPUTS DIFFER'}", flush=True)
                with open(args.out, "w") as handle:
                    json.dump({"meta": meta, "results": results}, handle, indent=1)
    if not all(r["outputs_equal"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
