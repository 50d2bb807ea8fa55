"""Sparse-MLA benchmark on a CUDA GPU: our Triton kernels (and an earlier version of them) vs FlashMLA.

Run on the H200 test machine (see bench/device_kernels.sh for staging):

    PYTHONPATH=.dev/kernels python3 bench/sparse_mla.py --flashmla .dev/kernels --out $OUT

1. Correctness at real sizes: a 2,000,000-slot cache (bf16: 2.3 GB, so byte offsets pass
   2^31; fp8_ds_mla: 1.3 GB), topk 2048, heads 8/16/32/64/128, indices over the whole cache
   (with invalid ones), ours (launcher defaults and every config in CONFIGS and CANDIDATES,
   forced to 1 and 4 splits) and FlashMLA against the float32 reference.
2. Timing with CUDA events over CUDA-graph replays (no launch gaps), each replay running
   the call over enough index sets that 256 MB of rows stream through the 60 MB L2.
   FlashMLA is called as vLLM 0.20.2 calls it: bf16 flash_mla_sparse_fwd with heads padded
   to 64, fp8 flash_mla_with_kvcache with indices and heads padded to 64 (or 128).
   `--before MODULE` also times another version of the kernels (e.g. the previous commit's
   sparse_mla.py staged under another module name) on every case, in the same process.
   `--sweep` times the CANDIDATES configs and split counts beside the launcher's choice.
   `--only fp8` (or bf16) times one cache's cases only.
3. `--warm I/N`: compile only (share I of N of every launch the timing will make, on a small
   cache with the same specialisations), so that N processes can fill Triton's cache in
   parallel before the timing process starts.

Prints a table (us, GB/s of gathered KV, % of the measured copy bandwidth, TFLOP/s) and
writes it with the raw numbers under --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from cuda_timing import row_error, time_graph

from mlafleet.kernels import sparse_mla as sm

DEV = "cuda"  # --cpu-dry-run: "cpu" (Triton's interpreter, small sizes)
S_KV = 2_000_000
S_KV_WARM = 64_000  # --warm: same divisibility by 16 as S_KV, so the same compiled kernels
TOPK = 2048
SCALE = 1.0 / math.sqrt(256)
BF16_ROW_BYTES = 576 * 2
FP8_ROW_BYTES = 656
CHECK_HEADS = (8, 16, 32, 64, 128)  # correctness at real sizes
L2_FLUSH_BYTES = 256 << 20  # index sets per replay: enough calls to stream past the 60 MB L2

# (s_q, h_q) for both caches: decode at batch 1-8, GLM-5's 8/16/32 heads per GPU (tensor
# parallel 8/4/2) from decode to prefill, and 64/128 heads (GLM-5 at TP1, DeepSeek-V3.2)
SHAPES = [(1, 8), (1, 16), (1, 64), (8, 8), (8, 16), (8, 64),
          (64, 8), (64, 16), (64, 32), (64, 64), (256, 8), (256, 32), (256, 64),
          (1024, 8), (4096, 8), (4096, 16), (4096, 32), (4096, 128)]
CASES = [(kind, s_q, h_q) for kind in ("bf16", "fp8") for s_q, h_q in SHAPES] + [("fp8", 256, 128)]

# --sweep: configs timed beside the launcher's choice, by cache dtype, at the launcher's split
# rule: every config the launcher has (CONFIGS itself, so a sweep never times a variant of them
# under their names), plus any experiment added here (each must fit SM120: check it offline
# with mlafleet.kernels.sm120 before a run)
CANDIDATES: dict[str, list[sm.KernelConfig]] = {
    # (bf16: and 32-key tiles at 5 stages, the launcher's choice up to 16 heads until the tenth pass)
    "bf16": [cfg for (d, _), cfg in sm.CONFIGS.items() if d == "bf16"]
    + [sm.KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=5)],
    # and the Gluon kernel (the launcher's fp8_ds_mla choice on SM12x; --cpu-dry-run drops it: the
    # interpreter cannot run Gluon kernels), and the per-128 scales on the logits and probabilities
    # (the launcher's choice beyond 16 heads until the tenth pass: the studied alternative)
    "fp8": [cfg for (d, _), cfg in sm.CONFIGS.items() if d == "fp8"]
    + [sm.GLUON_FP8, sm.KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=5)]}
# --sweep: split counts for every candidate at these (s_q, h_q)
SPLIT_SWEEP = {(1, 8): (16, 64), (8, 8): (16, 32), (8, 64): (4, 8), (64, 32): (1, 2), (64, 64): (1, 2)}


def cfg_name(cfg: sm.KernelConfig, kind: str = "fp8") -> str:
    """h heads, n keys a step, w warps, s stages; fp8: k = scales on the keys, else on the logits;
    u = the untrimmed key loop (no TRIM_TAIL even for prefill batches); z = the lazy rescale;
    p = the next tile's indices prefetched; gluon-: the Gluon fp8_ds_mla kernel (sparse_mla_gluon.py)."""
    extra = (("" if kind == "bf16" or cfg.scale_logits else "k") + ("" if cfg.trim_tail else "u")
             + ("z" if cfg.lazy_rescale else "") + ("p" if cfg.prefetch_idx else ""))
    return f"{'gluon-' if cfg.gluon else ''}h{cfg.block_h}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}{extra}"


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
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
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


