"""The fp8_ds_mla sparse-MLA kernel in Gluon (Triton's explicit-layout dialect), for SM12x.

sparse_mla.py's launcher runs it for fp8_ds_mla caches on compute capability 12.x from batches of
a quarter of the SM count in programs on (sparse_mla.GLUON_MIN_GRID_PER_SM; decode keeps the Triton
kernel), and on any GPU when a test or benchmark forces its config (sparse_mla.GLUON_FP8). Same
contract, same output; docs/perf-kernels.md ("Seventh pass", "Eighth pass") has the measurements that chose it.

One program = one query token x 16 heads x one split of its indices, 4 warps, one per scale group
(128 latent dims) as the batch dimension of a batched mma_v2 (tensor-core MMA, sm_80 and later):

- q's group g stays in warp g's registers (times 2^100; the keys arrive as x * 2^-120);
- each step gathers BLOCK_N keys with cp.async into a ring of STAGES tiles, group-major
  ([STAGES, 4, BLOCK_N, 128] bytes, 16-byte swizzle) beside their 64 bf16 RoPE values;
- Q.K reads the raw fp8 bytes into the B-operand layout and turns them into bf16 in registers
  (sparse_mla's bit moves), each group's partial logits times its per-key scale, the four groups
  and the RoPE part summed across the warps;
- P.V reads the same bytes as 16-bit pairs of dims (ldmatrix.trans), split by two byte permutes
  into the even and the odd dim's operand (PAIR_SPLIT): no converted tile in shared memory. Group
  g's P is p times g's scales, so every value is exact and the scales never touch the 512 dims.

Shared memory is the ring alone: 20 KB a stage, 49 KB at 2 stages, so two programs share an sm_120
SM's 99 KB (the Triton fp8 kernel's 94 KB hold one). Gluon kernels do not run in Triton's CPU
interpreter: CI compiles this one for sm_120 (tests/kernels/test_sparse_mla_sm120.py), and
bench/sparse_mla.py checks it against the float32 reference on a GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp, mma_v2

from .sparse_mla import _FP8_BITS_PTX

# a CTA-wide barrier: gl.thread_barrier in Triton 3.6 (vLLM 0.20.2's), gl.barrier in 3.7 (0.32.0's)
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# fp8 bytes -> bf16 x 2^-120, exactly: sparse_mla's bit moves, four bytes at a time
FP8_TO_BF16 = gl.constexpr("{" + _FP8_BITS_PTX.value + "mov.b32 $0, a0;\nmov.b32 $1, a1;\n}")
# One 32-bit register of the P.V operand holds the same pair of dims (2c, 2c+1) of keys k and k+1:
# bytes [x(k,2c), x(k,2c+1), x(k+1,2c), x(k+1,2c+1)]. The permutes gather dim 2c's two keys ($0)
# and dim 2c+1's ($1), each byte b into a 16-bit word (sign(b) x 8, b); shift and mask as above.
PAIR_SPLIT = gl.constexpr("""{
    .reg .b32 a<2>;
    prmt.b32 a0, $2, 0, 0xA280;
    prmt.b32 a1, $2, 0, 0xB391;
    shl.b32 a0, a0, 4;
    shl.b32 a1, a1, 4;
    and.b32 $0, a0, 0x87F087F0;
    and.b32 $1, a1, 0x87F087F0;
}""")
Q_SCALE = gl.constexpr(1.2676506002282294e30)  # 2^100: q times this meets keys x * 2^-120 as normal float32 products
SCALE_SHIFT = gl.constexpr(1048576.0)  # 2^20: what q * 2^100 * x * 2^-120 leaves out, folded into each scale
P_SCALE = gl.constexpr(1.2089258196146292e24)  # 2^80: P_g = p * scale_g * 2^20 * 2^80 meets x * 2^-120: output * 2^-20
SCAN = gl.constexpr(256)  # indices per step of the last-valid-index pass (TRIM_TAIL)


@gluon.jit
def online_softmax(s, m_i, l_i):
    """One tile's online-softmax step over logits s (base 2, -inf where invalid): the new running
    max, the rescale of what came before (alpha), the tile's probabilities and the new running sum."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: avoid inf - inf
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def reserve_shared(PAD_KB: gl.constexpr, num_warps: gl.constexpr):
    """Benchmarks only (bench/gluon_fp8_probe.py --sm120-occupancy): PAD_KB more KB of shared
    memory held from the kernel's start to its end (shared_kept), so that an H200 SM (228 KB)
    holds only as many programs as sm_120's 99 KB would."""
    pad = gl.allocate_shared_memory(gl.uint8, [PAD_KB * 1024],
                                    gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    pad.slice(0, 32 * num_warps).store(gl.zeros([32 * num_warps], gl.uint8,
                                                layout=gl.BlockedLayout([1], [32], [num_warps], [0])))
    return pad


@gluon.jit
def shared_kept(pad, num_warps: gl.constexpr):
    """0.0, read from reserve_shared's pad at the end, so that its allocation spans the kernel."""
    keep = pad.slice(0, 32 * num_warps).load(gl.BlockedLayout([1], [32], [num_warps], [0]))
    return gl.sum(keep.to(gl.float32), axis=0) * 0.0


@gluon.jit
def _issue_gather(raw, rope, t, n_tiles, idx_raw, idx_rope, n_slots, KV, KVH, stride_kv_tok,
                  STAGES: gl.constexpr, RAW3: gl.constexpr, ROPE3: gl.constexpr):
    """cp.async of tile t's keys into ring slot t % STAGES: 4 groups x 128 fp8 bytes and 4 x 16 RoPE
    values a key. Invalid keys and tiles past n_tiles read nothing (zero-filled)."""
    g = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, RAW3)))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, RAW3)))
    ok = (idx_raw >= 0) & (idx_raw < n_slots) & (t < n_tiles)
    ptr = KV + idx_raw.to(gl.int64)[None, :, None] * stride_kv_tok + g[:, None, None] * 128 + c[None, None, :]
    cp.async_copy_global_to_shared(raw.index(t % STAGES), ptr, mask=gl.broadcast(ok[None, :, None], ptr)[0])
    gr = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, ROPE3)))
    cr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, ROPE3)))
    rok = (idx_rope >= 0) & (idx_rope < n_slots) & (t < n_tiles)
    rptr = (KVH + idx_rope.to(gl.int64)[None, :, None] * (stride_kv_tok // 2) + 264
            + gr[:, None, None] * 16 + cr[None, None, :])
    cp.async_copy_global_to_shared(rope.index(t % STAGES), rptr, mask=gl.broadcast(rok[None, :, None], rptr)[0])
    cp.commit_group()


@gluon.jit
def sparse_mla_fp8_grouped(
    Q, stride_q_tok, stride_q_head,  # the latent half of q [s_q, h_q, 512] (dims contiguous)
    Q_ROPE, stride_qr_tok, stride_qr_head,  # the RoPE half [s_q, h_q, 64]
    KV, KVH, KVF, stride_kv_tok,  # the fp8_ds_mla rows as bytes, bf16 and float32; bytes between tokens
    n_slots,
    IDX, stride_idx_tok,  # [s_q, 1, topk] (indices contiguous)
    OUT, stride_out_tok, stride_out_split, stride_out_head,  # [s_q, (splits,) h_q, 512] (dims contiguous)
    LSE, stride_lse_tok, stride_lse_split,  # [s_q, (splits,) h_q] (heads contiguous)
    h_q, topk, tokens_per_split, n_split, n_head_blocks,
    qk_scale_log2,  # sm_scale * log2(e): the softmax runs in base 2
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PARTIAL: gl.constexpr,  # several splits: float32 partials and partial LSEs for the merge kernel
    TRIM_TAIL: gl.constexpr,  # first find the split's last valid index, stop the key loop there
    num_warps: gl.constexpr,
    PAD_KB: gl.constexpr = 0,  # benchmarks only: reserve_shared
):
    gl.static_assert(num_warps == 4, "one warp per scale group")
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    A2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    A4: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B4: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    S2: gl.constexpr = gl.SliceLayout(0, MMA)  # [16 heads, BLOCK_N keys]: the summed logits, in every warp
    ROW: gl.constexpr = gl.SliceLayout(1, S2)
    COL: gl.constexpr = gl.SliceLayout(0, S2)
    GK: gl.constexpr = gl.SliceLayout(1, MMA)  # [4 groups, BLOCK_N keys]: the scales
    HEADS3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, MMA))  # a [16] vector of heads, as [1, 16, 1]
    RAW3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [4, 1, 1], [2, 1, 0])
    ROPE3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 16, 2], [4, 1, 1], [2, 1, 0])
    Q3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [4, 1, 1], [2, 1, 0])
    SCAN_L: gl.constexpr = gl.BlockedLayout([SCAN // 128], [32], [4], [0])
    RAW_S: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[2, 1, 0])
    PAIRS_S: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
    ROPE_S: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[2, 1, 0])

    pid = gl.program_id(0)
    if PAD_KB > 0:
        pad = reserve_shared(PAD_KB, num_warps)
    head_block = pid % n_head_blocks
    rest = pid // n_head_blocks
    split = rest % n_split
    tok = (rest // n_split).to(gl.int64)

    # q in registers, group g in warp g: latent dims 128g.. times 2^100, RoPE dims 16g..16g+15
    g3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, Q3)))
    h3 = head_block * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, Q3)))
    d3 = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q3)))
    hm = gl.broadcast((h3 < h_q)[None, :, None], g3[:, None, None])[0]
    qp = Q + tok * stride_q_tok + h3.to(gl.int64)[None, :, None] * stride_q_head + g3[:, None, None] * 128 + d3[None, None, :]
    q_lat = gl.load(qp, mask=gl.broadcast(hm, qp)[0], other=0.0).to(gl.float32) * Q_SCALE
    q_lat = gl.convert_layout(q_lat.to(gl.bfloat16), A4)
    d16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q3)))
    rp = (Q_ROPE + tok * stride_qr_tok + h3.to(gl.int64)[None, :, None] * stride_qr_head + g3[:, None, None] * 16
          + d16[None, None, :])
    q_rope = gl.convert_layout(gl.load(rp, mask=gl.broadcast(hm, rp)[0], other=0.0).to(gl.bfloat16), A2)

    raw = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, BLOCK_N, 128], RAW_S)
    rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4, BLOCK_N, 16], ROPE_S)

    start = split * tokens_per_split
    idx_base = IDX + tok * stride_idx_tok + start
    span = gl.minimum(tokens_per_split, topk - start)  # a multiple of BLOCK_N (the launcher's check)
    if TRIM_TAIL:
        # a prompt's first topk tokens have fewer candidates than topk: the indexer leaves their
        # positions first and -1 after them, so one pass over the indices finds the last valid
        # one and the key loop ends there (exact for any layout: only trailing entries are skipped)
        last = span * 0 - 1
        for c in range(0, span, SCAN):
            offs = c + gl.arange(0, SCAN, layout=SCAN_L)
            idx = gl.load(idx_base + offs, mask=offs < span, other=-1)
            last = gl.maximum(last, gl.max(gl.where((idx >= 0) & (idx < n_slots), offs, -1), axis=0))
        span = last + 1
    n_tiles = (span + BLOCK_N - 1) // BLOCK_N
    r_raw = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, RAW3)))
    r_rope = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, ROPE3)))
    for t in gl.static_range(STAGES - 1):
        _issue_gather(raw, rope, t, n_tiles, gl.load(idx_base + t * BLOCK_N + r_raw, mask=t < n_tiles, other=-1),
                      gl.load(idx_base + t * BLOCK_N + r_rope, mask=t < n_tiles, other=-1), n_slots, KV, KVH,
                      stride_kv_tok, STAGES, RAW3, ROPE3)
    nt = STAGES - 1
    nxt_raw = gl.load(idx_base + nt * BLOCK_N + r_raw, mask=nt < n_tiles, other=-1)
    nxt_rope = gl.load(idx_base + nt * BLOCK_N + r_rope, mask=nt < n_tiles, other=-1)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=ROW)
    l_i = gl.zeros([16], gl.float32, layout=ROW)
    acc_e = gl.zeros([4, 16, 64], gl.float32, layout=MMA)  # group g's even output dims, in warp g
    acc_o = gl.zeros([4, 16, 64], gl.float32, layout=MMA)  # ... and its odd ones
    kc = gl.arange(0, BLOCK_N, layout=COL)
    gk = gl.arange(0, 4, layout=gl.SliceLayout(1, GK))
    kk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, GK))
    zero = gl.zeros([4, 16, BLOCK_N], gl.float32, layout=MMA)
    for i in range(n_tiles):
        cp.wait_group(STAGES - 2)
        _barrier()  # tile i landed; every warp is past tile i - 1, whose ring slot is refilled next
        _issue_gather(raw, rope, i + STAGES - 1, n_tiles, nxt_raw, nxt_rope, n_slots, KV, KVH, stride_kv_tok,
                      STAGES, RAW3, ROPE3)
        ahead = i + STAGES
        nxt_raw = gl.load(idx_base + ahead * BLOCK_N + r_raw, mask=ahead < n_tiles, other=-1)
        nxt_rope = gl.load(idx_base + ahead * BLOCK_N + r_rope, mask=ahead < n_tiles, other=-1)

        slot = i % STAGES
        r = raw.index(slot)
        idx_c = gl.load(idx_base + i * BLOCK_N + kc)
        ok_c = (idx_c >= 0) & (idx_c < n_slots)
        idx_k = gl.load(idx_base + i * BLOCK_N + kk)
        ok_k = (idx_k >= 0) & (idx_k < n_slots)
        sc = gl.load(KVF + idx_k.to(gl.int64)[None, :] * (stride_kv_tok // 4) + 128 + gk[:, None],
                     mask=gl.broadcast(ok_k[None, :], gk[:, None])[0], other=0.0) * SCALE_SHIFT  # [4, BLOCK_N]

        kb = gl.inline_asm_elementwise(FP8_TO_BF16, "=r,=r,r", [r.permute([0, 2, 1]).load(B4)], dtype=gl.bfloat16,
                                       is_pure=True, pack=4)
        s_part = mma_v2(q_lat, kb, zero) * sc[:, None, :]
        s_part = mma_v2(q_rope, rope.index(slot).permute([0, 2, 1]).load(B2), s_part)
        s = gl.sum(s_part, axis=0)  # the four groups' logits: across the warps
        s = gl.where(ok_c[None, :], s * qk_scale_log2, float("-inf"))

        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i)
        pg = (gl.expand_dims(p, 0) * (sc * P_SCALE)[:, None, :]).to(gl.bfloat16)  # P_g in warp g
        pa = gl.convert_layout(pg, A2)
        v = r._reinterpret(gl.int16, [4, BLOCK_N, 64], PAIRS_S).load(B2)
        even, odd = gl.inline_asm_elementwise(PAIR_SPLIT, "=r,=r,r", [v], dtype=(gl.bfloat16, gl.bfloat16),
                                              is_pure=True, pack=2)
        a3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(alpha, HEADS3), 0), 2)
        acc_e = mma_v2(pa, even, acc_e * a3)
        acc_o = mma_v2(pa, odd, acc_o * a3)
    cp.wait_group(0)

    empty = l_i == 0.0
    inv = gl.where(empty, 0.0, SCALE_SHIFT / gl.where(empty, 1.0, l_i))  # the accumulators hold 2^-20 x out
    inv3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(inv, HEADS3), 0), 2)
    go = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    ho = head_block * 16 + gl.arange(0, 16, layout=HEADS3)
    co = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    o = (OUT + tok * stride_out_tok + split * stride_out_split + ho.to(gl.int64)[None, :, None] * stride_out_head
         + go[:, None, None] * 128 + 2 * co[None, None, :])
    om = gl.broadcast((ho < h_q)[None, :, None], o)[0]
    out_dtype: gl.constexpr = gl.float32 if PARTIAL else gl.bfloat16
    gl.store(o, (acc_e * inv3).to(out_dtype), mask=om)
    gl.store(o + 1, (acc_o * inv3).to(out_dtype), mask=om)
    hl = head_block * 16 + gl.arange(0, 16, layout=ROW)
    empty_lse: gl.constexpr = float("-inf") if PARTIAL else float("inf")  # +inf: the contract's "no token"
    lse = gl.where(empty, empty_lse, (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if PAD_KB > 0:
        lse = lse + shared_kept(pad, num_warps)
    gl.store(LSE + tok * stride_lse_tok + split * stride_lse_split + hl, lse, mask=hl < h_q)


NUM_WARPS = 4  # one per scale group (16 heads a program: sparse_mla.GLUON_FP8.block_h)


def launch(grid: int, q, q_rope, rows, n_slots: int, indices, out, out_strides, lse, lse_strides,
           h_q: int, topk: int, tokens_per_split: int, n_split: int, n_head_blocks: int,
           qk_scale_log2: float, block_n: int, stages: int, partial: bool, trim: bool,
           maxnreg: int | None, pad_kb: int = 0) -> None:
    """One launch over `grid` programs (sparse_mla._run's arguments: out_strides (token, split,
    head), lse_strides (token, split); rows the fp8_ds_mla cache as uint8 [slots, 656] rows)."""
    sparse_mla_fp8_grouped[(grid,)](
        q, q.stride(0), q.stride(1),
        q_rope, q_rope.stride(0), q_rope.stride(1),
        rows, rows.view(torch.bfloat16), rows.view(torch.float32), rows.stride(0),
        n_slots,
        indices, indices.stride(0),
        out, *out_strides,
        lse, *lse_strides,
        h_q, topk, tokens_per_split, n_split, n_head_blocks,
        qk_scale_log2,
        BLOCK_N=block_n, STAGES=stages, PARTIAL=partial, TRIM_TAIL=trim, num_warps=NUM_WARPS, PAD_KB=pad_kb,
        maxnreg=maxnreg,
    )
