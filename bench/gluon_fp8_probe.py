"""Issue 16's fp8_ds_mla path in Gluon (Triton's explicit-layout dialect,
`triton.experimental.gluon`, Triton 3.6 and 3.7): a compile-only study of the key loop and two
whole prototype kernels, with their correctness and timing on a GPU.

Compile-only (no GPU): each variant compiled for sm_120 (and sm_90), its shared memory,
registers, spills and instruction mix printed. The question is whether Gluon can express the
loop that Triton's tl.dot cannot (docs/perf-kernels.md, "Fourth pass": the fp8 tile's conversion
sits between the gather and the first tensor-core instruction) within sm_120's 99 KB. One query
token, 16 heads, BLOCK_N keys a step gathered with cp.async into a ring of STAGES raw rows:

  staged:    (512 latent dims, study only) every key tile converted (fp8 bytes -> bf16 x 2^-120,
             integer bit moves) into a double-buffered bf16 tile in shared memory;
  direct:    (512 latent dims, study only) Q.K reads the raw bytes straight into the tensor-core
             B-operand layout (k_width 4: four consecutive key bytes per 32-bit shared load) and
             converts them in registers; P.V's operand is converted into one bf16 tile;
  prototype: `gluon_fp8_sparse_mla`, whole (RoPE, the four per-128 scales, invalid indices, the
             LSE; one program per token and 16 or 32 heads over all its indices, no splits: for
             s_q >= 256). Q.K as "direct"; P.V reads the ring too, as 16-bit pairs of dims with
             ldmatrix.trans, so that one register holds the same dim pair of two keys, which byte
             permutes split into the even and the odd dim's operand (PAIR_SPLIT): no converted
             tile. The scales go onto the logits (Q.K) and onto P (P.V, one P per group).
  grouped:   the launcher's Gluon kernel since the eighth pass (mlafleet/kernels/sparse_mla_gluon.py,
             the prototype with each of the 4 warps on one scale group as the batch dimension of a
             batched mma_v2: q stays in registers, where the prototype reloads all of q from shared
             memory in every warp at every tile), timed here beside the prototype.

With --run (a CUDA GPU, mlafleet importable): the prototypes against the float32 reference
(invalid and out-of-range indices, a row with nothing valid) and against mlafleet's Triton
launcher, then timed by CUDA-graph replay (bench/cuda_timing.py) beside the Triton launcher's
fp8 and bf16 times.

    PYTHONPATH=. python bench/gluon_fp8_probe.py [--cap 120] [--cap 90]   # compile-only, any machine
    PYTHONPATH=. python bench/gluon_fp8_probe.py --run            # on the GPU
"""
import argparse
import collections
import dataclasses
import functools
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp, mma_v2

from mlafleet.kernels import sparse_mla as sm
from mlafleet.kernels import sparse_mla_gluon as glu
from mlafleet.kernels.sparse_mla_gluon import PAIR_SPLIT, online_softmax, reserve_shared, shared_kept
from mlafleet.kernels.sparse_mla_gluon import FP8_TO_BF16 as PTX  # fp8 bytes -> bf16 x 2^-120
from mlafleet.kernels.sparse_mla_gluon import _barrier


@gluon.jit
def _softmax_pv(s, m_i, l_i, acc0, acc1, acc2, acc3, p_smem, v_tile, A_OP: gl.constexpr, B_OP: gl.constexpr):
    """One tile's online-softmax update (logits s in base 2, -inf where invalid) and P.V over the
    four 128-column groups of v_tile ([BLOCK_N, 512] bf16 in shared memory): P goes through p_smem."""
    m_new, alpha, p, l_i = online_softmax(s, m_i, l_i)
    p_smem.store(p.to(gl.bfloat16))
    _barrier()
    pa = p_smem.load(A_OP)
    acc0 = mma_v2(pa, v_tile.slice(0, 128, dim=1).load(B_OP), acc0 * alpha[:, None])
    acc1 = mma_v2(pa, v_tile.slice(128, 128, dim=1).load(B_OP), acc1 * alpha[:, None])
    acc2 = mma_v2(pa, v_tile.slice(256, 128, dim=1).load(B_OP), acc2 * alpha[:, None])
    acc3 = mma_v2(pa, v_tile.slice(384, 128, dim=1).load(B_OP), acc3 * alpha[:, None])
    return m_new, l_i, acc0, acc1, acc2, acc3


@gluon.jit
def _convert(raw_smem, dst_smem, RAW_L: gl.constexpr):
    raw = raw_smem.load(RAW_L)
    v = gl.inline_asm_elementwise(PTX, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)
    dst_smem.store(v)


