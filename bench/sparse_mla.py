"""Sparse-MLA benchmark on a CUDA GPU: our Triton kernels vs the torch reference vs FlashMLA.

Run on the H200 test machine (see bench/device_kernels.sh for staging):

    PYTHONPATH=.dev/kernels python3 bench/sparse_mla.py --flashmla .dev/kernels --out $OUT

1. Correctness at real sizes: a 2,000,000-slot cache (bf16: 2.3 GB, so byte offsets pass
   2^31; fp8_ds_mla: 1.3 GB), topk 2048, heads 8/16/64/128, indices over the whole cache
   (with invalid ones), ours and FlashMLA against the float32 reference.
2. Timing with CUDA events over CUDA-graph replays (no launch gaps), each replay running
   the call over several index sets so the gathered rows do not sit in L2.
   FlashMLA is called as vLLM 0.20.2 calls it: bf16 flash_mla_sparse_fwd with heads padded
   to 64, fp8 flash_mla_with_kvcache with indices and heads padded to 64 (or 128).

Prints a table (ms, GB/s of gathered KV, % of the measured copy bandwidth, TFLOP/s) and
writes it with the raw numbers under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from mlafleet.kernels import sparse_mla as sm

S_KV = 2_000_000
TOPK = 2048
SCALE = 1.0 / math.sqrt(256)
BF16_ROW_BYTES = 576 * 2
FP8_ROW_BYTES = 656
L2_FLUSH_BYTES = 256 << 20  # index sets per replay: enough calls to stream past the 60 MB L2

# (cache, s_q, h_q): the issue's targets and FlashMLA's measured points
CASES = [
    ("bf16", 1, 8), ("bf16", 1, 16), ("bf16", 1, 64),
    ("bf16", 8, 8), ("bf16", 8, 16), ("bf16", 8, 64),
    ("bf16", 64, 16), ("bf16", 64, 64), ("bf16", 256, 64), ("bf16", 4096, 128),
    ("fp8", 1, 64), ("fp8", 8, 16), ("fp8", 8, 64), ("fp8", 64, 16), ("fp8", 64, 64),
    ("fp8", 256, 64), ("fp8", 256, 128),
]
# --sweep: (cache, s_q, h_q) -> configs x split counts, timed besides the launcher's own
# choice (each config fits SM120: checked offline with mlafleet.kernels.sm120 before the run)
_BF16_CANDIDATES = [sm.CONFIGS[("bf16", 16)], sm.KernelConfig(16, 64, 8, 1), sm.KernelConfig(32, 32, 8, 2)]
SWEEPS = {
    ("bf16", 64, 16): (_BF16_CANDIDATES, (1, 2, 4, 8)),
    ("bf16", 64, 64): (_BF16_CANDIDATES, (1, 2, 4)),
    ("bf16", 256, 64): (_BF16_CANDIDATES, (1, 2)),
    ("fp8", 8, 64): ([sm.CONFIGS[("fp8", 32)]], (4, 8, 16, 32)),
    ("fp8", 64, 16): ([sm.CONFIGS[("fp8", 16)]], (1, 2, 3, 4, 5, 8)),
    ("fp8", 64, 64): ([sm.CONFIGS[("fp8", 32)]], (1, 2, 3)),
}


def load_flashmla(root: str | None):
    if not root:
        return None
    sys.path.insert(0, root)
    try:
        from vllm.third_party.flashmla import flash_mla_interface as fm  # noqa: PLC0415
    except Exception as exc:  # report and go on without it
        print(f"FlashMLA not available: {exc!r}")
        return None
    return fm


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times) / 1e9


def make_indices(s_q: int, topk: int, gen: torch.Generator, invalid: bool = False) -> torch.Tensor:
    idx = torch.randint(0, S_KV, (s_q, 1, topk), device="cuda", dtype=torch.int32, generator=gen)
    if invalid:
        idx[:, :, 5::17] = -1
        idx[:, :, 7::29] = S_KV + 3
        idx[:, :, 11::13] = torch.randint(S_KV - 50_000, S_KV, idx[:, :, 11::13].shape,
                                          device="cuda", dtype=torch.int32, generator=gen)
        if s_q > 1:
            idx[-1] = -1  # a row with nothing valid
    return idx


def time_graph(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median seconds per call: all calls captured in one CUDA graph, the graph replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()  # warm-up: compilation, FlashMLA's scheduler metadata
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


def time_eager(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def flashmla_bf16(fm, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """As vLLM 0.20.2's FlashMLASparseImpl._bf16_flash_mla_kernel on Hopper (pad heads to 64)."""
    h_q = q.shape[1]
    if h_q % 64 != 0:
        padded = q.new_empty((q.shape[0], 64, q.shape[2]))
        padded[:, :h_q] = q
        q = padded
    return fm.flash_mla_sparse_fwd(q, kv, idx, SCALE)[0][:, :h_q]


