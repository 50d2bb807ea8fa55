"""Decode-sized sparse MLA on a CUDA GPU: where a split + merge call's time goes.

Run on the H200 test machine (staged by bench/device_kernels.sh, as bench/sparse_mla.py):

    cd .dev/kernels && PYTHONPATH=$PWD python3 sparse_mla_decode.py --flashmla . --out $OUT

For decode batches (1 and 8 tokens) at 8, 16 and 64 heads, topk 2048 over a 2M-slot cache, CUDA-graph
replay over index sets that stream past L2 (bench/sparse_mla.py's method), microseconds a call:

- the launcher at each split count and key-tile config, with and without programmatic dependent
  launch (sparse_mla.PDL_LAUNCH);
- its split kernel alone (the merge launch skipped) and its merge kernel alone (on partials of the
  same shape);
- floors: one empty kernel a call, and two in a row (with and without PDL);
- FlashMLA's fp8 decode (vLLM 0.20.2's call, heads padded to 64) for the issue's 0.3x goal.

First it checks that PDL launches are exact inside a CUDA graph whose producer kernels rewrite q and
the indices before every replay (the consumer must wait for them), against the float32 reference.
Prints a table and writes the numbers to --out/decode.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from cuda_timing import time_graph

from mlafleet.kernels import sparse_mla as sm
from tests.kernels import oracles  # the float32 references and the fp8 cache writers

S_KV = 2_000_000
TOPK = 2048
SCALE = 1.0 / math.sqrt(256)
L2_FLUSH_BYTES = 256 << 20
SHAPES = [(1, 8), (1, 16), (8, 8), (8, 16), (1, 64), (8, 64)]
SPLITS = (16, 32, 64, 128)
KC = sm.KernelConfig
CONFIGS = {  # key tiles timed at decode, by cache: the launcher's and neighbours (k: scales on the keys)
    "bf16": {"h16n64w4s2zp": sm.CONFIGS[("bf16", "h16n64")], "h16n32w4s5": KC(16, 32, 4, 5),
             "h16n16w4s4": sm.CONFIGS[("bf16", "h16n16-decode")],
             "h16n16w4s1": KC(16, 16, 4, 1, min_split_tokens=16), "h16n32w4s2": KC(16, 32, 4, 2)},
    "fp8": {"h16n32w4s5k": sm.CONFIGS[("fp8", "h16n32-scaled-keys")],
            "h16n32w4s3kp": sm.CONFIGS[("fp8", "h16n32-prefetch")],
            "h16n16w4s1k": sm.CONFIGS[("fp8", "h16n16-decode")],
            "h16n16w4s1": KC(16, 16, 4, 1, min_split_tokens=16), "h16n16w4s4k": KC(16, 16, 4, 4, scale_logits=False),
            "h16n16w8s1k": KC(16, 16, 8, 1, scale_logits=False), "h16n32w4s1k": KC(16, 32, 4, 1, scale_logits=False)},
}
PREFETCH = {  # --prefetch: the next tile's indices prefetched (p); the gathers then pipeline (stages - 1 buffers)
    "bf16": {"h16n32w4s3p": KC(16, 32, 4, 3, prefetch_idx=True), "h16n32w4s2p": KC(16, 32, 4, 2, prefetch_idx=True),
             "h16n16w4s2p": KC(16, 16, 4, 2, min_split_tokens=16, prefetch_idx=True),
             "h16n16w4s3p": KC(16, 16, 4, 3, min_split_tokens=16, prefetch_idx=True)},
    "fp8": {f"h16n{n}w4s{s}kp": KC(16, n, 4, s, scale_logits=False, min_split_tokens=16, prefetch_idx=True)
            for n in (16, 32) for s in (1, 2, 3)},
}
MERGE_TILES = [(d, w) for d in (32, 64, 128) for w in (1, 2, 4) if (d, w) != (128, 1)]  # (BLOCK_D, num_warps)


@triton.jit
def _empty_kernel(X, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tl.store(X + tl.program_id(0), 1)


def indices(s_q: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, S_KV, (s_q, 1, TOPK), device="cuda", dtype=torch.int32, generator=gen)


def call(kind, src, cfg, splits):
    if kind == "bf16":
        return lambda q, i: sm.sparse_mla_fwd(q, src, i, SCALE, num_splits=splits, config=cfg)
    return lambda q, i: sm.sparse_mla_fwd_fp8(q, src, i, SCALE, num_splits=splits, config=cfg)


def check_pdl_in_graph(kv, cache, gen) -> list[dict]:
    """PDL launches inside a CUDA graph after kernels that write q and the indices: each replay
    gets new q and indices, the output must match the reference of those (not of stale ones)."""
    rows = []
    for kind in ("bf16", "fp8"):
        for s_q, h_q, splits in ((1, 8, 32), (8, 16, 16), (4, 64, 1)):
            q_src = torch.empty(s_q, h_q, 576, device="cuda", dtype=torch.bfloat16)
            i_src = torch.empty(s_q, 1, TOPK, device="cuda", dtype=torch.int32)
            q_buf, i_buf = torch.empty_like(q_src), torch.empty_like(i_src)
            fn = call(kind, kv if kind == "bf16" else cache, None, splits)
            result = {}

            def step():
                torch.mul(q_src, 1.0, out=q_buf)  # producer kernels: the consumer reads their output
                torch.add(i_src, 0, out=i_buf)
                result["out"], result["lse"] = fn(q_buf, i_buf)

            q_src.copy_(torch.randn(q_src.shape, device="cuda", generator=gen))
            i_src.copy_(indices(s_q, gen))
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            worst = 0.0
            for _ in range(5):
                q_src.copy_(torch.randn(q_src.shape, device="cuda", generator=gen))
                i_src.copy_(indices(s_q, gen))
                graph.replay()
                torch.cuda.synchronize()
                if kind == "bf16":
                    ref, _ = oracles.reference_sparse_mla(q_src, kv, i_src, SCALE)
                else:
                    ref, _ = oracles.reference_sparse_mla_fp8(q_src, cache, i_src, SCALE)
                out = result["out"].float()
                worst = max(worst, float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max()))
            rows.append({"cache": kind, "s_q": s_q, "h_q": h_q, "splits": splits, "err": worst})
            print(f"PDL in a graph: {kind} {s_q}x{h_q} {splits} splits: worst row error {worst:.2e}", flush=True)
    return rows


def warm(shard: int, n_shards: int) -> None:
    """Compile (Triton's cache) share `shard` of every launch the timing makes, so that several
    processes can compile in parallel before the timing process starts."""
    gen = torch.Generator(device="cuda").manual_seed(shard)
    n = 64_000  # divisible by 16 as S_KV: the same specialisations
    kv = torch.randn(n, 1, 576, device="cuda", generator=gen).bfloat16()
    cache = oracles.quantize_fp8_ds_mla(kv.view(n, 576)).view(n // 64, 64, 656)
    todo = [(kind, cfg, splits, pdl, s_q, h_q) for kind in ("bf16", "fp8") for s_q, h_q in SHAPES
            for cfg, splits in [(None, None), *((c, s) for c in CONFIGS[kind].values() for s in SPLITS)]
            for pdl in (False, True)]
    merges = [(splits, d, w) for splits in SPLITS for d, w in MERGE_TILES]
    for splits, block_d, warps in merges[shard::n_shards]:
        sm._merge_splits(torch.zeros(1, splits, 8, 512, device="cuda"), torch.zeros(1, splits, 8, device="cuda"),
                         torch.empty(1, 8, 512, device="cuda", dtype=torch.bfloat16),
                         torch.empty(1, 8, device="cuda"), block_d, num_warps=warps)
    for kind, cfg, splits, pdl, s_q, h_q in todo[shard::n_shards]:
        sm.PDL_LAUNCH = pdl
        q = torch.randn(s_q, h_q, 576, device="cuda", generator=gen).bfloat16()
        idx = torch.randint(0, n, (s_q, 1, TOPK), device="cuda", dtype=torch.int32, generator=gen)
        call(kind, kv if kind == "bf16" else cache, cfg, splits)(q, idx)
    torch.cuda.synchronize()
    print(f"warm {shard}/{n_shards}: {len(todo[shard::n_shards])} launches", flush=True)


def select(shapes: str | None, prefetch: bool) -> None:
    """Narrow SHAPES to `shapes` ("8x8,8x16"); add the PREFETCH variants to CONFIGS."""
    if shapes:
        wanted = {tuple(map(int, s.split("x"))) for s in shapes.split(",")}
        unknown = wanted - set(SHAPES)
        if unknown:
            raise SystemExit(f"--shapes: {sorted(unknown)} not among {SHAPES}")
        SHAPES[:] = [s for s in SHAPES if s in wanted]
    if prefetch:
        for kind in CONFIGS:
            CONFIGS[kind].update(PREFETCH[kind])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flashmla", help="folder holding vllm/third_party/flashmla (bench/device_kernels.sh stage)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--top", type=int, default=6, help="configs printed a shape (all are in the JSON)")
    parser.add_argument("--warm", help="I/N: compile share I of N of the launches on a small cache, then exit")
    parser.add_argument("--shapes", help="only these s_q x h_q, e.g. 8x8,8x16 (default: all of SHAPES)")
    parser.add_argument("--prefetch", action="store_true",
                        help="also time each config with the next tile's indices prefetched (name + p)")
    args = parser.parse_args()
    select(args.shapes, args.prefetch)
    if args.warm:
        warm(*map(int, args.warm.split("/")))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sparse_mla import FlashMlaFp8, load_flashmla  # noqa: PLC0415 (staged beside this script)

    fm = load_flashmla(args.flashmla)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(S_KV, 1, 576, device="cuda", generator=gen).bfloat16()
    cache = oracles.quantize_fp8_ds_mla(kv.view(S_KV, 576)).view(S_KV // 64, 64, 656)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"pdl_check": check_pdl_in_graph(kv, cache, gen), "floors": {}, "cases": []}

    flag = torch.zeros(256, dtype=torch.int32, device="cuda")
    for pdl in (False, True):
        one = lambda p=pdl: _empty_kernel[(1,)](flag, PDL=p, launch_pdl=p)  # noqa: E731
        results["floors"][f"empty{' pdl' if pdl else ''}"] = time_graph([one] * 64) * 1e6
        results["floors"][f"empty x2{' pdl' if pdl else ''}"] = time_graph([lambda: (one(), one())] * 64) * 1e6

    merge = sm._merge_splits
    for kind in ("bf16", "fp8"):
        src = kv if kind == "bf16" else cache
        for s_q, h_q in SHAPES:
            n_sets = max(1, min(64, math.ceil(L2_FLUSH_BYTES / (s_q * TOPK * 656))))
            qs = [torch.randn(s_q, h_q, 576, device="cuda", generator=gen).bfloat16() for _ in range(n_sets)]
            idxs = [indices(s_q, gen) for _ in range(n_sets)]

            def timed(fn):
                return time_graph([lambda q=q, i=i: fn(q, i) for q, i in zip(qs, idxs)]) * 1e6

            row = {"cache": kind, "s_q": s_q, "h_q": h_q, "launcher": {}, "split_only": {}, "merge_only": {}}
            for pdl in (False, True):
                sm.PDL_LAUNCH = pdl
                row["launcher"][f"auto{' pdl' if pdl else ''}"] = timed(call(kind, src, None, None))
            if kind == "fp8" and fm is not None:
                theirs = FlashMlaFp8(fm, s_q, h_q)
                row["flashmla"] = timed(lambda q, i: theirs(q, cache, i))
            for name, cfg in CONFIGS[kind].items():
                for splits in SPLITS:
                    per_split = triton.cdiv(triton.cdiv(TOPK, splits), cfg.block_n) * cfg.block_n
                    if triton.cdiv(TOPK, per_split) != splits:
                        continue  # not reachable with this key tile
                    for pdl in (False, True):
                        sm.PDL_LAUNCH = pdl
                        tag = f"{name}/s{splits}{' pdl' if pdl else ''}"
                        row["launcher"][tag] = timed(call(kind, src, cfg, splits))
                        if pdl:
                            continue
                        sm._merge_splits = lambda *args, **kwargs: None  # the split kernel alone
                        try:
                            row["split_only"][tag] = timed(call(kind, src, cfg, splits))
                        finally:
                            sm._merge_splits = merge
            sm.PDL_LAUNCH = False
            for splits in SPLITS:
                part = torch.randn(s_q, splits, h_q, 512, device="cuda", generator=gen)
                part_lse = torch.randn(s_q, splits, h_q, device="cuda", generator=gen)
                out = torch.empty(s_q, h_q, 512, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(s_q, h_q, device="cuda")
                ours = (sm._merge_block_d(s_q, h_q, splits, num_sms), sm.MERGE_NUM_WARPS)  # the launcher's
                for block_d, warps in MERGE_TILES if kind == "fp8" else [ours]:
                    tile = "" if (block_d, warps) == ours else f" d{block_d}w{warps}"
                    row["merge_only"][f"s{splits}{tile}"] = timed(
                        lambda q, i, a=(part, part_lse, out, lse, block_d), w=warps: merge(*a, num_warps=w))
            results["cases"].append(row)
            best = min(row["launcher"].items(), key=lambda kv_: kv_[1])
            print(f"{kind} {s_q}x{h_q}: launcher {row['launcher']['auto']:.1f} (pdl {row['launcher']['auto pdl']:.1f}),"
                  f" best {best[0]} {best[1]:.1f}, FlashMLA {row.get('flashmla', float('nan')):.1f} us", flush=True)
    sm.PDL_LAUNCH = True

    print("\nfloors (us a call):", {k: round(v, 2) for k, v in results["floors"].items()})
    for row in results["cases"]:
        print(f"\n{row['cache']} {row['s_q']} x {row['h_q']}  FlashMLA fp8 {row.get('flashmla', float('nan')):.1f} us")
        print(f"  {'config/splits':24} {'call':>7} {'call pdl':>9} {'split only':>11} {'merge only':>11}")
        tags = sorted((t for t in row["launcher"] if not t.endswith("pdl") and t != "auto"),
                      key=lambda t: row["launcher"][t + " pdl"])
        for tag in tags[:args.top]:  # the fastest with PDL
            splits = tag.split("/s")[1]
            print(f"  {tag:24} {row['launcher'][tag]:7.1f} {row['launcher'][tag + ' pdl']:9.1f}"
                  f" {row['split_only'][tag]:11.1f} {row['merge_only']['s' + splits]:11.1f}")
        print("  merge alone by warps:", {k: round(v, 1) for k, v in row["merge_only"].items()})
        print(f"  {'launcher (auto)':24} {row['launcher']['auto']:7.1f} {row['launcher']['auto pdl']:9.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