@gluon.jit
def _cvt_regs(raw):
    return gl.inline_asm_elementwise(PTX, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def probe_kernel(Q, KV, IDX, OUT, topk, qk_scale,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr, num_warps: gl.constexpr):
    TOK: gl.constexpr = 656
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    A_OP4: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_OP4: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    RAW_L: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [num_warps, 1], [1, 0])
    ROW_L: gl.constexpr = gl.SliceLayout(1, RAW_L)
    COL_L: gl.constexpr = gl.SliceLayout(0, RAW_L)
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    SWZ: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])

    tok = gl.program_id(0).to(gl.int64)
    hq = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_L))
    dq = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
    q_base = Q + tok * (16 * 576) + hq[:, None] * 576 + dq[None, :]
    QL: gl.constexpr = A_OP4 if DIRECT else A_OP
    # q staged once in shared memory, read into the A-operand layout at each tile's Q.K
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, 16, 128], SWZ)
    q_smem.index(0).store(gl.load(q_base + 0))
    q_smem.index(1).store(gl.load(q_base + 128))
    q_smem.index(2).store(gl.load(q_base + 256))
    q_smem.index(3).store(gl.load(q_base + 384))

    raw = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], PLAIN)
    cvt = gl.allocate_shared_memory(gl.bfloat16, [1 if DIRECT else 2, BLOCK_N, 512], SWZ)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_N], SWZ)

    rows = gl.arange(0, BLOCK_N, layout=ROW_L)
    cols = gl.arange(0, 512, layout=COL_L)
    idx_base = IDX + tok * topk
    n_tiles = topk // BLOCK_N
    # prologue: STAGES - 1 gathers in flight
    for st in gl.static_range(STAGES - 1):
        slot = gl.load(idx_base + st * BLOCK_N + rows).to(gl.int64)
        cp.async_copy_global_to_shared(raw.index(st), KV + slot[:, None] * TOK + cols[None, :])
        cp.commit_group()
    cp.wait_group(STAGES - 2)
    _barrier()
    if not DIRECT:
        _convert(raw.index(0), cvt.index(0), RAW_L)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc0 = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc1 = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc2 = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc3 = gl.zeros([16, 128], gl.float32, layout=MMA)
    for i in range(n_tiles):
        # the next gather
        nxt = i + STAGES - 1
        slot = gl.load(idx_base + (nxt % n_tiles) * BLOCK_N + rows).to(gl.int64)
        cp.async_copy_global_to_shared(raw.index(nxt % STAGES), KV + slot[:, None] * TOK + cols[None, :])
        cp.commit_group()
        cp.wait_group(STAGES - 2)
        _barrier()
        # tile i's dots (its converted keys in cvt[i % 2]) and tile i+1's conversion, no barrier between
        if DIRECT:
            r = raw.index(i % STAGES)
            k = cvt.index(0)
            s = mma_v2(q_smem.index(0).load(QL), _cvt_regs(r.slice(0, 128, dim=1).permute([1, 0]).load(B_OP4)), gl.zeros([16, BLOCK_N], gl.float32, MMA))
            s = mma_v2(q_smem.index(1).load(QL), _cvt_regs(r.slice(128, 128, dim=1).permute([1, 0]).load(B_OP4)), s)
            s = mma_v2(q_smem.index(2).load(QL), _cvt_regs(r.slice(256, 128, dim=1).permute([1, 0]).load(B_OP4)), s)
            s = mma_v2(q_smem.index(3).load(QL), _cvt_regs(r.slice(384, 128, dim=1).permute([1, 0]).load(B_OP4)), s)
            _convert(r, k, RAW_L)
        else:
            k = cvt.index(i % 2)
            s = mma_v2(q_smem.index(0).load(QL), k.slice(0, 128, dim=1).permute([1, 0]).load(B_OP), gl.zeros([16, BLOCK_N], gl.float32, MMA))
            s = mma_v2(q_smem.index(1).load(QL), k.slice(128, 128, dim=1).permute([1, 0]).load(B_OP), s)
            s = mma_v2(q_smem.index(2).load(QL), k.slice(256, 128, dim=1).permute([1, 0]).load(B_OP), s)
            s = mma_v2(q_smem.index(3).load(QL), k.slice(384, 128, dim=1).permute([1, 0]).load(B_OP), s)
            _convert(raw.index((i + 1) % STAGES), cvt.index((i + 1) % 2), RAW_L)
        m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_pv(s * qk_scale, m_i, l_i, acc0, acc1, acc2, acc3,
                                                      p_smem, k, A_OP, B_OP)
    cp.wait_group(0)
    ho = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    do = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    o = OUT + tok * (16 * 512) + ho[:, None] * 512 + do[None, :]
    inv = 1.0 / l_i
    gl.store(o, (acc0 * inv[:, None]).to(gl.bfloat16))
    gl.store(o + 128, (acc1 * inv[:, None]).to(gl.bfloat16))
    gl.store(o + 256, (acc2 * inv[:, None]).to(gl.bfloat16))
    gl.store(o + 384, (acc3 * inv[:, None]).to(gl.bfloat16))