class FlashMlaFp8:
    """As vLLM 0.20.2's _fp8_flash_mla_kernel: decode q [b, 1, h, 576], heads padded to 64/128."""

    def __init__(self, fm, b: int, h_q: int) -> None:
        self.fm = fm
        self.h_q = h_q
        self.padded = 64 if h_q <= 64 else 128
        self.meta, _ = fm.get_mla_metadata()
        self.block_table = torch.zeros((b, 1), dtype=torch.int32, device="cuda")
        self.cache_lens = torch.full((b,), 4096, dtype=torch.int32, device="cuda")

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        q = q.unsqueeze(1)  # [b, 1, h, 576]
        if self.h_q < self.padded:
            padded = q.new_zeros((q.shape[0], 1, self.padded, q.shape[3]))
            padded[:, :, :self.h_q] = q
            q = padded
        out, _ = self.fm.flash_mla_with_kvcache(
            q=q, k_cache=cache.unsqueeze(-2), block_table=self.block_table, head_dim_v=512,
            cache_seqlens=self.cache_lens, tile_scheduler_metadata=self.meta, is_fp8_kvcache=True,
            indices=idx, softmax_scale=SCALE)  # idx [b, 1, topk]: seq_len_q 1
        return out[:, 0, :self.h_q]


def row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-(token, head) relative error over rows with a non-zero reference."""
    out, ref = out.float(), ref.float()
    norms = ref.norm(dim=-1)
    keep = norms > 0
    if out.isnan().any():
        return float("nan")
    return float(((out - ref).norm(dim=-1)[keep] / norms[keep]).max()) if keep.any() else 0.0


def correctness(fm, kv: torch.Tensor, cache: torch.Tensor, gen: torch.Generator) -> list[dict]:
    rows = []
    for h_q in (8, 16, 64, 128):
        q = torch.randn(4, h_q, 576, device="cuda", generator=gen).bfloat16()
        idx = make_indices(4, TOPK, gen, invalid=True)
        assert int(idx.max()) * BF16_ROW_BYTES > 2**31  # rows past 2^31 bytes are read
        ref, ref_lse = sm.reference_sparse_mla(q, kv, idx, SCALE)
        for name, splits in (("auto", None), ("unsplit", 1), ("split 16", 16)):
            out, lse = sm.sparse_mla_fwd(q, kv, idx, SCALE, num_splits=splits)
            empty = torch.isposinf(ref_lse)
            rows.append({"cache": "bf16", "h_q": h_q, "impl": f"ours ({name})", "err": row_error(out, ref),
                         "lse_err": float((lse[~empty] - ref_lse[~empty]).abs().max()),
                         "empty_ok": bool(torch.isposinf(lse[empty]).all() and (out[empty] == 0).all())})
        ref8, ref8_lse = sm.reference_sparse_mla_fp8(q, cache, idx, SCALE)
        out8, lse8 = sm.sparse_mla_fwd_fp8(q, cache, idx, SCALE)
        empty = torch.isposinf(ref8_lse)
        rows.append({"cache": "fp8", "h_q": h_q, "impl": "ours (auto)", "err": row_error(out8, ref8),
                     "lse_err": float((lse8[~empty] - ref8_lse[~empty]).abs().max()),
                     "empty_ok": bool(torch.isposinf(lse8[empty]).all() and (out8[empty] == 0).all())})
        # every config the launcher can choose, forced (some are chosen only for s_q >= 32)
        empty = torch.isposinf(ref_lse)
        for (dtype, block_h), cfg in sm.CONFIGS.items():
            for splits in (1, 4):
                if dtype == "bf16":
                    o, l = sm.sparse_mla_fwd(q, kv, idx, SCALE, num_splits=splits, config=cfg)
                    r, rl = ref, ref_lse
                else:
                    o, l = sm.sparse_mla_fwd_fp8(q, cache, idx, SCALE, num_splits=splits, config=cfg)
                    r, rl = ref8, ref8_lse
                rows.append({"cache": dtype, "h_q": h_q, "impl": f"ours (h{block_h}, {splits} splits)",
                             "err": row_error(o, r), "lse_err": float((l[~empty] - rl[~empty]).abs().max()),
                             "empty_ok": bool(torch.isposinf(l[empty]).all() and (o[empty] == 0).all())})
        if fm is not None:
            # rows 0-2 (FlashMLA's no-valid-index row is not our contract); its fp8 decode
            # takes only -1 as invalid, so out-of-range slots become -1 for it
            full = torch.where(idx[:3] >= S_KV, -1, idx[:3])
            rows.append({"cache": "bf16", "h_q": h_q, "impl": "FlashMLA", "err":
                         row_error(flashmla_bf16(fm, q[:3], kv, full), ref[:3])})
            rows.append({"cache": "fp8", "h_q": h_q, "impl": "FlashMLA", "err":
                         row_error(FlashMlaFp8(fm, 3, h_q)(q[:3], cache, full), ref8[:3])})
    return rows


def bench_case(fm, kind: str, s_q: int, h_q: int, kv: torch.Tensor, cache: torch.Tensor,
               gen: torch.Generator, copy_bw: float, with_ref: bool) -> dict:
    row_bytes = BF16_ROW_BYTES if kind == "bf16" else FP8_ROW_BYTES
    gathered = s_q * TOPK * row_bytes
    n_sets = max(1, min(64, math.ceil(L2_FLUSH_BYTES / gathered)))
    qs = [torch.randn(s_q, h_q, 576, device="cuda", generator=gen).bfloat16() for _ in range(n_sets)]
    idxs = [make_indices(s_q, TOPK, gen) for _ in range(n_sets)]
    flops = 2 * s_q * h_q * TOPK * (576 + 512)
    result = {"cache": kind, "s_q": s_q, "h_q": h_q, "gathered_MB": gathered / 1e6, "sets": n_sets}

    if kind == "bf16":
        ours = [lambda q=q, i=i: sm.sparse_mla_fwd(q, kv, i, SCALE) for q, i in zip(qs, idxs)]
    else:
        ours = [lambda q=q, i=i: sm.sparse_mla_fwd_fp8(q, cache, i, SCALE) for q, i in zip(qs, idxs)]
    result["ours_s"] = time_graph(ours)
    if fm is not None:
        if kind == "bf16":
            theirs = [lambda q=q, i=i: flashmla_bf16(fm, q, kv, i) for q, i in zip(qs, idxs)]
        else:
            call = FlashMlaFp8(fm, s_q, h_q)
            theirs = [lambda q=q, i=i: call(q, cache, i) for q, i in zip(qs, idxs)]
        result["flashmla_s"] = time_graph(theirs)
        mine = ours[0]()[0]
        result["ours_vs_flashmla_err"] = row_error(mine, theirs[0]())
    if with_ref and s_q * h_q * TOPK <= 256 * 128 * TOPK:
        ref = sm.reference_sparse_mla if kind == "bf16" else sm.reference_sparse_mla_fp8
        src = kv if kind == "bf16" else cache
        try:
            result["ref_s"] = time_eager(lambda: ref(qs[0], src, idxs[0], SCALE))
        except torch.OutOfMemoryError:
            result["ref_s"] = None
        torch.cuda.empty_cache()
    for key in ("ours", "flashmla", "ref"):
        t = result.get(f"{key}_s")
        if t:
            result[f"{key}_GBps"] = gathered / t / 1e9
            result[f"{key}_pct_copy"] = 100 * gathered / t / 1e9 / copy_bw
            result[f"{key}_TFLOPs"] = flops / t / 1e12
    return result


def sweep(kind: str, s_q: int, h_q: int, kv: torch.Tensor, cache: torch.Tensor,
          gen: torch.Generator) -> dict:
    row_bytes = BF16_ROW_BYTES if kind == "bf16" else FP8_ROW_BYTES
    n_sets = max(1, min(64, math.ceil(L2_FLUSH_BYTES / (s_q * TOPK * row_bytes))))
    qs = [torch.randn(s_q, h_q, 576, device="cuda", generator=gen).bfloat16() for _ in range(n_sets)]
    idxs = [make_indices(s_q, TOPK, gen) for _ in range(n_sets)]
    fwd, src = (sm.sparse_mla_fwd, kv) if kind == "bf16" else (sm.sparse_mla_fwd_fp8, cache)
    out = {"cache": kind, "s_q": s_q, "h_q": h_q}
    configs, split_counts = SWEEPS[(kind, s_q, h_q)]
    for cfg in configs:
        for splits in split_counts:
            calls = [lambda q=q, i=i: fwd(q, src, i, SCALE, num_splits=splits, config=cfg)
                     for q, i in zip(qs, idxs)]
            name = f"h{cfg.block_h}n{cfg.block_n}w{cfg.num_warps}st{cfg.num_stages}/s{splits}_us"
            out[name] = round(time_graph(calls, replays=10) * 1e6, 1)
    return out


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict], copy_bw: float) -> str:
    lines = [f"copy bandwidth {copy_bw:.0f} GB/s (read + write)", "",
             "| cache | s_q x h_q | gathered MB | ours us | ours GB/s | ours % copy | ours TFLOP/s "
             "| FlashMLA us | FlashMLA % copy | FlashMLA TFLOP/s | ours / FlashMLA | torch ref us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = r["ours_s"] / r["flashmla_s"] if r.get("flashmla_s") else None
        lines.append(
            f"| {r['cache']} | {r['s_q']} x {r['h_q']} | {r['gathered_MB']:.1f} | {r['ours_s'] * 1e6:.1f} "
            f"| {r['ours_GBps']:.0f} | {r['ours_pct_copy']:.0f}% | {r['ours_TFLOPs']:.1f} "
            f"| {fmt(r.get('flashmla_s') and r['flashmla_s'] * 1e6, '.1f')} "
            f"| {fmt(r.get('flashmla_pct_copy'), '.0f')}% | {fmt(r.get('flashmla_TFLOPs'), '.1f')} "
            f"| {fmt(ratio, '.2f')} | {fmt(r.get('ref_s') and r['ref_s'] * 1e6, '.0f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashmla", help="folder holding vllm/_flashmla_C.abi3.so and "
                                           "vllm/third_party/flashmla/flash_mla_interface.py")
    parser.add_argument("--out", type=Path, help="folder for sparse_mla.json and sparse_mla.md")
    parser.add_argument("--sweep", action="store_true", help="also time every config x split count")
    parser.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    args = parser.parse_args()

    started = time.time()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}", flush=True)
    fm = load_flashmla(args.flashmla)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw:.0f} GB/s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(S_KV, 1, 576, device="cuda", generator=gen).bfloat16()
    cache = sm.quantize_fp8_ds_mla(kv.view(S_KV, 576)).view(S_KV // 64, 64, 656)
    print(f"caches: bf16 {kv.numel() * 2 / 1e9:.2f} GB, fp8 {cache.numel() / 1e9:.2f} GB "
          f"({time.time() - started:.0f} s)", flush=True)

    checks = correctness(fm, kv, cache, gen)
    for c in checks:
        print("check", json.dumps(c), flush=True)
    ok = all(c["err"] < 2e-2 and c.get("lse_err", 0) < 1e-2 and c.get("empty_ok", True)
             for c in checks if c["impl"].startswith("ours"))
    print(f"correctness: {'PASS' if ok else 'FAIL'} ({time.time() - started:.0f} s)", flush=True)

    results = []
    for kind, s_q, h_q in CASES:
        r = bench_case(fm, kind, s_q, h_q, kv, cache, gen, copy_bw, with_ref=not args.no_ref)
        results.append(r)
        print("case", json.dumps(r), flush=True)
    sweeps = [sweep(*c, kv, cache, gen) for c in SWEEPS] if args.sweep else []
    for s in sweeps:
        print("sweep", json.dumps(s), flush=True)

    text = table(results, copy_bw)
    header = (f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, topk {TOPK}, "
              f"{S_KV} slots, correctness {'PASS' if ok else 'FAIL'}")
    print("\n" + header + "\n" + text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sparse_mla.json").write_text(json.dumps(
            {"header": header, "copy_GBps": copy_bw, "checks": checks, "results": results,
             "sweeps": sweeps}, indent=1))
        (args.out / "sparse_mla.md").write_text(header + "\n\n" + text + "\n")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
