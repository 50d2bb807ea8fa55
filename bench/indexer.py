"""DSA indexer on a GPU: mlafleet's DeepGEMM-free kernels against DeepGEMM itself, then timings.

Run on the H200 test machine (DeepGEMM runs on SM90/SM100 only), with vLLM 0.20.2's bundled
DeepGEMM (`vllm/third_party/deep_gemm` from the wheel, importable as `deep_gemm`) and this
repository's `mlafleet` on PYTHONPATH:

    CUDA_HOME=/usr/local/cuda PYTHONPATH=<dir holding deep_gemm>:<repo> python bench/indexer.py --out results.json

For each case (GLM-5: 32 index heads, DeepSeek-V3.2: 64; head dim 128; topk 2048):
  - prefill (`mqa_logits` vs `deep_gemm.fp8_fp4_mqa_logits`): ragged causal ranges as vLLM
    builds them, contexts 8k and 64k;
  - decode (`paged_mqa_logits` vs `deep_gemm.fp8_fp4_paged_mqa_logits`): the paged indexer
    cache through a shuffled block table, batch 1 at 100k tokens and batch 64 at 2k-16k;
  - errors: ours and DeepGEMM's against a float64 reference on sampled rows, ours against
    DeepGEMM on every in-range logit; the top-2048 sets chosen from each;
  - times: CUDA-event medians of ours, DeepGEMM's and the top-k (triton.testing.do_bench;
    decode logits: CUDA-graph replays of 20 calls, where do_bench's launch overhead dominates).
Inputs are random (never zeros), fresh per case; outputs are poisoned before the checked run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from cuda_timing import time_graph

from mlafleet.kernels import indexer as ix
from tests.kernels import oracles  # the float64 references

D = 128
TOPK = 2048
FP8 = torch.float8_e4m3fn
DEV = "cuda"
WARM = False  # --warm: only launch every kernel once (compile caches), no checks or timing


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1).float().clamp_min(1e-4) / 448.0
    return (x / scale[:, None]).to(FP8), scale


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench(fn, warmup_ms: int = 100, rep_ms: int = 200) -> float:
    if DEV == "cpu":  # the dry run checks the script, not speed
        return 1.0
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_graph(fn, calls: int = 20, replays: int = 10) -> float:
    """Median ms per call of `calls` launches captured in one CUDA graph (the decode kernels'
    tens of microseconds, where do_bench's launch overhead dominates)."""
    if DEV == "cpu":
        return 1.0
    return time_graph([fn] * calls, replays) * 1e3


def poison_allocator(shape: tuple[int, int]) -> None:
    """Leave NaN in the caching allocator's next block of this size: an output position the
    kernel fails to write then shows as NaN instead of as a stale earlier result."""
    torch.full(shape, float("nan"), dtype=torch.float32, device=DEV)


def topk_overlap(a: torch.Tensor, b: torch.Tensor, max_rows: int = 64) -> float:
    """Mean over (up to max_rows evenly spaced) rows of |A & B| / |B| for index sets (ignoring -1)."""
    fr = []
    step = max(1, a.shape[0] // max_rows)
    for r in range(0, a.shape[0], step):
        sa = {i for i in a[r].tolist() if i >= 0}
        sb = {i for i in b[r].tolist() if i >= 0}
        fr.append(len(sa & sb) / max(1, len(sb)))
    return sum(fr) / len(fr)


# ------------------------------------------------------------------------------------- prefill


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def prefill_case(dg, heads: int, req_ctx: list[int], req_q: list[int], gen: torch.Generator) -> dict:
    dev = DEV
    ks, ke, start = [], [], 0
    for n, nq in zip(req_ctx, req_q):
        ks += [start] * nq
        ke += [start + p + 1 for p in range(n - nq, n)]
        start += n
    n_keys, m = sum(req_ctx), sum(req_q)
    ks_t = torch.tensor(ks, dtype=torch.int32, device=dev)
    ke_t = torch.tensor(ke, dtype=torch.int32, device=dev)
    q = (torch.randn((m, heads, D), generator=gen, device=dev) * 2).to(FP8)
    k, k_scale = quantize_per_token(torch.randn((n_keys, D), generator=gen, device=dev))
    w = torch.randn((m, heads), generator=gen, device=dev) / heads ** 0.5

    def ours():
        return ix.mqa_logits(q, k, k_scale, w, ks_t, ke_t, clean_logits=False)

    def theirs():
        return dg.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks_t, ke_t, clean_logits=False)

    poison_allocator((m, n_keys))
    out, ref_dg = ours(), theirs()
    sync()
    if WARM:
        return {"case": f"warm prefill H={heads}"}
    cols = torch.arange(n_keys, device=dev)
    inside = (cols[None] >= ks_t[:, None]) & (cols[None] < ke_t[:, None])
    rows = torch.linspace(0, m - 1, 16, device=dev).long()
    ref = oracles.mqa_logits_reference(q[rows], k, k_scale, w[rows], ks_t[rows], ke_t[rows])
    sel = inside[rows]
    res = {
        "case": f"prefill H={heads} ctx={req_ctx} q={req_q}",
        "rel_err_ours_vs_dg": rel_err(out[inside], ref_dg[:, :n_keys][inside]),
        "rel_err_ours_vs_f64": rel_err(out[rows][sel], ref[sel]),
        "rel_err_dg_vs_f64": rel_err(ref_dg[rows][:, :n_keys][sel], ref[sel]),
        "nan_ours": bool(torch.isnan(out[inside]).any()),
    }
    idx_ours = ix.top_k_per_row(out, ks_t, ke_t, TOPK)
    idx_dg = ix.top_k_per_row(ref_dg[:, :n_keys], ks_t, ke_t, TOPK)
    idx_ref = ix.top_k_per_row(ref, ks_t[rows], ke_t[rows], TOPK)
    res["topk_overlap_ours_vs_dg"] = topk_overlap(idx_ours, idx_dg)
    res["topk_overlap_ours_vs_f64"] = topk_overlap(idx_ours[rows], idx_ref)
    res["topk_overlap_dg_vs_f64"] = topk_overlap(idx_dg[rows], idx_ref)
    flops = 2.0 * float(inside.sum()) * heads * D
    res["ms_ours"] = bench(ours)
    res["ms_dg"] = bench(theirs)
    res["ms_topk_ours"] = bench(lambda: ix.top_k_per_row(out, ks_t, ke_t, TOPK))
    res["ms_topk_torch"] = bench(lambda: ix.top_k_per_row_torch(out, ks_t, ke_t, TOPK))
    res["topk_triton_eq_torch"] = topk_overlap(idx_ours, ix.top_k_per_row_torch(out, ks_t, ke_t, TOPK))
    res["tflops_ours"] = flops / res["ms_ours"] / 1e9
    res["tflops_dg"] = flops / res["ms_dg"] / 1e9
    return res


# -------------------------------------------------------------------------------------- decode


def decode_case_inputs(gen: torch.Generator, heads: int, lens: list[int], block_size: int = 64) -> tuple:
    """(q, cache, weights, context_lens, block_table, max_model_len) as vLLM passes them."""
    dev = DEV
    b = len(lens)
    max_model_len = triton.cdiv(max(lens) + 1, block_size) * block_size
    per_req = [triton.cdiv(n, block_size) for n in lens]
    num_blocks = sum(per_req) + 8
    # The cache as vLLM allocates it, filled with random tokens: per block all fp8 values, then scales.
    vals, scales = quantize_per_token(torch.randn((num_blocks * block_size, D), generator=gen, device=dev))
    cache = torch.empty((num_blocks, block_size * (D + 4)), dtype=torch.uint8, device=dev)
    cache[:, : block_size * D] = vals.view(torch.uint8).reshape(num_blocks, block_size * D)
    cache[:, block_size * D:] = scales.view(torch.uint8).reshape(num_blocks, block_size * 4)
    cache = cache.view(num_blocks, block_size, 1, D + 4)
    perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    table = torch.zeros((b, max(per_req)), dtype=torch.int32, device=dev)
    used = 0
    for i, nb in enumerate(per_req):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)[:, None]   # [B, next_n], as vLLM 0.20.2 passes
    q = (torch.randn((b, 1, heads, D), generator=gen, device=dev) * 2).to(FP8)
    w = torch.randn((b, heads), generator=gen, device=dev) / heads ** 0.5
    return q, cache, w, ctx, table, max_model_len