def make_indices(s_q: int, topk: int, gen: torch.Generator, s_kv: int | None = None,
                 invalid: bool = False) -> torch.Tensor:
    s_kv = s_kv or S_KV
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device=DEV, dtype=torch.int32, generator=gen)
    if invalid:
        idx[:, :, 5::17] = -1
        idx[:, :, 7::29] = s_kv + 3
        idx[:, :, 11::13] = torch.randint(s_kv - 50_000, s_kv, idx[:, :, 11::13].shape,
                                          device=DEV, dtype=torch.int32, generator=gen)
        if s_q > 1:
            idx[-1] = -1  # a row with nothing valid
    return idx


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
        self.block_table = torch.zeros((b, 1), dtype=torch.int32, device=DEV)
        self.cache_lens = torch.full((b,), 4096, dtype=torch.int32, device=DEV)

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


def all_configs() -> list[tuple[str, sm.KernelConfig]]:
    """Every (cache dtype, config) the checks force: CANDIDATES (the launcher's CONFIGS and any
    experiment), each once."""
    return list(dict.fromkeys((dtype, cfg) for dtype, cfgs in CANDIDATES.items() for cfg in cfgs))


def correctness(fm, before, kv: torch.Tensor, cache: torch.Tensor, gen: torch.Generator) -> list[dict]:
    rows = []

    def record(cache_kind, h_q, impl, out, lse, ref, ref_lse):
        empty = torch.isposinf(ref_lse)
        rows.append({"cache": cache_kind, "h_q": h_q, "impl": impl, "err": row_error(out, ref),
                     "lse_err": float((lse[~empty] - ref_lse[~empty]).abs().max()),
                     "empty_ok": bool(torch.isposinf(lse[empty]).all() and (out[empty] == 0).all())})

    for h_q in CHECK_HEADS:
        q = torch.randn(4, h_q, 576, device=DEV, generator=gen).bfloat16()
        idx = make_indices(4, TOPK, gen, invalid=True)
        assert DEV == "cpu" or int(idx.max()) * BF16_ROW_BYTES > 2**31  # rows past 2^31 bytes are read
        ref, ref_lse = sm.reference_sparse_mla(q, kv, idx, SCALE)
        ref8, ref8_lse = sm.reference_sparse_mla_fp8(q, cache, idx, SCALE)
        for name, splits in (("auto", None), ("unsplit", 1), ("split 16", 16)):
            record("bf16", h_q, f"ours ({name})", *sm.sparse_mla_fwd(q, kv, idx, SCALE, num_splits=splits),
                   ref, ref_lse)
            record("fp8", h_q, f"ours ({name})", *sm.sparse_mla_fwd_fp8(q, cache, idx, SCALE, num_splits=splits),
                   ref8, ref8_lse)
        for dtype, cfg in all_configs():  # every config, forced (some are chosen only at large s_q)
            for splits in (1, 4):
                if dtype == "bf16":
                    o, l = sm.sparse_mla_fwd(q, kv, idx, SCALE, num_splits=splits, config=cfg)
                    record(dtype, h_q, f"ours ({cfg_name(cfg, dtype)}, {splits} splits)", o, l, ref, ref_lse)
                else:
                    o, l = sm.sparse_mla_fwd_fp8(q, cache, idx, SCALE, num_splits=splits, config=cfg)
                    record(dtype, h_q, f"ours ({cfg_name(cfg, dtype)}, {splits} splits)", o, l, ref8, ref8_lse)
        if before is not None:
            record("bf16", h_q, "before", *before.sparse_mla_fwd(q, kv, idx, SCALE), ref, ref_lse)
            record("fp8", h_q, "before", *before.sparse_mla_fwd_fp8(q, cache, idx, SCALE), ref8, ref8_lse)
        if fm is not None:
            # rows 0-2 (FlashMLA's no-valid-index row is not our contract); its fp8 decode
            # takes only -1 as invalid, so out-of-range slots become -1 for it
            full = torch.where(idx[:3] >= S_KV, -1, idx[:3])
            rows.append({"cache": "bf16", "h_q": h_q, "impl": "FlashMLA", "err":
                         row_error(flashmla_bf16(fm, q[:3], kv, full), ref[:3])})
            rows.append({"cache": "fp8", "h_q": h_q, "impl": "FlashMLA", "err":
                         row_error(FlashMlaFp8(fm, 3, h_q)(q[:3], cache, full), ref8[:3])})
    return rows