def _compile(fn, cap: int, signature: dict, constexprs: dict, aligned, maxnreg: int | None = None,
             num_warps: int = 4) -> dict:
    """fn compiled for sm_<cap> (ptxas's .maxnreg if given): shared bytes, registers, spill stack,
    instruction counts."""
    names = list(fn.arg_names)
    sig = {**signature, **{n: "constexpr" for n in (*constexprs, "num_warps")}}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = gluon._runtime.GluonASTSource(fn=fn, signature=sig, constexprs={**constexprs, "num_warps": num_warps},
                                        attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                              options={"num_warps": num_warps, "maxnreg": maxnreg})
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as t:
        Path(t, "k.cubin").write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", f"{t}/k.cubin"], capture_output=True, text=True).stdout
        res = subprocess.run([str(cuobjdump), "-res-usage", f"{t}/k.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))
    reg = re.search(r"REG:([0-9]+)", res)
    stack = re.search(r"STACK:([0-9]+)", res)
    return {"shared": int(compiled.metadata.shared), "registers": int(reg.group(1)) if reg else None,
            "stack": int(stack.group(1)) if stack else 0, "ops": {o: ops[o] for o in OPS}}


def compile_variant(cap: int, block_n: int, stages: int, direct: bool) -> dict:
    sig = {"Q": "*bf16", "KV": "*u8", "IDX": "*i32", "OUT": "*bf16", "topk": "i32", "qk_scale": "fp32"}
    return _compile(probe_kernel, cap, sig, {"BLOCK_N": block_n, "STAGES": stages, "DIRECT": direct},
                    ("Q", "KV", "IDX", "OUT"))


# ------------------------------------------------------------------------------------------
# The prototype ("direct"), whole: RoPE, the four per-128 scales, invalid indices, the LSE.
# Unsplit (one program = one token x 16 heads over all its topk indices), for s_q >= 64.
# ------------------------------------------------------------------------------------------



@gluon.jit
def _qk_group(q_g, raw_g, zero, A4: gl.constexpr, B4: gl.constexpr):
    """q_g . x_g for one group of 128 dims: the raw bytes straight into the B-operand layout
    (k_width 4), converted in registers (x * 2^-120)."""
    kb = gl.inline_asm_elementwise(PTX, "=r,=r,r", [raw_g.permute([1, 0]).load(B4)], dtype=gl.bfloat16,
                                   is_pure=True, pack=4)
    return mma_v2(q_g.load(A4), kb, zero)


@gluon.jit
def _pv_pairs(pa, pairs, acc_even, acc_odd, alpha, B2: gl.constexpr):
    """P_g . x_g for one group of 128 dims read as 64 16-bit pairs [BLOCK_N, 64]: the even dims
    into acc_even, the odd ones into acc_odd (PAIR_SPLIT)."""
    v = pairs.load(B2)
    even, odd = gl.inline_asm_elementwise(PAIR_SPLIT, "=r,=r,r", [v], dtype=(gl.bfloat16, gl.bfloat16),
                                          is_pure=True, pack=2)
    acc_even = mma_v2(pa, even, acc_even * alpha[:, None])
    acc_odd = mma_v2(pa, odd, acc_odd * alpha[:, None])
    return acc_even, acc_odd


@gluon.jit
def _issue_gather(raw, rope, t, n_tiles, idx_raw, idx_rope, n_slots, KV, KVH,
                  STAGES: gl.constexpr, RAW_L: gl.constexpr, ROPE_L: gl.constexpr):
    """cp.async of tile t's rows into ring slot t % STAGES: the 512 fp8 bytes and the 64 RoPE
    bf16 values of each key (invalid keys and tiles past the end: zero-filled, nothing read)."""
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, RAW_L))
    ok = (idx_raw >= 0) & (idx_raw < n_slots) & (t < n_tiles)
    ptr = KV + idx_raw.to(gl.int64)[:, None] * 656 + cols[None, :]
    cp.async_copy_global_to_shared(raw.index(t % STAGES), ptr, mask=ok[:, None])
    rcols = gl.arange(0, 64, layout=gl.SliceLayout(0, ROPE_L))
    rok = (idx_rope >= 0) & (idx_rope < n_slots) & (t < n_tiles)
    rptr = KVH + idx_rope.to(gl.int64)[:, None] * 328 + 264 + rcols[None, :]
    cp.async_copy_global_to_shared(rope.index(t % STAGES), rptr, mask=rok[:, None])
    cp.commit_group()