def decode_case(dg, heads: int, lens: list[int], gen: torch.Generator, block_size: int = 64) -> dict:
    dev = DEV
    b = len(lens)
    q, cache, w, ctx, table, max_model_len = decode_case_inputs(gen, heads, lens, block_size)
    sched = dg.get_paged_mqa_logits_metadata(ctx, block_size, num_sms())

    def ours():
        return ix.paged_mqa_logits(q, cache, w, ctx, table, max_model_len, clean_logits=False)

    def theirs():
        return dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, sched, max_model_len, clean_logits=False)

    poison_allocator((b, max_model_len))
    out, ref_dg = ours(), theirs()
    sync()
    if WARM:
        return {"case": f"warm decode H={heads}"}
    cols = torch.arange(max_model_len, device=dev)
    inside = cols[None] < ctx
    rows = torch.unique(torch.linspace(0, b - 1, min(b, 8), device=dev).long())
    ref = oracles.paged_mqa_logits_reference(q[rows], cache, w[rows], ctx[rows], table[rows], max_model_len)
    sel = inside[rows]
    res = {
        "case": f"decode H={heads} B={b} ctx {min(lens)}-{max(lens)}",
        "rel_err_ours_vs_dg": rel_err(out[inside], ref_dg[inside]),
        "rel_err_ours_vs_f64": rel_err(out[rows][sel], ref[sel]),
        "rel_err_dg_vs_f64": rel_err(ref_dg[rows][sel], ref[sel]),
        "nan_ours": bool(torch.isnan(out[inside]).any()),
    }
    ends = ctx.reshape(-1)
    idx_ours = ix.top_k_per_row(out, None, ends, TOPK)
    idx_dg = ix.top_k_per_row(ref_dg, None, ends, TOPK)
    idx_ref = ix.top_k_per_row(ref, None, ends[rows], TOPK)
    res["topk_overlap_ours_vs_dg"] = topk_overlap(idx_ours, idx_dg)
    res["topk_overlap_ours_vs_f64"] = topk_overlap(idx_ours[rows], idx_ref)
    res["topk_overlap_dg_vs_f64"] = topk_overlap(idx_dg[rows], idx_ref)
    res["ms_ours"] = bench_graph(ours)
    res["ms_dg"] = bench_graph(theirs)
    res["ms_topk_ours"] = bench(lambda: ix.top_k_per_row(out, None, ends, TOPK))
    res["ms_topk_torch"] = bench(lambda: ix.top_k_per_row_torch(out, None, ends, TOPK))
    res["topk_triton_eq_torch"] = topk_overlap(idx_ours, ix.top_k_per_row_torch(out, None, ends, TOPK))
    bytes_moved = sum(lens) * (D + 4) + sum(lens) * 4
    res["gbs_ours"] = bytes_moved / res["ms_ours"] / 1e6
    res["gbs_dg"] = bytes_moved / res["ms_dg"] / 1e6
    return res


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 1


