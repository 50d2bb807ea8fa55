"""The DSA indexer's Triton top-k (mlafleet.kernels.indexer.top_k_per_row) on a GPU, by shape and
launch choice, against torch.topk: a table on stdout, every row also in --out (JSON).

    PYTHONPATH=. python3 bench/topk.py --out topk.json [--budget-s 120]

topk 2048 (GLM-5, DeepSeek-V3.2). Decode rows are one per request (next_n 1), their lengths the
context lengths; the logits are float32 as the indexer writes them. Each time is the median of
20 replays of a CUDA graph of 20 calls (per call: the kernels are 5-400 us, where launch gaps
would dominate); the inputs stay in L2 as the indexer's freshly written logits do.
Prefill rows (one a token, as long as the chunk's keys, each token's range its prompt's keys
up to itself) take the register path for ranges of at most one block, against the streaming
passes. Every row's selection is checked against torch.topk's (the same set; ties at the k-th value
do not occur in random float32 logits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import time_graph  # noqa: E402

from mlafleet.kernels import indexer as ix  # noqa: E402

TOPK = 2048

# name, row lengths (one row each); decode at the tiny GLM-5's 3000-token prompts first (the
# engine run's shape), then longer contexts, where the row spans several 4096-blocks
CASES = [
    ("decode 1 x 3000", [3000]),
    ("decode 32 x 3000", [3000] * 32),
    ("decode 64 x 3000", [3000] * 64),
    ("decode 32 x 1000-4096", [1000 + (3096 * i) // 31 for i in range(32)]),
    ("decode 128 x 4096", [4096] * 128),
    ("decode 32 x 16k", [16384] * 32),
    ("decode 32 x 100k", [100000] * 32),
    ("decode 64 x 2k-16k", [2048 + (14336 * i) // 63 for i in range(64)]),
    ("decode 4 x 100k", [100000] * 4),
]
# name, tokens in the chunk, prompt length: a prefill chunk of whole prompts (no earlier
# context), one row per token as long as the chunk's keys, each token's range its own
# prompt's keys up to itself (1 to the prompt length)
PREFILL_CASES = [
    ("prefill 8192 x 3000-prompts", 8192, 3000),
    ("prefill 16384 x 3000-prompts", 16384, 3000),
]


def prefill_ranges(tokens: int, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(tokens, dtype=torch.int32, device="cuda")
    starts = (t // prompt) * prompt
    return starts, t + 1


@triton.jit
def _read_write_floor(logits_ptr, out_ptr, stride_lr, stride_or, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """What any one-program-a-row top-k costs at least: read the row once, write TOPK positions."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_lr + lanes)
    take = (lanes < TOPK) | (x > 1e30)
    tl.store(out_ptr + row * stride_or + lanes, lanes, mask=take & (lanes < TOPK))


def floor_us(logits: torch.Tensor) -> float:
    """The read-once, write-once floor for rows within one block (a CUDA graph of 20 launches)."""
    rows, n = logits.shape
    padded = torch.zeros((rows, ix.TOPK_BLOCK), device=logits.device)
    padded[:, :n] = logits
    out = torch.empty((rows, TOPK), dtype=torch.int32, device=logits.device)

    def launch() -> None:
        _read_write_floor[(rows,)](padded, out, padded.stride(0), out.stride(0), TOPK=TOPK, BLOCK=ix.TOPK_BLOCK,
                                   num_warps=ix.TOPK_WARPS)
    return time_graph([launch] * 20) * 1e6


def variants(n: int, rows: int) -> list[tuple[str, dict]]:
    """The launch choices worth timing for rows of at most n positions."""
    out = [("default", {})]
    if n is None:  # prefill rows: short ranges of long rows
        return out + [("streaming (5 reads)", {"one_block": False})]
    if n <= ix.TOPK_BLOCK:
        out += [("4 passes (no early stop)", {"early_stop": False}), ("streaming (5 reads)", {"one_block": False}),
                ("4 warps", {"num_warps": 4}), ("16 warps", {"num_warps": 16})]
    else:
        for splits in (1, 2, 4, 8):
            if splits * rows <= 8 * 132:
                out.append((f"splits={splits}", {"splits": splits}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="topk.json")
    parser.add_argument("--budget-s", type=float, default=120.0, help="skip the cases left past this")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    began = time.time()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "topk": TOPK, "TOPK_BLOCK": ix.TOPK_BLOCK}
    rows_out: list[dict] = []
    print(f"{'case':26s} {'launch':26s} {'us':>9s} {'torch us':>9s} {'same set':>8s}")
    cases = [(name, lens, None) for name, lens in CASES] + [(name, None, (t, p)) for name, t, p in PREFILL_CASES]
    for name, lens, prefill in cases:
        if time.time() - began > args.budget_s:
            print(f"{name}: skipped (budget)")
            continue
        if prefill:
            starts, ends = prefill_ranges(*prefill)
            n = prefill[0]
        else:
            starts, ends = None, torch.tensor(lens, dtype=torch.int32, device="cuda")
            n = max(lens)
        rows = ends.shape[0]
        logits = torch.randn((rows, n), generator=gen, device="cuda")
        want = ix.top_k_per_row_torch(logits, starts, ends, TOPK)
        want_sets = [set(r.tolist()) - {-1} for r in want.cpu()]
        torch_us = time_graph([lambda: ix.top_k_per_row_torch(logits, starts, ends, TOPK)] * 20) * 1e6
        if not prefill and n <= ix.TOPK_BLOCK:
            us = floor_us(logits)
            rows_out.append({"case": name, "rows": rows, "max_len": n, "launch": "floor: read + write only",
                             "us": round(us, 2), "torch_us": round(torch_us, 2), "same_set_as_torch": True})
            print(f"{name:26s} {'floor: read + write':26s} {us:9.2f} {torch_us:9.2f} {'-':>8s}", flush=True)
        for label, kw in variants(None if prefill else n, rows):
            out = torch.empty((rows, TOPK), dtype=torch.int32, device="cuda")
            ix.top_k_per_row(logits, starts, ends, TOPK, out=out, **kw)
            same = all(set(r.tolist()) - {-1} == w for r, w in zip(out.cpu(), want_sets))
            us = time_graph([lambda kw=kw, out=out: ix.top_k_per_row(logits, starts, ends, TOPK, out=out, **kw)] * 20) * 1e6
            row = {"case": name, "rows": rows, "max_len": n, "launch": label, "us": round(us, 2),
                   "torch_us": round(torch_us, 2), "same_set_as_torch": same}
            rows_out.append(row)
            print(f"{name:26s} {label:26s} {us:9.2f} {torch_us:9.2f} {str(same):>8s}", flush=True)
            with open(args.out, "w") as handle:
                json.dump({"meta": meta, "results": rows_out}, handle, indent=1)
    print(f"total {time.time() - began:.0f} s")
    if not all(r["same_set_as_torch"] for r in rows_out):
        sys.exit(1)


if __name__ == "__main__":
    main()