def launches(before) -> list[tuple[str, str, int, int, sm.KernelConfig | None, int | None]]:
    """Every (impl, cache, s_q, h_q, config, splits) the timing makes: impl 'ours', 'before'."""
    out = []
    for kind, s_q, h_q in CASES:
        out.append(("ours", kind, s_q, h_q, None, None))
        if before is not None:
            out.append(("before", kind, s_q, h_q, None, None))
    for kind, s_q, h_q in CASES:
        for cfg in CANDIDATES[kind]:
            out.append(("ours", kind, s_q, h_q, cfg, None))
            for splits in SPLIT_SWEEP.get((s_q, h_q), ()):
                out.append(("ours", kind, s_q, h_q, cfg, splits))
    return out


def caller(impl_mod, kind: str, src: torch.Tensor, cfg, splits):
    if kind == "bf16":
        if cfg is None and splits is None:
            return lambda q, i: impl_mod.sparse_mla_fwd(q, src, i, SCALE)
        return lambda q, i: impl_mod.sparse_mla_fwd(q, src, i, SCALE, num_splits=splits, config=cfg)
    if cfg is None and splits is None:
        return lambda q, i: impl_mod.sparse_mla_fwd_fp8(q, src, i, SCALE)
    return lambda q, i: impl_mod.sparse_mla_fwd_fp8(q, src, i, SCALE, num_splits=splits, config=cfg)