@gluon.jit
def gluon_fp8_sparse_mla(Q, Q_ROPE, KV, KVH, KVF, IDX, OUT, LSE, n_slots, h_q, topk, n_head_blocks,
                         qk_scale_log2,
                         stride_q_tok, stride_q_head, stride_qr_tok, stride_qr_head, stride_idx_tok,
                         stride_out_tok, stride_out_head,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, BLOCK_H: gl.constexpr,
                         num_warps: gl.constexpr, PAD_KB: gl.constexpr = 0):
    # BLOCK_H heads a program (16 or 32) over num_warps = 4 x BLOCK_H / 16 warps: 4 warps along
    # the keys (Q.K) and the output dims (P.V), BLOCK_H / 16 along the heads; a 32-head block
    # gathers each key once for its 32 heads
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 4, 4],
                                                  instr_shape=[16, 8])
    A2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    A4: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B4: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    RAW_L: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [num_warps, 1], [1, 0])
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    SWZ: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)

    pid = gl.program_id(0)
    if PAD_KB > 0:
        pad = reserve_shared(PAD_KB, num_warps)
    head_block = pid % n_head_blocks
    tok = (pid // n_head_blocks).to(gl.int64)

    # q: the latent part times 2^100 (the keys arrive as x * 2^-120), RoPE as is, in shared memory
    hq = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_L))
    dq = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
    hmask = (hq < h_q)[:, None]
    q_base = Q + tok * stride_q_tok + hq.to(gl.int64)[:, None] * stride_q_head + dq[None, :]
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], SWZ)
    for g in gl.static_range(4):
        qg = gl.load(q_base + g * 128, mask=hmask, other=0.0).to(gl.float32) * 1.2676506002282294e30
        q_smem.index(g).store(qg.to(gl.bfloat16))
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, Q_L))
    qr = gl.load(Q_ROPE + tok * stride_qr_tok + hq.to(gl.int64)[:, None] * stride_qr_head + dr[None, :],
                 mask=hmask, other=0.0)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], SWZ)
    qr_smem.store(qr)

    # the ring, swizzled in 16-byte chunks (the Q.K operand loads read 4 bytes of 8 keys at once);
    # P.V reads it too, as 16-bit pairs with the same swizzle. P once per scale group.
    RAW_S: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    PAIRS_S: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    raw = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], RAW_S)
    rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SWZ)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, BLOCK_N], SWZ)

    idx_base = IDX + tok * stride_idx_tok
    n_tiles = topk // BLOCK_N
    r_raw = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, RAW_L))
    r_rope = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
    for t in gl.static_range(STAGES - 1):
        _issue_gather(raw, rope, t, n_tiles, gl.load(idx_base + t * BLOCK_N + r_raw, mask=t < n_tiles, other=-1),
                      gl.load(idx_base + t * BLOCK_N + r_rope, mask=t < n_tiles, other=-1), n_slots, KV, KVH,
                      STAGES, RAW_L, ROPE_L)
    nt = STAGES - 1
    nxt_raw = gl.load(idx_base + nt * BLOCK_N + r_raw, mask=nt < n_tiles, other=-1)
    nxt_rope = gl.load(idx_base + nt * BLOCK_N + r_rope, mask=nt < n_tiles, other=-1)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
    # acc0-3: the even dims of each group of 128, acc4-7: the odd ones (_pv_pairs)
    acc0 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc1 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc2 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc3 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc4 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc5 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc6 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    acc7 = gl.zeros([BLOCK_H, 64], gl.float32, layout=MMA)
    kc = gl.arange(0, BLOCK_N, layout=COL)
    for i in range(n_tiles):
        cp.wait_group(STAGES - 2)
        _barrier()  # tile i landed; every warp is past tile i-1 (its ring slot and p_smem are free)
        _issue_gather(raw, rope, i + STAGES - 1, n_tiles, nxt_raw, nxt_rope, n_slots, KV, KVH, STAGES, RAW_L, ROPE_L)
        ahead = i + STAGES
        nxt_raw = gl.load(idx_base + ahead * BLOCK_N + r_raw, mask=ahead < n_tiles, other=-1)
        nxt_rope = gl.load(idx_base + ahead * BLOCK_N + r_rope, mask=ahead < n_tiles, other=-1)

        slot = i % STAGES
        r = raw.index(slot)
        idx_c = gl.load(idx_base + i * BLOCK_N + kc)
        ok_c = (idx_c >= 0) & (idx_c < n_slots)
        sc_c = KVF + idx_c.to(gl.int64) * 164 + 128

        # Q.K: each group's partial logits times its scale (and the 2^20 left by q * 2^100 * x * 2^-120)
        zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
        s = mma_v2(qr_smem.load(A2), rope.index(slot).permute([1, 0]).load(B2), zero)
        sc0 = gl.load(sc_c + 0, mask=ok_c, other=0.0) * 1048576.0
        sc1 = gl.load(sc_c + 1, mask=ok_c, other=0.0) * 1048576.0
        sc2 = gl.load(sc_c + 2, mask=ok_c, other=0.0) * 1048576.0
        sc3 = gl.load(sc_c + 3, mask=ok_c, other=0.0) * 1048576.0
        s = s + _qk_group(q_smem.index(0), r.slice(0, 128, dim=1), zero, A4, B4) * sc0[None, :]
        s = s + _qk_group(q_smem.index(1), r.slice(128, 128, dim=1), zero, A4, B4) * sc1[None, :]
        s = s + _qk_group(q_smem.index(2), r.slice(256, 128, dim=1), zero, A4, B4) * sc2[None, :]
        s = s + _qk_group(q_smem.index(3), r.slice(384, 128, dim=1), zero, A4, B4) * sc3[None, :]
        s = gl.where(ok_c[None, :], s * qk_scale_log2, float("-inf"))

        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i)
        # P.V: P_g = p * scale_g * 2^100 (the scales carry 2^20 already), x_g straight from the
        # ring as x * 2^-120: the accumulators hold 2^-20 times the output
        p_smem.index(0).store((p * (sc0 * 1.2089258196146292e24)[None, :]).to(gl.bfloat16))
        p_smem.index(1).store((p * (sc1 * 1.2089258196146292e24)[None, :]).to(gl.bfloat16))
        p_smem.index(2).store((p * (sc2 * 1.2089258196146292e24)[None, :]).to(gl.bfloat16))
        p_smem.index(3).store((p * (sc3 * 1.2089258196146292e24)[None, :]).to(gl.bfloat16))
        _barrier()
        pairs = r._reinterpret(gl.int16, [BLOCK_N, 256], PAIRS_S)
        acc0, acc4 = _pv_pairs(p_smem.index(0).load(A2), pairs.slice(0, 64, dim=1), acc0, acc4, alpha, B2)
        acc1, acc5 = _pv_pairs(p_smem.index(1).load(A2), pairs.slice(64, 64, dim=1), acc1, acc5, alpha, B2)
        acc2, acc6 = _pv_pairs(p_smem.index(2).load(A2), pairs.slice(128, 64, dim=1), acc2, acc6, alpha, B2)
        acc3, acc7 = _pv_pairs(p_smem.index(3).load(A2), pairs.slice(192, 64, dim=1), acc3, acc7, alpha, B2)
    cp.wait_group(0)

    empty = l_i == 0.0
    inv = gl.where(empty, 0.0, 1048576.0 / gl.where(empty, 1.0, l_i))[:, None]  # 2^20: see P.V
    ho = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
    omask = (ho < h_q)[:, None]
    do = 2 * gl.arange(0, 64, layout=COL)
    o = OUT + tok * stride_out_tok + ho.to(gl.int64)[:, None] * stride_out_head + do[None, :]
    gl.store(o, (acc0 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 128, (acc1 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 256, (acc2 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 384, (acc3 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 1, (acc4 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 129, (acc5 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 257, (acc6 * inv).to(gl.bfloat16), mask=omask)
    gl.store(o + 385, (acc7 * inv).to(gl.bfloat16), mask=omask)
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if PAD_KB > 0:
        lse = lse + shared_kept(pad, num_warps)
    gl.store(LSE + tok * h_q + ho, lse, mask=ho < h_q)


def compile_grouped(cap: int, block_n: int = 32, stages: int = 2, maxnreg: int | None = None,
                    partial: bool = False, trim: bool = False) -> dict:
    """The launcher's Gluon kernel (mlafleet/kernels/sparse_mla_gluon.py) at other ring depths."""
    from tests.kernels.sm120 import gluon_specs  # its launches, as the sm_120 test compiles them

    spec = next(sp for sp in gluon_specs(dataclasses.replace(sm.GLUON_FP8, block_n=block_n, num_stages=stages))
                if sp["constexprs"]["PARTIAL"] == partial and sp["constexprs"]["TRIM_TAIL"] == trim)
    return _compile(spec["fn"], cap, spec["signature"], spec["constexprs"], spec["aligned"], maxnreg)


def gluon_fp8_fwd(q, cache, idx, sm_scale, block_n=32, stages=2, block_h=16, grouped=False, pad_kb=0):
    """out [s_q, h_q, 512] bf16, lse [s_q, h_q] for q [s_q, h_q, 576] bf16 over the fp8_ds_mla
    rows `cache` (uint8, contiguous rows of 656 bytes) at idx [s_q, 1, topk] int32. grouped: the
    launcher's Gluon kernel through the launcher (its splits and merge where the grid is small),
    each launch holding pad_kb more of shared memory if given (--sm120-occupancy); the prototype
    does not split."""
    import torch

    s_q, h_q, _ = q.shape
    topk = idx.shape[-1]
    assert topk % block_n == 0 and q.stride(-1) == 1 and cache.is_contiguous()
    assert block_h == 16 or not grouped
    rows = cache.reshape(-1, 656)
    if grouped:
        cfg = dataclasses.replace(sm.GLUON_FP8, block_n=block_n, num_stages=stages)
        launch = glu.launch
        if pad_kb:  # the launcher's launches, each with pad_kb of shared memory held (--sm120-occupancy)
            glu.launch = functools.partial(launch, pad_kb=pad_kb)
        try:
            return sm.sparse_mla_fwd_fp8(q, rows, idx, sm_scale, config=cfg)
        finally:
            glu.launch = launch
    out = q.new_empty((s_q, h_q, 512))
    lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    hb = (h_q + block_h - 1) // block_h
    gluon_fp8_sparse_mla[(s_q * hb,)](q[..., :512], q[..., 512:], rows, rows.view(torch.bfloat16),
                                      rows.view(torch.float32), idx, out, lse, rows.shape[0], h_q, topk, hb,
                                      sm_scale * sm.LOG2E, q.stride(0), q.stride(1), q.stride(0), q.stride(1),
                                      idx.stride(0), out.stride(0), out.stride(1),
                                      BLOCK_N=block_n, STAGES=stages, BLOCK_H=block_h,
                                      num_warps=4 * block_h // 16, PAD_KB=pad_kb)
    return out, lse


def _label(v: dict) -> str:
    return (("grouped, " if v.get("grouped") else "") + f"h{v.get('block_h', 16)}, {v.get('stages', 2)} stages"
            + (f", +{v['pad_kb']} KB" if v.get("pad_kb") else ""))


# the variants --run times: the prototype (16 heads a program) with 2 and 3 ring stages, the grouped
# kernel with 2-4 (the 32-head prototype, BLOCK_H=32, was timed in the seventh pass and is slower)
RUN_VARIANTS = [{"stages": 2}, {"stages": 3}, {"stages": 2, "grouped": True}, {"stages": 3, "grouped": True},
                {"stages": 4, "grouped": True}]
# --run --small: the grouped kernel where it splits (s_q x head blocks under the SM count), beside the
# prototype at 2 stages (unsplit)
SMALL_VARIANTS = [{"stages": 2}, {"stages": 2, "grouped": True}, {"stages": 4, "grouped": True}]
# --run --sm120-occupancy: each at the programs an SM that sm_120's 99 KB allows (one for the
# prototype's 64-84 KB and grouped's 90 KB, two for grouped's 49 KB), padded past 114 KB
# (one program an H200 SM) or 76 KB (two); the Triton launcher's kernels (bf16 and fp8, 94 KB on
# sm_120: one program an SM) are pinned to 116 KB at launch (_pin_shared)
SM120_OCCUPANCY_VARIANTS = [{"stages": 2, "pad_kb": 64}, {"stages": 3, "pad_kb": 32},
                            {"stages": 2, "grouped": True, "pad_kb": 32},
                            {"stages": 4, "grouped": True, "pad_kb": 32}]


def _pin_shared(jit_fn, at_least: int) -> list[tuple[int, int]]:
    """Every kernel jit_fn has compiled so far asks for at least `at_least` bytes of shared memory
    at launch (reloaded with that much): the Triton launcher timed at sm_120's occupancy on the
    H200. Returns (before, after) per kernel."""
    changed = []
    for kernels, *_ in jit_fn.device_caches.values():
        for ck in kernels.values():
            old = ck.metadata.shared
            if old < at_least:
                ck.metadata = ck.metadata._replace(shared=at_least)
                ck.packed_metadata = (ck.metadata.num_warps, ck.metadata.num_ctas, at_least)
                ck.module = None  # reloaded at the next launch, with the larger dynamic shared memory
                changed.append((old, at_least))
    return changed


def run_on_gpu(variants, pin_triton_shared: int = 0,
               shapes=((256, 8), (4096, 8), (4096, 16), (256, 32), (4096, 32), (4096, 64))) -> None:
    """Correctness against the float32 reference and our Triton launcher, then CUDA-graph timing
    of each variant against the launcher at `shapes` (one process; 2M-slot cache, topk 2048)."""
    import sys as _sys
    import torch

    _sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_timing import time_graph

    from tests.kernels import oracles  # the float32 reference and the fp8 cache writer

    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    scale = 576 ** -0.5
    s_kv, topk = 2_000_000, 2048
    kv = (torch.randn((s_kv, 576), device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    cache = oracles.quantize_fp8_ds_mla(kv)
    kv = kv.view(s_kv, 1, 576)  # for the bf16 launcher's time beside it (issue 16: fp8 <= 0.7x of it)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}")
    # correctness: 4 tokens, invalid and out-of-range indices, a row with nothing valid
    for h_q in (8, 16, 32):
        q = torch.randn((4, h_q, 576), device=dev, generator=gen).to(torch.bfloat16)
        idx = torch.randint(0, s_kv, (4, 1, topk), device=dev, dtype=torch.int32, generator=gen)
        idx[:, :, 5::17] = -1
        idx[:, :, 7::29] = s_kv + 3
        idx[-1] = -1
        ref_o, ref_l = oracles.reference_sparse_mla_fp8(q, cache, idx, scale)
        for v in variants:
            o, lse = gluon_fp8_fwd(q, cache, idx, scale, **v)
            err = ((o.float() - ref_o).norm(dim=-1) / ref_o.norm(dim=-1).clamp_min(1e-6))[:3].max().item()
            empty_ok = bool((o[-1] == 0).all()) and bool(torch.isinf(lse[-1]).all())
            lse_err = (lse[:3] - ref_l[:3]).abs().max().item()
            print(f"check h_q {h_q} {_label(v)}: worst row error {err:.2e}, lse error {lse_err:.1e}, empty row {empty_ok}")
    print("| s_q x h_q | ours (Triton launcher) us | "
          + " | ".join(f"Gluon, {_label(v)} us" for v in variants)
          + " | best / launcher | Triton bf16 us | best / bf16 | best % of 4268 GB/s |")
    print("|---|---:|" + "---:|" * len(variants) + "---:|---:|---:|---:|")
    for s_q, h_q in shapes:
        sets = max(1, min(64, 2048 // s_q))  # rows past the L2 at s_q >= 32; at most 64 calls a replay
        qs = [torch.randn((s_q, h_q, 576), device=dev, generator=gen).to(torch.bfloat16) for _ in range(sets)]
        ids = [torch.randint(0, s_kv, (s_q, 1, topk), device=dev, dtype=torch.int32, generator=gen) for _ in range(sets)]
        if pin_triton_shared:
            sm.sparse_mla_fwd_fp8(qs[0], cache, ids[0], scale)  # compiled, then pinned to one program an SM
            sm.sparse_mla_fwd(qs[0], kv, ids[0], scale)
            print(f"{s_q} x {h_q}: Triton kernels' shared memory pinned (before, after): "
                  f"{_pin_shared(sm._sparse_mla_kernel, pin_triton_shared)}", flush=True)
        ours = time_graph([lambda q=q, i=i: sm.sparse_mla_fwd_fp8(q, cache, i, scale) for q, i in zip(qs, ids)], 10)
        bf16 = time_graph([lambda q=q, i=i: sm.sparse_mla_fwd(q, kv, i, scale) for q, i in zip(qs, ids)], 10)
        row, agree = [], []
        for v in variants:
            row.append(time_graph([lambda q=q, i=i: gluon_fp8_fwd(q, cache, i, scale, **v)
                                   for q, i in zip(qs, ids)], 10))
            o1 = gluon_fp8_fwd(qs[0], cache, ids[0], scale, **v)[0].float()
            o2 = sm.sparse_mla_fwd_fp8(qs[0], cache, ids[0], scale)[0].float()
            agree.append(((o1 - o2).norm(dim=-1) / o2.norm(dim=-1)).max().item() < 1e-2)
        row = [t if ok else float("inf") for t, ok in zip(row, agree)]  # a variant that disagrees is not timed
        best = min(row)
        gbps = s_q * topk * 656 / best / 1e9
        print(f"| {s_q} x {h_q} | {ours * 1e6:.1f} | " + " | ".join(f"{t * 1e6:.1f}" for t in row)
              + f" | {best / ours:.2f} | {bf16 * 1e6:.1f} | {best / bf16:.2f} | {gbps / 42.68:.0f}% |", flush=True)


OPS = ("HMMA", "LDSM", "LDS", "STS", "LDGSTS", "BAR")


# both prototypes' arguments, as compiled offline (pointers 16-byte aligned)
_KERNEL_PTRS = ("Q", "Q_ROPE", "KV", "KVH", "KVF", "IDX", "OUT", "LSE")
_KERNEL_SIG = {**dict(zip(_KERNEL_PTRS, ("*bf16", "*bf16", "*u8", "*bf16", "*fp32", "*i32", "*bf16", "*fp32"))),
               **{n: "i32" for n in ("n_slots", "h_q", "topk", "n_head_blocks", "stride_q_tok", "stride_q_head",
                                     "stride_qr_tok", "stride_qr_head", "stride_idx_tok", "stride_out_tok",
                                     "stride_out_head")},
               "qk_scale_log2": "fp32"}


def compile_prototype(cap: int, block_n: int, stages: int, block_h: int = 16, maxnreg: int | None = None) -> dict:
    return _compile(gluon_fp8_sparse_mla, cap, _KERNEL_SIG,
                    {"BLOCK_N": block_n, "STAGES": stages, "BLOCK_H": block_h, "PAD_KB": 0},
                    _KERNEL_PTRS, maxnreg, num_warps=4 * block_h // 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, action="append", help="compute capability x 10 (default: 120)")
    parser.add_argument("--run", action="store_true", help="on a GPU: the prototype's correctness and timing "
                        "against the Triton launcher (needs mlafleet on PYTHONPATH)")
    parser.add_argument("--small", action="store_true",
                        help="with --run: decode and small batches (the grouped kernel split)")
    parser.add_argument("--sm120-occupancy", action="store_true",
                        help="with --run: time the prototypes at the programs an SM that sm_120 allows")
    args = parser.parse_args()
    if args.run:
        small = ((1, 8), (8, 8), (64, 8), (64, 16), (64, 32), (256, 8))
        if args.small and args.sm120_occupancy:  # the grouped kernel split, at sm_120's programs an SM
            run_on_gpu([{"stages": 2, "grouped": True, "pad_kb": 32}], pin_triton_shared=116 * 1024, shapes=small)
        elif args.small:
            run_on_gpu(SMALL_VARIANTS, shapes=small)
        elif args.sm120_occupancy:  # the Triton kernels (bf16 and fp8: 94 KB, one program an sm_120 SM) too
            run_on_gpu(SM120_OCCUPANCY_VARIANTS, pin_triton_shared=116 * 1024)
        else:
            run_on_gpu(RUN_VARIANTS)
        return
    print("| target | variant | BLOCK_N | raw stages | shared bytes | fits 101376 | registers | stack (spills) | "
          + " | ".join(OPS) + " |")
    print("|---|---|---:|---:|---:|---|---:|---:|" + "---:|" * len(OPS))
    for cap in args.cap or [120]:
        maxnreg = 255 if cap >= 120 else None  # as the launcher compiles for SM12x (one program an SM)
        for variant, block_n, stages in (("staged", 32, 3), ("direct", 32, 3), ("direct", 32, 2),
                                         ("prototype h16", 32, 2), ("prototype h16", 32, 3),
                                         ("prototype h32", 32, 2), ("prototype h32", 32, 3),
                                         ("grouped", 32, 2), ("grouped", 32, 3), ("grouped", 32, 4)):
            if variant.startswith("prototype"):
                r = compile_prototype(cap, block_n, stages, int(variant[-2:]), maxnreg)
            elif variant == "grouped":
                r = compile_grouped(cap, block_n, stages, maxnreg)
            else:
                r = compile_variant(cap, block_n, stages, variant == "direct")
            print(f"| sm_{cap} | {variant} | {block_n} | {stages} | {r['shared']} | "
                  f"{'yes' if r['shared'] <= 101376 else 'no'} | {r['registers']} | {r['stack']} | "
                  + " | ".join(str(r["ops"][o]) for o in OPS) + " |", flush=True)


if __name__ == "__main__":
    main()