class ReferenceDeepGemm:
    """--cpu-dry-run: DeepGEMM's entry points stood in by the float64 references, to check this
    script on a machine without a GPU before spending device time (never for numbers)."""

    @staticmethod
    def fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits):
        return oracles.mqa_logits_reference(q[0], kv[0], kv[1], weights, ks, ke)

    @staticmethod
    def get_paged_mqa_logits_metadata(ctx, block_size, sms):
        return torch.empty((sms + 1, 2), dtype=torch.int32)

    @staticmethod
    def fp8_fp4_paged_mqa_logits(q, cache, weights, ctx, table, sched, max_model_len, clean_logits):
        return oracles.paged_mqa_logits_reference(q[0], cache, weights, ctx, table, max_model_len)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="indexer-bench.json")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip remaining cases past this")
    parser.add_argument("--quick", action="store_true", help="two small cases")
    parser.add_argument("--sweep", action="store_true", help="then time other tile configurations of ours")
    parser.add_argument("--cpu-dry-run", action="store_true", help="no GPU: check the script (TRITON_INTERPRET=1)")
    parser.add_argument("--warm", action="store_true", help="launch every kernel once (fills the JIT caches), then exit")
    args = parser.parse_args()
    global DEV, WARM
    WARM = args.warm
    if args.cpu_dry_run:
        DEV, dg = "cpu", ReferenceDeepGemm()
        meta = {"gpu": "none (dry run)"}
    else:
        import deep_gemm as dg

        props = torch.cuda.get_device_properties(0)
        meta = {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(0)),
                "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__}
    meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.time()
    print(json.dumps(meta), flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    g_cpu = torch.Generator().manual_seed(1)
    lens64 = torch.randint(2000, 16000, (64,), generator=g_cpu).tolist()
    cases = [
        ("decode", 64, [100000]), ("decode", 64, lens64),
        ("prefill", 64, ([4096, 4096], [1024, 1024])), ("prefill", 64, ([65536], [4096])),
        ("decode", 32, [100000]), ("decode", 32, lens64),
        ("prefill", 32, ([4096, 4096], [1024, 1024])), ("prefill", 32, ([65536], [4096])),
    ]
    if args.quick:
        cases = [("decode", 64, [3000, 1000]), ("prefill", 64, ([300, 200], [40, 30]))]
    results = []
    for kind, heads, shape in cases:
        if time.time() - t0 > args.budget_s:
            results.append({"case": f"{kind} H={heads}", "skipped": "time budget"})
            continue
        t = time.time()
        res = decode_case(dg, heads, shape, gen) if kind == "decode" else prefill_case(dg, heads, *shape, gen)
        res["wall_s"] = round(time.time() - t, 1)
        results.append(res)
        print(json.dumps(res), flush=True)
        if WARM:
            continue
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    if WARM:
        if args.sweep:
            sweep(gen, lens64, results, meta, args.out)
        print(f"warm: {time.time() - t0:.0f} s")
        return
    print(f"{'case':44s} {'ours ms':>9s} {'DG ms':>9s} {'ours/DG':>8s} {'topk ms':>8s} {'torch tk':>8s} {'err vs DG':>10s} {'err f64':>9s} {'DG f64':>9s} {'top-k ov':>8s}")
    for r in results:
        if "skipped" in r:
            print(f"{r['case']:44s} skipped")
            continue
        print(f"{r['case'][:44]:44s} {r['ms_ours']:9.4f} {r['ms_dg']:9.4f} {r['ms_ours'] / r['ms_dg']:8.2f} "
              f"{r['ms_topk_ours']:8.4f} {r['ms_topk_torch']:8.4f} {r['rel_err_ours_vs_dg']:10.2e} {r['rel_err_ours_vs_f64']:9.2e} "
              f"{r['rel_err_dg_vs_f64']:9.2e} {r['topk_overlap_ours_vs_dg']:8.4f}")
    if args.sweep and DEV == "cuda":
        sweep(gen, lens64, results, meta, args.out)
    print(f"total {time.time() - t0:.0f} s")


# (rows, BLOCK_N, warps, stages, key-major), (warps, stages, key-major), top-k splits (None: the default)
PREFILL_VARIANTS = [(128, 64, 4, 3, True), (128, 64, 4, 4, True), (128, 128, 8, 3, True), (64, 64, 4, 3, True),
                    (256, 64, 8, 3, True), (128, 128, 4, 3, True)]
DECODE_VARIANTS = [(4, 3, False), (4, 2, False), (4, 4, False), (4, 3, True)]
TOPK_SPLITS = [1, None, 33, 132]


def sweep(gen: torch.Generator, lens64: list[int], results: list, meta: dict, out_path: str) -> None:
    """Our kernels alone under other tile configurations: prefill (rows, BLOCK_N, warps, stages,
    key-major) at H=64 and 32, decode (warps, stages, key-major) at H=64, the top-k splits."""
    m, n = 4096, 65536
    saved = (ix.PREFILL_ROWS, ix.PREFILL_BLOCK_N, ix.PREFILL_WARPS, ix.PREFILL_STAGES, ix.PREFILL_KEY_MAJOR)
    for heads in (64, 32):
        ks = torch.zeros(m, dtype=torch.int32, device=DEV)
        ke = torch.arange(n - m + 1, n + 1, dtype=torch.int32, device=DEV)
        q = (torch.randn((m, heads, D), generator=gen, device=DEV) * 2).to(FP8)
        k, k_scale = quantize_per_token(torch.randn((n, D), generator=gen, device=DEV))
        w = torch.randn((m, heads), generator=gen, device=DEV) / heads ** 0.5
        base = oracles.mqa_logits_reference(q[::512], k, k_scale, w[::512], ks[::512], ke[::512])
        flops = 2.0 * float((ke - ks).sum()) * heads * D
        inside = torch.arange(n, device=DEV)[None] < ke[::512, None]
        for rows, bn, warps, stages, key_major in PREFILL_VARIANTS:
            ix.PREFILL_ROWS, ix.PREFILL_BLOCK_N, ix.PREFILL_WARPS, ix.PREFILL_STAGES, ix.PREFILL_KEY_MAJOR = \
                rows, bn, warps, stages, key_major
            name = f"sweep prefill H={heads} 65536x4096 rows={rows} bn={bn} w={warps} s={stages} km={int(key_major)}"
            try:
                out = ix.mqa_logits(q, k, k_scale, w, ks, ke)
                if WARM:
                    continue
                err = rel_err(out[::512][inside], base[inside])
                ms = bench(lambda: ix.mqa_logits(q, k, k_scale, w, ks, ke))
                r = {"case": name, "ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_f64": err}
            except Exception as e:  # a config that does not compile or launch on this GPU
                r = {"case": name, "error": repr(e)[:300]}
            print(json.dumps(r), flush=True)
            results.append(r)
    ix.PREFILL_ROWS, ix.PREFILL_BLOCK_N, ix.PREFILL_WARPS, ix.PREFILL_STAGES, ix.PREFILL_KEY_MAJOR = saved
    saved = (ix.DECODE_WARPS, ix.DECODE_STAGES, ix.DECODE_KEY_MAJOR)
    for heads, lens in ((64, lens64), (64, [100000]), (32, lens64)):
        res = decode_case_inputs(gen, heads, lens)
        for warps, stages, key_major in DECODE_VARIANTS:
            ix.DECODE_WARPS, ix.DECODE_STAGES, ix.DECODE_KEY_MAJOR = warps, stages, key_major
            out = ix.paged_mqa_logits(*res)
            if WARM:
                continue
            ms = bench_graph(lambda: ix.paged_mqa_logits(*res))
            inside = torch.arange(out.shape[1], device=DEV)[None] < res[3]  # only the context is defined
            if (warps, stages, key_major) == DECODE_VARIANTS[0]:
                first = out
            r = {"case": f"sweep decode H={heads} B={len(lens)} w={warps} s={stages} km={int(key_major)}", "ms": ms,
                 "max_abs_diff_vs_first": float((out - first)[inside].abs().max())}
            print(json.dumps(r), flush=True)
            results.append(r)
    ix.DECODE_WARPS, ix.DECODE_STAGES, ix.DECODE_KEY_MAJOR = saved
    if WARM:
        return
    # top-k (BLOCK, warps) on decode B=1 x 100k, decode B=64 and prefill 4096 x 65536 logits
    one = torch.randn((1, 100096), generator=gen, device=DEV)
    one_end = torch.tensor([100000], dtype=torch.int32, device=DEV)
    many = torch.randn((64, 16384), generator=gen, device=DEV)
    many_end = torch.tensor(lens64, dtype=torch.int32, device=DEV)
    four = torch.randn((4, 100096), generator=gen, device=DEV)
    four_end = torch.full((4,), 100000, dtype=torch.int32, device=DEV)
    want_one = ix.top_k_per_row_torch(one, None, one_end, TOPK)
    for splits in TOPK_SPLITS:
        got = ix.top_k_per_row(one, None, one_end, TOPK, splits=splits)
        r = {"case": f"sweep top-k splits={splits}",
             "same_set_as_torch_1x100k": topk_overlap(got, want_one),
             "ms_1x100k": bench(lambda: ix.top_k_per_row(one, None, one_end, TOPK, splits=splits)),
             "ms_4x100k": bench(lambda: ix.top_k_per_row(four, None, four_end, TOPK, splits=splits)),
             "ms_64x2k-16k": bench(lambda: ix.top_k_per_row(many, None, many_end, TOPK, splits=splits))}
        print(json.dumps(r), flush=True)
        results.append(r)
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