def warm(shard: int, n_shards: int, before) -> None:
    """Compile this shard's launches on a small cache (same specialisations as the timing)."""
    gen = torch.Generator(device=DEV).manual_seed(shard)
    kv = torch.randn(S_KV_WARM, 1, 576, device=DEV, generator=gen).bfloat16()
    cache = sm.quantize_fp8_ds_mla(kv.view(S_KV_WARM, 576)).view(S_KV_WARM // 64, 64, 656)
    todo = launches(before)[shard::n_shards]
    for impl, kind, s_q, h_q, cfg, splits in todo:
        mod = sm if impl == "ours" else before
        fn = caller(mod, kind, kv if kind == "bf16" else cache, cfg, splits)
        q = torch.randn(s_q, h_q, 576, device=DEV, generator=gen).bfloat16()
        fn(q, make_indices(s_q, TOPK, gen, s_kv=S_KV_WARM))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print(f"warm {shard}/{n_shards}: {len(todo)} launches", flush=True)


def bench_case(fm, before, kind: str, s_q: int, h_q: int, kv: torch.Tensor, cache: torch.Tensor,
               gen: torch.Generator, copy_bw: float, sweep: bool) -> dict:
    row_bytes = BF16_ROW_BYTES if kind == "bf16" else FP8_ROW_BYTES
    gathered = s_q * TOPK * row_bytes
    n_sets = max(1, min(64, math.ceil(L2_FLUSH_BYTES / gathered)))
    qs = [torch.randn(s_q, h_q, 576, device=DEV, generator=gen).bfloat16() for _ in range(n_sets)]
    idxs = [make_indices(s_q, TOPK, gen) for _ in range(n_sets)]
    src = kv if kind == "bf16" else cache
    result = {"cache": kind, "s_q": s_q, "h_q": h_q, "gathered_MB": gathered / 1e6, "sets": n_sets,
              "flops": 2 * s_q * h_q * TOPK * (576 + 512)}

    def timed(fn, replays=20):
        if DEV == "cpu":  # --cpu-dry-run: one call each, for the script's sake, not the numbers
            started = time.perf_counter()
            for q, i in zip(qs, idxs):
                fn(q, i)
            return (time.perf_counter() - started) / len(qs)
        return time_graph([lambda q=q, i=i: fn(q, i) for q, i in zip(qs, idxs)], replays)

    ours = caller(sm, kind, src, None, None)
    result["ours_s"] = timed(ours)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else sm.DEFAULT_NUM_SMS
    cfg = sm.choose_config(h_q, kind == "fp8", s_q, num_sms, topk=TOPK)
    result["ours_config"] = cfg_name(cfg, kind)
    if before is not None:
        result["before_s"] = timed(caller(before, kind, src, None, None))
    if fm is not None:
        if kind == "bf16":
            theirs = lambda q, i: flashmla_bf16(fm, q, kv, i)  # noqa: E731
        else:
            call = FlashMlaFp8(fm, s_q, h_q)
            theirs = lambda q, i: call(q, cache, i)  # noqa: E731
        result["flashmla_s"] = timed(theirs)
        result["ours_vs_flashmla_err"] = row_error(ours(qs[0], idxs[0])[0], theirs(qs[0], idxs[0]))
    if sweep:
        result["sweep_us"] = {}
        for cfg in CANDIDATES[kind]:
            result["sweep_us"][cfg_name(cfg, kind)] = round(timed(caller(sm, kind, src, cfg, None), 10) * 1e6, 1)
            for splits in SPLIT_SWEEP.get((s_q, h_q), ()):
                result["sweep_us"][f"{cfg_name(cfg, kind)}/s{splits}"] = round(
                    timed(caller(sm, kind, src, cfg, splits), 10) * 1e6, 1)
    for key in ("ours", "before", "flashmla"):
        t = result.get(f"{key}_s")
        if t:
            result[f"{key}_GBps"] = gathered / t / 1e9
            result[f"{key}_pct_copy"] = 100 * gathered / t / 1e9 / copy_bw
            result[f"{key}_TFLOPs"] = result["flops"] / t / 1e12
    return result


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict], copy_bw: float) -> str:
    lines = [f"copy bandwidth {copy_bw:.0f} GB/s (read + write)", "",
             "| cache | s_q x h_q | before us | ours us | ours config | ours % copy | ours TFLOP/s "
             "| FlashMLA us | FlashMLA % copy | ours / before | ours / FlashMLA | fp8 / bf16 (ours) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bf16 = {(r["s_q"], r["h_q"]): r["ours_s"] for r in results if r["cache"] == "bf16"}
    for r in results:
        us = lambda k: r.get(k) and r[k] * 1e6  # noqa: E731
        ratio = lambda a, b: r[a] / r[b] if r.get(a) and r.get(b) else None  # noqa: E731
        vs_bf16 = (r["ours_s"] / bf16[(r["s_q"], r["h_q"])]
                   if r["cache"] == "fp8" and (r["s_q"], r["h_q"]) in bf16 else None)
        lines.append(
            f"| {r['cache']} | {r['s_q']} x {r['h_q']} | {fmt(us('before_s'), '.1f')} | {r['ours_s'] * 1e6:.1f} "
            f"| {r['ours_config']} | {r['ours_pct_copy']:.0f}% | {r['ours_TFLOPs']:.0f} "
            f"| {fmt(us('flashmla_s'), '.1f')} | {fmt(r.get('flashmla_pct_copy'), '.0f')}% "
            f"| {fmt(ratio('ours_s', 'before_s'), '.2f')} | {fmt(ratio('ours_s', 'flashmla_s'), '.2f')} "
            f"| {fmt(vs_bf16, '.2f')} |")
    swept = [r for r in results if r.get("sweep_us")]
    for kind in ("bf16", "fp8"):
        names = list(dict.fromkeys(n for r in swept if r["cache"] == kind for n in r["sweep_us"] if "/" not in n))
        if not names:
            continue
        lines += ["", f"sweep, {kind} (us; the launcher's split rule):", "",
                  "| s_q x h_q | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for r in swept:
            if r["cache"] == kind:
                lines.append(f"| {r['s_q']} x {r['h_q']} | "
                             + " | ".join(fmt(r["sweep_us"].get(n), ".1f") for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashmla", help="folder holding vllm/_flashmla_C.abi3.so and "
                                           "vllm/third_party/flashmla/flash_mla_interface.py")
    parser.add_argument("--before", help="module name of another version of sparse_mla to time too")
    parser.add_argument("--out", type=Path, help="folder for sparse_mla.json and sparse_mla.md")
    parser.add_argument("--sweep", action="store_true", help="also time CANDIDATES and split counts")
    parser.add_argument("--warm", help="I/N: compile share I of N of the launches, then exit")
    parser.add_argument("--only", choices=("bf16", "fp8"), help="time only this cache's cases (and sweep)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="check the script without a GPU: TRITON_INTERPRET=1, a small cache, a few cases")
    args = parser.parse_args()
    if args.cpu_dry_run:
        global DEV, S_KV, TOPK, CASES, L2_FLUSH_BYTES, CHECK_HEADS
        DEV, S_KV, TOPK, L2_FLUSH_BYTES, CHECK_HEADS = "cpu", 4096, 128, 1, (8,)
        CASES = [(kind, s_q, h_q) for kind in ("bf16", "fp8") for s_q, h_q in ((1, 8), (2, 32))]
        CANDIDATES["fp8"] = [cfg for cfg in CANDIDATES["fp8"] if not cfg.gluon]
    if args.only:
        CASES = [c for c in CASES if c[0] == args.only]
    before = importlib.import_module(args.before) if args.before else None
    if args.warm:
        shard, n = (int(x) for x in args.warm.split("/"))
        warm(shard, n, before)
        return

    started = time.time()
    if DEV == "cpu":
        name, sms = "CPU dry run (Triton interpreter; timings mean nothing)", 0
    else:
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
    print(f"{name}, {sms} SMs, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}", flush=True)
    fm = load_flashmla(args.flashmla)
    copy_bw = copy_bandwidth() if DEV == "cuda" else 1.0
    print(f"copy bandwidth: {copy_bw:.0f} GB/s", flush=True)

    gen = torch.Generator(device=DEV).manual_seed(0)
    kv = torch.randn(S_KV, 1, 576, device=DEV, generator=gen).bfloat16()
    cache = sm.quantize_fp8_ds_mla(kv.view(S_KV, 576)).view(S_KV // 64, 64, 656)
    print(f"caches: bf16 {kv.numel() * 2 / 1e9:.2f} GB, fp8 {cache.numel() / 1e9:.2f} GB "
          f"({time.time() - started:.0f} s)", flush=True)

    checks = correctness(fm, before, kv, cache, gen)
    for c in checks:
        print("check", json.dumps(c), flush=True)
    ok = all(c["err"] < 2e-2 and c.get("lse_err", 0) < 1e-2 and c.get("empty_ok", True)
             for c in checks if c["impl"].startswith("ours"))
    worst = max((c["err"] for c in checks if c["impl"].startswith("ours")), default=float("nan"))
    print(f"correctness: {'PASS' if ok else 'FAIL'}, worst row error {worst:.2e} "
          f"({time.time() - started:.0f} s)", flush=True)

    results = []
    for kind, s_q, h_q in CASES:
        r = bench_case(fm, before, kind, s_q, h_q, kv, cache, gen, copy_bw, args.sweep)
        results.append(r)
        print("case", json.dumps(r), flush=True)

    text = table(results, copy_bw)
    header = (f"{name} ({sms} SMs), torch {torch.__version__}, "
              f"triton {__import__('triton').__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, topk {TOPK}, "
              f"{S_KV} slots, correctness {'PASS' if ok else 'FAIL'} (worst row error {worst:.2e})")
    print("\n" + header + "\n" + text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sparse_mla.json").write_text(json.dumps(
            {"header": header, "copy_GBps": copy_bw, "checks": checks, "results": results}, indent=1))
        (args.out / "sparse_mla.md").write_text(header + "\n\n" + text + "\n")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
