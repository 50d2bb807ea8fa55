"""Sparse MLA attention (DeepSeek Sparse Attention) for vLLM's TRITON_MLA_SPARSE backend.

The contract is the one of vLLM 0.20.2's FlashMLA sparse calls (DESIGN.md section 4):

    q        [s_q, h_q, 576] bf16 (any strides)
    kv       [s_kv, 1, 576] bf16, or the fp8_ds_mla cache: uint8 [num_blocks, 64, 1, 656],
             or a plain fp8 cache: float8_e4m3fn (or its uint8 bytes) [s_kv, 1, 576] with one
             float32 scale for the whole cache (x = fp8 * kv_scale; vLLM's `fp8` MLA cache)
    indices  [s_q, 1, topk] int32 global slot ids; -1 or >= s_kv means "no token"
    out      [s_q, h_q, 512] bf16 = softmax(q . K[idx]^T * sm_scale) @ K[idx][:, :512]
    lse      [s_q, h_q] float32, natural log; +inf (and out 0) for a row with no valid index

fp8_ds_mla: 656 bytes per token. Bytes 0-511: 512 float8_e4m3 values; 512-527: four
float32 scales, one per 128 values (x = fp8 * scale); 528-655: the 64 bf16 RoPE values.

This module holds the Triton kernels with their launcher, the public entry points
sparse_mla_fwd / sparse_mla_fwd_fp8 / sparse_mla_fwd_fp8_e4m3, and the layouts of vLLM's KV cache
by kv_cache_dtype with `attend` over each (what the backends call). The tests' ground truth, the
float32 references and the fp8 cache writers, is tests/kernels/oracles.py. It imports only torch and
triton; on SM12x the launcher also runs the Gluon fp8_ds_mla kernel of sparse_mla_gluon.py
(imported on its first use there).

On a CUDA GPU the kernels are compiled; with TRITON_INTERPRET=1 set before triton is imported
the Triton kernels run on CPU tensors in Triton's interpreter (the CI tests). Every config the launcher can
choose fits SM120 (tests/kernels/test_sparse_mla_sm120.py compiles each for sm_120).
Benchmark against FlashMLA: bench/sparse_mla.py, results in docs/perf-kernels.md.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

D_NOPE = 512  # latent part of a token: the value vector
D_ROPE = 64  # RoPE part, only in the key
D_QK = D_NOPE + D_ROPE  # 576
FP8_GROUP = 128  # values per fp8 scale
FP8_GROUPS = D_NOPE // FP8_GROUP  # 4
FP8_TOKEN_BYTES = D_NOPE + 4 * FP8_GROUPS + 2 * D_ROPE  # 656
FP8_SCALE_OFFSET = D_NOPE  # 512
FP8_ROPE_OFFSET = D_NOPE + 4 * FP8_GROUPS  # 528
FP8_BLOCK_SIZE = 64  # tokens per cache block for fp8_ds_mla
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2
TRIM_SCAN = tl.constexpr(256)  # indices per step of the kernel's last-valid-index pass (TRIM_TAIL)


# --------------------------------------------------------------------------------------
# input checks (clear errors, before anything is launched)
# --------------------------------------------------------------------------------------

Query = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _query_halves(q: Query) -> tuple[torch.Tensor, torch.Tensor]:
    """q as its latent [s_q, h_q, 512] and RoPE [s_q, h_q, 64] halves (views, any strides): one
    [s_q, h_q, 576] tensor, or the two halves as vLLM's MLA layer hands them over (the kernel
    reads them where they are, so nothing is concatenated)."""
    if isinstance(q, torch.Tensor):
        if q.dim() != 3 or q.shape[-1] != D_QK:
            raise ValueError(f"sparse MLA: q must be [s_q, h_q, {D_QK}], got {tuple(q.shape)}")
        return q[..., :D_NOPE], q[..., D_NOPE:]
    if not (isinstance(q, (tuple, list)) and len(q) == 2 and all(isinstance(t, torch.Tensor) for t in q)):
        raise TypeError(f"sparse MLA: q must be a tensor or a (latent, rope) pair of tensors, got {type(q).__name__}")
    latent, rope = q
    if latent.dim() != 3 or latent.shape[-1] != D_NOPE:
        raise ValueError(f"sparse MLA: latent q must be [s_q, h_q, {D_NOPE}], got {tuple(latent.shape)}")
    if rope.shape != (*latent.shape[:2], D_QK - D_NOPE):
        raise ValueError(f"sparse MLA: RoPE q must be [{latent.shape[0]}, {latent.shape[1]}, {D_QK - D_NOPE}] "
                         f"beside latent q {tuple(latent.shape)}, got {tuple(rope.shape)}")
    if rope.dtype != latent.dtype or rope.device != latent.device:
        raise ValueError(f"sparse MLA: q's halves differ: latent {latent.dtype} on {latent.device}, "
                         f"RoPE {rope.dtype} on {rope.device}")
    return latent, rope


def _check_common(q: torch.Tensor, indices: torch.Tensor, d_v: int) -> None:
    """q: the latent half (_query_halves has checked the pair)."""
    if d_v != D_NOPE:
        raise ValueError(f"sparse MLA: d_v must be {D_NOPE}, got {d_v}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"sparse MLA: q must be bfloat16, got {q.dtype}")
    if indices.dim() != 3 or indices.shape[0] != q.shape[0] or indices.shape[1] != 1:
        raise ValueError(f"sparse MLA: indices must be [s_q={q.shape[0]}, 1, topk], "
                         f"got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(f"sparse MLA: indices must be int32, got {indices.dtype}")
    if indices.shape[2] < 1:
        raise ValueError("sparse MLA: topk must be at least 1")
    if indices.device != q.device:
        raise ValueError(f"sparse MLA: indices on {indices.device}, q on {q.device}")


def _check_bf16_kv(kv: torch.Tensor, q: torch.Tensor) -> None:
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != D_QK:
        raise ValueError(f"sparse MLA: kv must be [s_kv, 1, {D_QK}], got {tuple(kv.shape)}")
    if kv.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"sparse MLA: kv must be bfloat16, got {kv.dtype}")
    if kv.device != q.device:
        raise ValueError(f"sparse MLA: kv on {kv.device}, q on {q.device}")


def _fp8_rows(kv_cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The fp8_ds_mla cache as a [slots, 656] uint8 view (rows may be strided)."""
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"sparse MLA fp8: kv_cache must be uint8 (fp8_ds_mla), got {kv_cache.dtype}")
    if kv_cache.shape[-1] != FP8_TOKEN_BYTES:
        raise ValueError(f"sparse MLA fp8: kv_cache last dim must be {FP8_TOKEN_BYTES} bytes, "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.dim() == 4:
        if kv_cache.shape[1] != FP8_BLOCK_SIZE or kv_cache.shape[2] != 1:
            raise ValueError(f"sparse MLA fp8: kv_cache must be [num_blocks, {FP8_BLOCK_SIZE}, 1, "
                             f"{FP8_TOKEN_BYTES}], got {tuple(kv_cache.shape)}")
    elif kv_cache.dim() not in (2, 3):
        raise ValueError(f"sparse MLA fp8: kv_cache must be [num_blocks, 64, 1, 656], "
                         f"[num_blocks, 64, 656] or [slots, 656], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("sparse MLA fp8: the 656 bytes of a token must be contiguous")
    if kv_cache.device != q.device:
        raise ValueError(f"sparse MLA fp8: kv_cache on {kv_cache.device}, q on {q.device}")
    rows = kv_cache.reshape(-1, FP8_TOKEN_BYTES)  # a view when the slots are evenly strided
    if rows.stride(0) % 4 != 0 or rows.data_ptr() % 4 != 0:
        raise ValueError("sparse MLA fp8: each token must start on a 4-byte boundary")
    return rows


# --------------------------------------------------------------------------------------
# Triton kernels
#
# One program = one query token x one block of heads x one slice ("split") of the token's
# topk indices. It gathers BLOCK_N keys at a time (64-bit row offsets, masked: an invalid
# index never reads the cache), computes the logits with tensor-core dots, and keeps an
# online softmax. With one split it writes the bf16 output and the LSE; with several it
# writes float32 partial outputs and partial LSEs, and _merge_splits_kernel combines them.
# The gathers carry no branch around them, so Triton's pipeliner stages them through shared
# memory with cp.async: with each tile's indices loaded in its own iteration, num_stages 5 keeps
# two tiles of keys in flight; with the next tile's indices prefetched (PREFETCH_IDX) the gathers
# get num_stages - 1 buffers. Still, with one program an SM (decode) an iteration costs about one
# index-then-row round trip (2 us on the H200), so decode runs one tile a program where the grid
# allows ("h16n16-decode").
# With PDL (SM90+) the split kernel waits for the kernel before it, then lets the merge launch.
#
# --------------------------------------------------------------------------------------

@triton.jit
def _load_keys(row, valid, FP8: tl.constexpr, ROPE_E4M3: tl.constexpr):
    """Gather BLOCK_N keys: 4 raw groups of 128 latent values, 4 fp8 scales (1.0 for bf16 and
    for a plain fp8 cache, whose one scale the kernel applies to the logits and the output),
    the 64 RoPE values (raw float8_e4m3 bytes for a plain fp8 cache). row: per key, a pointer
    to its first byte (fp8) or element (bf16); invalid keys read nothing."""
    cols = tl.arange(0, 128)
    d_rope = tl.arange(0, 64)
    m = valid[:, None]
    g0 = tl.load(row[:, None] + cols[None, :], mask=m, other=0)
    g1 = tl.load(row[:, None] + (128 + cols)[None, :], mask=m, other=0)
    g2 = tl.load(row[:, None] + (256 + cols)[None, :], mask=m, other=0)
    g3 = tl.load(row[:, None] + (384 + cols)[None, :], mask=m, other=0)
    if FP8 and ROPE_E4M3:
        s0 = tl.full(valid.shape, 1.0, tl.float32)
        s1 = s0
        s2 = s0
        s3 = s0
        rope = tl.load(row[:, None] + (512 + d_rope)[None, :], mask=m, other=0)
    elif FP8:
        scales = (row + 512).to(tl.pointer_type(tl.float32))
        s0 = tl.load(scales + 0, mask=valid, other=0.0)
        s1 = tl.load(scales + 1, mask=valid, other=0.0)
        s2 = tl.load(scales + 2, mask=valid, other=0.0)
        s3 = tl.load(scales + 3, mask=valid, other=0.0)
        rope = tl.load((row + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + d_rope[None, :], mask=m, other=0.0)
    else:
        s0 = tl.full(valid.shape, 1.0, tl.float32)
        s1 = s0
        s2 = s0
        s3 = s0
        rope = tl.load(row[:, None] + (512 + d_rope)[None, :], mask=m, other=0.0)
    return g0, g1, g2, g3, s0, s1, s2, s3, rope


# The bit moves of _fp8_bits_as_bf16 for the 4 bytes of $2, into a0 (values 0, 1) and a1 (2, 3):
# prmt makes each byte b the 16-bit word (sign(b) x 8, b), the shift puts b's bits 6..0 at
# 10..4 and its sign at 15, the mask clears the rest.
_FP8_BITS_PTX = tl.constexpr("""
    .reg .b32 a<2>;
    prmt.b32 a0, $2, 0, 0x9180;
    prmt.b32 a1, $2, 0, 0xB3A2;
    shl.b32 a0, a0, 4;
    shl.b32 a1, a1, 4;
    and.b32 a0, a0, 0x87F087F0;
    and.b32 a1, a1, 0x87F087F0;
""")


@triton.jit
def _fp8_bits_as_bf16(raw, DOT_F32: tl.constexpr):
    """float8_e4m3 bytes (uint8) as bfloat16 values x * 2^-120, exactly, zero and subnormals
    included: the sign to bit 15, exponent and mantissa to bits 10..4 of a 16-bit word.

    Three integer instructions per two values (float conversions issue at a quarter of the
    integer rate), run once per key tile before its shared-memory staging. The inline asm is
    not marked pure on purpose: Triton then neither moves it behind that staging (where it
    would run once per dot, on byte loads) nor derives 8-bit operand layouts from it. The
    interpreter runs the same bit moves one element at a time."""
    if DOT_F32:
        x = raw.to(tl.uint16)
        return (((x & 0x7F) << 4) | ((x & 0x80) << 8)).to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            asm="{" + _FP8_BITS_PTX + "mov.b32 $0, a0;\nmov.b32 $1, a1;\n}",
            constraints="=r,=r,r", args=[raw], dtype=tl.bfloat16, is_pure=False, pack=4)


@triton.jit
def _fp8_bits_times_bf16(raw, factor, DOT_F32: tl.constexpr):
    """float8_e4m3 bytes (uint8 [n, 128]) times a bfloat16 factor per row ([n, 128] broadcast):
    the bit moves of _fp8_bits_as_bf16 (x * 2^-120, exact), then one bfloat16 multiply."""
    if DOT_F32:
        return _fp8_bits_as_bf16(raw, DOT_F32) * factor.to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            asm="{" + _FP8_BITS_PTX + "mul.rn.bf16x2 $0, a0, $3;\nmul.rn.bf16x2 $1, a1, $4;\n}",
            constraints="=r,=r,r,r,r", args=[raw, factor], dtype=tl.bfloat16, is_pure=False, pack=4)


@triton.jit
def _key_group(raw, scale, FP8: tl.constexpr, SCALE_LOGITS: tl.constexpr, DOT_F32: tl.constexpr):
    """A loaded group as a dot operand. bf16: as loaded. fp8_ds_mla with SCALE_LOGITS: the
    float8_e4m3 values times 2^-120 (_fp8_bits_as_bf16), unscaled: the group's scale goes
    onto the [heads x keys] logits and probabilities instead. Without: x * scale * 2^-60 in
    bfloat16 (_fp8_bits_times_bf16; q carries the 2^60), exact for power-of-two scales."""
    if FP8:
        if SCALE_LOGITS:
            return _fp8_bits_as_bf16(raw, DOT_F32)
        else:
            factor = (scale * 1.152921504606847e18).to(tl.bfloat16)  # scale * 2^60
            return _fp8_bits_times_bf16(raw, tl.broadcast_to(factor[:, None], raw.shape), DOT_F32)
    else:
        return raw.to(tl.float32 if DOT_F32 else tl.bfloat16)


@triton.jit
def _sparse_mla_kernel(
    Q, stride_q_tok, stride_q_head, stride_q_dim,  # the latent half of q: [s_q, h_q, 512]
    Q_ROPE, stride_qr_tok, stride_qr_head, stride_qr_dim,  # the RoPE half: [s_q, h_q, 64]
    KV, stride_kv_tok,  # bf16 cache: elements between tokens; fp8_ds_mla: bytes between tokens
    n_slots,
    IDX, stride_idx_tok, stride_idx_k,
    OUT, stride_out_tok, stride_out_split, stride_out_head,
    LSE, stride_lse_tok, stride_lse_split, stride_lse_head,
    h_q, topk, tokens_per_split, n_split, n_head_blocks,
    qk_scale_log2,  # sm_scale * log2(e): the softmax runs in base 2
    KV_SCALE,  # plain fp8 (ROPE_E4M3): the cache's one float32 scale; unread otherwise
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,  # KV is bytes: fp8_ds_mla, or with ROPE_E4M3 a plain float8_e4m3 cache
    ROPE_E4M3: tl.constexpr,  # plain fp8: all 576 values e4m3 (RoPE too), one scale in KV_SCALE
    PARTIAL: tl.constexpr,  # write float32 partials (several splits) instead of the final bf16
    SCALE_LOGITS: tl.constexpr,  # fp8: scale the logits and probabilities, not the keys
    DOT_F32: tl.constexpr,  # interpreter: bf16 tl.dot is wrong there, so dot in float32
    TRIM_TAIL: tl.constexpr,  # first find the split's last valid index, stop the key loop there
    LAZY_RESCALE: tl.constexpr = False,  # move the softmax's reference max only when it grows by 2^8
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (SM90+, _pdl)
    PREFETCH_IDX: tl.constexpr = False,  # load the next tile's indices while this tile's rows arrive
):
    # The 512 latent dims are handled as 4 groups of 128 (the fp8 scale groups): 4 key tiles,
    # 4 query tiles, 4 accumulators. The 64 RoPE dims only enter the logits.
    if PDL:
        gdc_wait()  # launched before the kernel ahead of this one (q's and the indices' producer) ended
    pid = tl.program_id(0)
    head_block = pid % n_head_blocks
    rest = pid // n_head_blocks
    split = rest % n_split
    tok = (rest // n_split).to(tl.int64)
    dot_dtype: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < h_q  # heads past h_q are neither read nor written
    d128 = tl.arange(0, 128)
    d_rope = tl.arange(0, 64)
    q_base = Q + tok * stride_q_tok + heads.to(tl.int64)[:, None] * stride_q_head
    q0 = tl.load(q_base + (0 + d128)[None, :] * stride_q_dim, mask=head_ok[:, None], other=0.0).to(dot_dtype)
    q1 = tl.load(q_base + (128 + d128)[None, :] * stride_q_dim, mask=head_ok[:, None], other=0.0).to(dot_dtype)
    q2 = tl.load(q_base + (256 + d128)[None, :] * stride_q_dim, mask=head_ok[:, None], other=0.0).to(dot_dtype)
    q3 = tl.load(q_base + (384 + d128)[None, :] * stride_q_dim, mask=head_ok[:, None], other=0.0).to(dot_dtype)
    q_rope = tl.load(Q_ROPE + tok * stride_qr_tok + heads.to(tl.int64)[:, None] * stride_qr_head
                     + d_rope[None, :] * stride_qr_dim, mask=head_ok[:, None], other=0.0).to(dot_dtype)
    if FP8:
        if SCALE_LOGITS:
            # keys arrive as x * 2^-120 (_key_group): q * 2^100 keeps every product q * x * 2^-20
            # a normal float32 and is exact in bf16 for |q| < 2^28; 2^20 goes into the scales
            q0 = q0 * 1.2676506002282294e30
            q1 = q1 * 1.2676506002282294e30
            q2 = q2 * 1.2676506002282294e30
            q3 = q3 * 1.2676506002282294e30
        else:
            # keys arrive as x * scale * 2^-60: q * 2^60 (exact in bf16 for |q| < 2^68)
            q0 = q0 * 1.152921504606847e18
            q1 = q1 * 1.152921504606847e18
            q2 = q2 * 1.152921504606847e18
            q3 = q3 * 1.152921504606847e18

    if ROPE_E4M3:
        # plain fp8: K = x * kv_scale for every key and dim, so the scale goes once onto the
        # logits (here) and once onto the output (at the end), and the keys stay x
        kv_scale = tl.load(KV_SCALE).to(tl.float32)
        qk_scale_log2 = qk_scale_log2 * kv_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the logits (base 2)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(logit - m_i)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, topk)
    idx_base = IDX + tok * stride_idx_tok
    span = tokens_per_split
    if TRIM_TAIL:
        # The indexer leaves a token with fewer candidates than topk (the first topk tokens of
        # a prompt, short contexts) its positions first and -1 after them: one cheap pass over
        # the split's indices finds the last valid one, and the key loop ends there instead of
        # gathering and multiplying masked-out blocks. Any layout stays exact (only entries
        # after the last valid one are skipped).
        last = start * 0 - 1
        for c in range(0, tokens_per_split, TRIM_SCAN):
            offs = start + c + tl.arange(0, TRIM_SCAN)
            idx = tl.load(idx_base + offs * stride_idx_k, mask=offs < end, other=-1)
            valid = (idx >= 0) & (idx < n_slots)
            last = tl.maximum(last, tl.max(tl.where(valid, c + tl.arange(0, TRIM_SCAN), -1), axis=0))
        span = last + 1
    if PREFETCH_IDX:
        offs = start + tl.arange(0, BLOCK_N)
        idx_next = tl.load(idx_base + offs * stride_idx_k, mask=offs < end, other=-1)
    for n0 in range(0, span, BLOCK_N):  # the last block may be partly past the split: masked
        if PREFETCH_IDX:
            # this tile's indices came with the previous tile's rows; the next tile's load goes
            # out before this tile's gather, so an iteration waits for one round trip, not two
            idx = idx_next
            offs = start + n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            idx_next = tl.load(idx_base + offs * stride_idx_k, mask=offs < end, other=-1)
        else:
            offs = start + n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(idx_base + offs * stride_idx_k, mask=offs < end, other=-1)
        valid = (idx >= 0) & (idx < n_slots)
        row = KV + tl.where(valid, idx, 0).to(tl.int64) * stride_kv_tok  # 64-bit: caches pass 2^31 B
        g0, g1, g2, g3, s0, s1, s2, s3, g_rope = _load_keys(row, valid, FP8, ROPE_E4M3)

        k0 = _key_group(g0, s0, FP8, SCALE_LOGITS, DOT_F32)
        k1 = _key_group(g1, s1, FP8, SCALE_LOGITS, DOT_F32)
        k2 = _key_group(g2, s2, FP8, SCALE_LOGITS, DOT_F32)
        k3 = _key_group(g3, s3, FP8, SCALE_LOGITS, DOT_F32)
        if ROPE_E4M3:
            # e4m3 bytes -> x * 2^-120 in bf16 -> x exactly (times 2^120 in float32); every
            # e4m3 value is a bf16 value
            k_rope = (_fp8_bits_as_bf16(g_rope, DOT_F32).to(tl.float32) * 1.329227995784916e36).to(dot_dtype)
        else:
            k_rope = g_rope.to(dot_dtype)
        logits = tl.dot(q_rope, tl.trans(k_rope))
        if FP8 and SCALE_LOGITS:
            # logit = q_rope . k_rope + sum_g scale_g * (q_g . x_g): the scales per key and
            # group on the [heads x keys] tile (times 2^20, see q0 above)
            s0 = s0 * 1048576.0
            s1 = s1 * 1048576.0
            s2 = s2 * 1048576.0
            s3 = s3 * 1048576.0
            logits += tl.dot(q0, tl.trans(k0)) * s0[None, :]
            logits += tl.dot(q1, tl.trans(k1)) * s1[None, :]
            logits += tl.dot(q2, tl.trans(k2)) * s2[None, :]
            logits += tl.dot(q3, tl.trans(k3)) * s3[None, :]
        else:
            logits = tl.dot(q0, tl.trans(k0), logits)
            logits = tl.dot(q1, tl.trans(k1), logits)
            logits = tl.dot(q2, tl.trans(k2), logits)
            logits = tl.dot(q3, tl.trans(k3), logits)
        logits = tl.where(valid[None, :], logits * qk_scale_log2, float("-inf"))
        if LAZY_RESCALE:
            # The reference max m_i moves (and the accumulators are rescaled) only in a tile
            # where some row's max passes it by more than 8 (base 2): otherwise the tile's
            # probabilities stay at most 2^8 relative to it, exact in float32 and as precise
            # in bfloat16, and the [heads x 512] rescale is skipped.
            m_tile = tl.max(logits, 1)
            if tl.max((m_tile > m_i + 8.0).to(tl.int32), 0) > 0:
                m_up = tl.maximum(m_i, m_tile)
                alpha = tl.where(m_i == float("-inf"), 1.0, tl.exp2(m_i - m_up))  # empty so far: acc is 0
                l_i = l_i * alpha
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                acc2 = acc2 * alpha[:, None]
                acc3 = acc3 * alpha[:, None]
                m_i = m_up
            m_new = m_i
            m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
        else:
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: avoid inf - inf
            alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(logits - m_ref[:, None])
        if not LAZY_RESCALE:  # (lazily: rescaled above, in the tiles that moved m_i)
            l_i = l_i * alpha
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
        l_i = l_i + tl.sum(p, 1)
        if FP8 and SCALE_LOGITS:
            # acc_g += sum_n p[n] * scale_g[n] * 2^100 * x_g[n] * 2^-120: 2^-20 times the
            # output (undone at the end); p times a power of two rounds as p does
            acc0 = tl.dot((p * (s0 * 1.2089258196146292e24)[None, :]).to(dot_dtype), k0, acc0)
            acc1 = tl.dot((p * (s1 * 1.2089258196146292e24)[None, :]).to(dot_dtype), k1, acc1)
            acc2 = tl.dot((p * (s2 * 1.2089258196146292e24)[None, :]).to(dot_dtype), k2, acc2)
            acc3 = tl.dot((p * (s3 * 1.2089258196146292e24)[None, :]).to(dot_dtype), k3, acc3)
        else:
            p = p.to(dot_dtype)
            acc0 = tl.dot(p, k0, acc0)
            acc1 = tl.dot(p, k1, acc1)
            acc2 = tl.dot(p, k2, acc2)
            acc3 = tl.dot(p, k3, acc3)
        m_i = m_new

    if PDL:
        # The merge kernel (launched with PDL) may be scheduled from here on; it waits for this whole
        # grid itself. Not earlier: its waiting programs would sit on the SMs beside the key loop.
        gdc_launch_dependents()
    has_any = l_i > 0.0
    l_safe = tl.where(has_any, l_i, 1.0)
    m_safe = tl.where(has_any, m_i, 0.0)
    inv_l = tl.where(has_any, 1.0 / l_safe, 0.0)[:, None]
    if FP8:
        # the accumulators hold 2^-20 (SCALE_LOGITS) or 2^-60 times the output
        inv_l = inv_l * (1048576.0 if SCALE_LOGITS else 1.152921504606847e18)
    if ROPE_E4M3:
        inv_l = inv_l * kv_scale  # the values are x: the output is kv_scale times their mix
    empty_lse = float("-inf") if PARTIAL else float("inf")  # +inf is the contract's "no token"
    lse = tl.where(has_any, (m_safe + tl.log2(l_safe)) * 0.6931471805599453, empty_lse)  # natural log

    out_base = (OUT + tok * stride_out_tok + split * stride_out_split
                + heads.to(tl.int64)[:, None] * stride_out_head + d128[None, :])
    out_dtype = OUT.dtype.element_ty
    tl.store(out_base + 0, (acc0 * inv_l).to(out_dtype), mask=head_ok[:, None])
    tl.store(out_base + 128, (acc1 * inv_l).to(out_dtype), mask=head_ok[:, None])
    tl.store(out_base + 256, (acc2 * inv_l).to(out_dtype), mask=head_ok[:, None])
    tl.store(out_base + 384, (acc3 * inv_l).to(out_dtype), mask=head_ok[:, None])
    lse_ptrs = LSE + tok * stride_lse_tok + split * stride_lse_split + heads * stride_lse_head
    tl.store(lse_ptrs, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    PART_OUT, stride_po_tok, stride_po_split, stride_po_head,
    PART_LSE, stride_pl_tok, stride_pl_split, stride_pl_head,
    OUT, stride_out_tok, stride_out_head,
    LSE, stride_lse_tok, stride_lse_head,
    h_q, n_split,
    BLOCK_SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr,  # output dims a program
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch: wait for the split kernel
):
    """out = sum_i exp(lse_i - lse) * out_i, lse = log(sum_i exp(lse_i)).

    One program per (token, head, BLOCK_D of the 512 output dims), all splits in one tile.
    """
    if PDL:
        gdc_wait()  # every split's partials written and visible
    chunks: tl.constexpr = 512 // BLOCK_D
    pid = tl.program_id(0)
    chunk = pid % chunks
    tok = (pid // (chunks * h_q)).to(tl.int64)
    head = (pid // chunks) % h_q
    splits = tl.arange(0, BLOCK_SPLIT)
    split_ok = splits < n_split
    pl = PART_LSE + tok * stride_pl_tok + head * stride_pl_head
    lse_parts = tl.load(pl + splits * stride_pl_split, mask=split_ok, other=float("-inf"))
    m = tl.max(lse_parts, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.exp(lse_parts - m_ref)  # empty splits (lse -inf) weigh 0
    total = tl.sum(weights, 0)

    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    po = (PART_OUT + tok * stride_po_tok + head * stride_po_head
          + splits[:, None].to(tl.int64) * stride_po_split + d[None, :])
    parts = tl.load(po, mask=split_ok[:, None], other=0.0)
    has_any = total > 0.0
    out = tl.sum(parts * weights[:, None], 0) * tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)
    tl.store(OUT + tok * stride_out_tok + head * stride_out_head + d, out.to(OUT.dtype.element_ty))
    if chunk == 0:
        lse = tl.where(has_any, m_ref + tl.log(tl.where(has_any, total, 1.0)), float("inf"))
        tl.store(LSE + tok * stride_lse_tok + head * stride_lse_head, lse)


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    block_h: int  # heads per program (tl.dot needs at least 16; the rest is masked)
    block_n: int  # keys gathered per step
    num_warps: int
    num_stages: int
    programs_per_sm: int = 2  # choose_num_splits: how many programs per SM to aim for ...
    split_round_up: bool = True  # ... rounding the split count up (oversubscribe) or down
    scale_logits: bool = True  # fp8: per-128 scales on the logits / probabilities, else on the keys
    trim_tail: bool = True  # from TRIM_TAIL_MIN_TOKENS query tokens on, end the key loop at the last valid index
    lazy_rescale: bool = False  # move the softmax's reference max only when a row's max grows by 2^8
    # Triton's `maxnreg` on SM12x: 255 lets ptxas 13.1 use every register where it would otherwise
    # cap a kernel at an occupancy step it cannot reach and spill; None leaves ptxas its own choice
    # (the 64-key 4-warp bf16 kernel spills 40 bytes with any `.maxnreg`, none at 187 registers without)
    sm12x_maxnreg: int | None = 255
    # fp8_ds_mla only: the Gluon kernel (sparse_mla_gluon.py: one warp per scale group, P.V from the
    # raw bytes, 49 KB of shared memory), not _sparse_mla_kernel; GPU only (not in the interpreter)
    gluon: bool = False
    min_split_tokens: int = 64  # choose_num_splits: give each split at least this many keys (MIN_SPLIT_TOKENS)
    prefetch_idx: bool = False  # the key loop loads the next tile's indices before this tile's rows


# The only configs the launcher can choose, by (cache dtype, name). Every one must fit SM120
# (99 KB of shared memory, no register spills) for its dtype: tests/kernels/test_sparse_mla_sm120.py
# compiles each for sm_120. Chosen from H200 sweeps (docs/perf-kernels.md): 16-head blocks
# everywhere (32-head blocks of 8 warps ran slower at every shape). Triton's pipeliner: where each
# tile's indices are loaded in its own iteration, num_stages=5 gives two buffers of gathered keys in
# flight (2-4 stages: one); with the next tile's indices prefetched (prefetch_idx) the gathers have
# num_stages - 1 buffers (sm_120's 99 KB: 32-key tiles at 3 stages, 64-key bf16 tiles at 2).
CONFIGS: dict[tuple[str, str], KernelConfig] = {
    # bf16: 64 keys a step over 4 warps with the lazy rescale and the indices prefetched, at every head
    # count. H200 (tenth pass): 0.90-0.95x the time of the configs before it (32-key tiles at 5 stages up
    # to 16 heads, this one untrimmed and without the prefetch beyond) at 8-128 heads and 8-4096 tokens,
    # trimmed prompt rows included. (ptxas's own register choice on SM12x: with any `.maxnreg` it spills.)
    ("bf16", "h16n64"): KernelConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, lazy_rescale=True,
                                     sm12x_maxnreg=None, prefetch_idx=True),
    # fp8_ds_mla up to 16 heads: the per-128 scales on the keys (the dequantised tile feeds both dots)
    ("fp8", "h16n32-scaled-keys"): KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=5,
                                                scale_logits=False),
    # beyond 16 heads: the same with the indices prefetched and 3 stages (2 buffers of gathered keys),
    # 0.92-0.96x the time of the scales on the logits at 64-4096 tokens x 32-128 heads (tenth pass;
    # the scales on the logits remain a studied alternative: bench/sparse_mla.py's CANDIDATES)
    ("fp8", "h16n32-prefetch"): KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=3,
                                             scale_logits=False, prefetch_idx=True),
    # Decode where one 16-key tile a program fills at most one wave (s_q x head blocks x topk / 16 <= the
    # SM count: one token, up to 16 heads): every program gathers once, nothing waits on a loop.
    # Each kernel's key loop pays a full index-then-row round trip an iteration at decode's one program
    # an SM, so the fewest iterations win. H200 (docs/perf-kernels.md, ninth pass): fp8 1 x 8 7.6 us
    # against 10.2 at 32 splits of 64 keys; bf16 keeps Triton's pipeliner (4 stages), fp8 none.
    ("bf16", "h16n16-decode"): KernelConfig(block_h=16, block_n=16, num_warps=4, num_stages=4, min_split_tokens=16),
    ("fp8", "h16n16-decode"): KernelConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, scale_logits=False,
                                           min_split_tokens=16),
}
# On SM12x every config runs one program per SM (its shared memory), so the kernels may use
# every register: Triton passes `.maxnreg` (the config's sm12x_maxnreg), without which ptxas 13.1
# (Triton 3.7's) caps some configs at an occupancy step they cannot reach anyway and spills.
# Elsewhere (Hopper, where two programs share an SM) ptxas keeps its own choice.
# The Gluon fp8_ds_mla kernel (sparse_mla_gluon.py): on SM12x the launcher's choice for fp8_ds_mla
# from GLUON_MIN_GRID_PER_SM x the SM count of programs before splits (s_q x 16-head blocks), the
# Triton kernel below that (decode). It needs its operands' inner dims contiguous and whole 32-key
# tiles (_gluon_unfit), else Triton runs. Two of its programs share an sm_120 SM (49 KB) where the
# Triton fp8 kernel's 94 KB hold one. H200 with sm_120's programs an SM (docs/perf-kernels.md,
# eighth pass): 0.77-0.86x the Triton fp8 kernel's time at s_q >= 256, 0.84-0.94x at 64 tokens
# (split), 1.01x at 8 x 8, 1.32x at 1 x 8; at the H200's own occupancy 1.02-1.32x: SM12x only.
GLUON_FP8 = KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, gluon=True)
# MLAFLEET_SPARSE_MLA_FP8_KERNEL in the server's environment overrides that choice for fp8_ds_mla:
# "triton" never runs the Gluon kernel (the operator's way back, should it misbehave on a GPU),
# "gluon" runs it for every fp8_ds_mla call whose operands it takes, on any GPU (to test it on
# hardware that is not SM12x); "auto" or unset: the rule above.
FP8_KERNEL_ENV = "MLAFLEET_SPARSE_MLA_FP8_KERNEL"
FP8_KERNELS = ("auto", "triton", "gluon")
GLUON_MIN_GRID_PER_SM = 0.25  # 64 x 8 on 132 SMs (0.48 an SM): Gluon faster; 8 x 8 (0.06): even
MAX_SPLITS = 128  # the merge kernel holds all splits of a row in one tile
# Programmatic dependent launch on SM90+ (Hopper, Blackwell): the split kernel may start while the
# kernel before it finishes and the merge kernel while the split kernel does, each waiting
# (griddepcontrol.wait) before it reads what the previous one wrote; saves launch gaps at decode.
PDL_LAUNCH = True
# The merge kernel: one warp a program, 32 or 64 output dims (_merge_block_d). H200, decode batches:
# 0.5-0.85x the time of 4 warps x 128 dims (docs/perf-kernels.md, ninth pass).
MERGE_NUM_WARPS = 1
MERGE_BLOCK_DS = (32, 64)
DEFAULT_NUM_SMS = 132  # used where no CUDA device answers (the interpreter)
PROGRAMS_PER_SM = 2  # split topk until the grid has about this many programs per SM ...
MIN_SPLIT_TOKENS = 64  # ... but give each split at least this many keys (a config's min_split_tokens)
# From this many query tokens on (prefill, where the first topk tokens of every prompt have
# fewer candidates than topk and the rest of their index row is -1) the kernel first finds each
# row's last valid index and gathers no further (TRIM_TAIL, configs with trim_tail); decode
# batches skip that pass. H200 (bench/sparse_mla_tail.py, docs/perf-kernels.md): rows of
# 3000-token prompts at 8 heads 0.33-0.58x the untrimmed time, full rows within 3%.
TRIM_TAIL_MIN_TOKENS = 64


def choose_config(h_q: int, fp8: bool = False, s_q: int = 0, num_sms: int = DEFAULT_NUM_SMS,
                  sm12x: bool = False, topk: int = 0) -> KernelConfig:
    """The config for h_q heads. bf16: 64 keys a step over 4 warps, the indices prefetched.
    fp8_ds_mla: the per-128 scales on the keys, 5 stages up to 16 heads, 3 with the indices
    prefetched beyond (H200, docs/perf-kernels.md);
    on SM12x (sm12x: an fp8_ds_mla cache on a compute capability 12.x GPU) the Gluon kernel
    (GLUON_FP8) from s_q tokens x its head blocks >= GLUON_MIN_GRID_PER_SM x num_sms on. Otherwise,
    where s_q x 16-head blocks x topk / 16 programs of one 16-key tile each fit one wave of num_sms
    (decode of one token at up to 16 heads), the "h16n16-decode" config of the cache."""
    if fp8 and sm12x and s_q * math.ceil(h_q / GLUON_FP8.block_h) >= GLUON_MIN_GRID_PER_SM * num_sms:
        return GLUON_FP8
    decode = CONFIGS[("fp8" if fp8 else "bf16", "h16n16-decode")]
    tiles = math.ceil(topk / decode.block_n)
    if 0 < s_q * math.ceil(h_q / decode.block_h) * tiles <= num_sms and tiles <= MAX_SPLITS:
        return decode
    if fp8:
        return CONFIGS[("fp8", "h16n32-scaled-keys" if h_q <= 16 else "h16n32-prefetch")]
    return CONFIGS[("bf16", "h16n64")]


def choose_num_splits(s_q: int, n_head_blocks: int, topk: int, block_n: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM, round_up: bool = True,
                      min_split_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Split each row's topk across programs when s_q x head blocks cannot fill the GPU:
    about programs_per_sm x num_sms programs, the split count rounded up (or down), then down
    to a power of two (H200: fp8 64 x 8 at 5 splits 108 us, at 4 splits 71 us). A grid that
    already has a program per SM is not split (H200: bf16 64x64 170 us unsplit, 242 at 2)."""
    programs = s_q * n_head_blocks
    if programs >= num_sms:
        return 1
    fill = programs_per_sm * num_sms / programs
    wanted = max(1, math.ceil(fill) if round_up else math.floor(fill))
    most = min(MAX_SPLITS, max(1, topk // max(min_split_tokens, block_n)))
    return 1 << (min(wanted, most).bit_length() - 1)


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _is_sm12x(device_index: int) -> bool:
    return _capability_major(device_index) == 12


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _merge_block_d(s_q: int, h_q: int, n_split: int, num_sms: int) -> int:
    """Output dims a merge program: 32 where 64 would leave SMs idle or hold over 64 splits (a warp's
    registers), else 64."""
    return 32 if n_split > 64 or s_q * h_q * (D_NOPE // 64) < num_sms else 64


def _pdl(device: torch.device) -> bool:
    """Launch the Triton kernels with programmatic dependent launch on `device` (PDL_LAUNCH, SM90+)."""
    return PDL_LAUNCH and device.type == "cuda" and _capability_major(_device_index(device)) >= 9


def _merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  block_d: int, pdl: bool = False, num_warps: int = MERGE_NUM_WARPS) -> None:
    """Launch _merge_splits_kernel: partials [s_q, n_split, h_q, 512] and [s_q, n_split, h_q] into
    out [s_q, h_q, 512] and lse [s_q, h_q], block_d output dims a program."""
    s_q, n_split, h_q = part_lse.shape
    _merge_splits_kernel[(s_q * h_q * (D_NOPE // block_d),)](
        part_out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse, part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0), lse.stride(1),
        h_q, n_split,
        BLOCK_SPLIT=triton.next_power_of_2(n_split), PDL=pdl, BLOCK_D=block_d, num_warps=num_warps, launch_pdl=pdl,
    )


def _maxnreg(device: torch.device, cfg: KernelConfig) -> int | None:
    """Triton's `maxnreg` for cfg's launches on `device`: its sm12x_maxnreg on compute capability 12.x."""
    if device.type != "cuda":
        return None
    return cfg.sm12x_maxnreg if _is_sm12x(_device_index(device)) else None


def _gluon_unfit(q: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
                 cfg: KernelConfig) -> str | None:
    """Why the Gluon fp8_ds_mla kernel cannot take these operands (None: it can): it reads each q
    half's dims, a token's indices and a row's 656 bytes contiguously, gathers rows 16 bytes at a
    time and walks whole tiles of block_n indices."""
    if q.stride(2) != 1 or q_rope.stride(2) != 1:
        return "q's dims are not contiguous"
    if indices.stride(2) != 1:
        return "a token's indices are not contiguous"
    if indices.shape[2] % cfg.block_n:
        return f"topk {indices.shape[2]} is not a multiple of {cfg.block_n}"
    if rows.stride(0) % 16 or rows.data_ptr() % 16:
        return "the cache's rows do not start on 16-byte boundaries"
    return None


def _fp8_kernel_choice() -> str:
    """FP8_KERNEL_ENV's value: auto (also when unset or empty), triton or gluon."""
    choice = os.environ.get(FP8_KERNEL_ENV, "").strip().lower() or "auto"
    if choice not in FP8_KERNELS:
        raise ValueError(f"{FP8_KERNEL_ENV}={os.environ[FP8_KERNEL_ENV]!r} is not one of {', '.join(FP8_KERNELS)}")
    return choice


def _interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_sparse_mla_kernel, InterpretedFunction)


def _run(q: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, stride_kv_tok: int, n_slots: int,
         indices: torch.Tensor,
         sm_scale: float, fp8: bool, num_splits: int | None,
         config: KernelConfig | None, kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype != torch.bfloat16:
        raise TypeError(f"sparse MLA: q must be bfloat16, got {q.dtype}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sparse MLA: sm_scale must be finite, got {sm_scale}")
    interpreted = _interpreted()
    if not interpreted and q.device.type != "cuda":
        raise ValueError(f"sparse MLA: tensors must be on a CUDA device, got {q.device} "
                         "(CPU tensors run only under TRITON_INTERPRET=1, set before triton is imported)")
    s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    num_sms = (DEFAULT_NUM_SMS if interpreted
               else torch.cuda.get_device_properties(q.device).multi_processor_count)
    if config is None and fp8 and kv_scale is None:
        choice = _fp8_kernel_choice()
        if choice == "gluon":
            config = GLUON_FP8
        else:
            config = choose_config(h_q, fp8, s_q, num_sms, sm12x=choice == "auto" and not interpreted
                                   and _is_sm12x(_device_index(q.device)), topk=topk)
        if config.gluon and _gluon_unfit(q, q_rope, kv, indices, config) is not None:
            config = choose_config(h_q, fp8)  # operands the Gluon kernel cannot read as they lie: Triton's
    cfg = config or choose_config(h_q, fp8, s_q, num_sms, topk=topk)
    if cfg.gluon:
        why = ("not an fp8_ds_mla cache" if not fp8 or kv_scale is not None
               else "Triton's CPU interpreter cannot run Gluon kernels" if interpreted
               else _gluon_unfit(q, q_rope, kv, indices, cfg))
        if why:
            raise ValueError(f"sparse MLA: the Gluon fp8_ds_mla kernel cannot run here: {why}")
    n_head_blocks = triton.cdiv(h_q, cfg.block_h)
    if num_splits is None:
        num_splits = choose_num_splits(s_q, n_head_blocks, topk, cfg.block_n, num_sms,
                                       cfg.programs_per_sm, cfg.split_round_up, cfg.min_split_tokens)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"sparse MLA: num_splits must be 1 to {MAX_SPLITS}, got {num_splits}")
    tokens_per_split = triton.cdiv(triton.cdiv(topk, num_splits), cfg.block_n) * cfg.block_n
    num_splits = triton.cdiv(topk, tokens_per_split)  # no empty trailing split

    out = torch.empty(s_q, h_q, D_NOPE, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if s_q == 0 or h_q == 0:
        return out, lse
    partial = num_splits > 1
    if partial:
        dst_out = torch.empty(s_q, num_splits, h_q, D_NOPE, dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(s_q, num_splits, h_q, dtype=torch.float32, device=q.device)
        out_strides = (dst_out.stride(0), dst_out.stride(1), dst_out.stride(2))
        lse_strides = (dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2))
    else:
        dst_out, dst_lse = out, lse
        out_strides = (out.stride(0), 0, out.stride(1))
        lse_strides = (lse.stride(0), 0, lse.stride(1))

    grid = (s_q * num_splits * n_head_blocks,)
    trim = cfg.trim_tail and s_q >= TRIM_TAIL_MIN_TOKENS
    pdl = not interpreted and _pdl(q.device)
    if cfg.gluon:
        from . import sparse_mla_gluon

        sparse_mla_gluon.launch(grid[0], q, q_rope, kv, n_slots, indices, dst_out, out_strides, dst_lse,
                                lse_strides[:2], h_q, topk, tokens_per_split, num_splits, n_head_blocks,
                                sm_scale * LOG2E, cfg.block_n, cfg.num_stages, partial, trim,
                                _maxnreg(q.device, cfg))
    else:
        _sparse_mla_kernel[grid](
            q, q.stride(0), q.stride(1), q.stride(2),
            q_rope, q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
            kv, stride_kv_tok, n_slots,
            indices, indices.stride(0), indices.stride(2),
            dst_out, *out_strides,
            dst_lse, *lse_strides,
            h_q, topk, tokens_per_split, num_splits, n_head_blocks,
            sm_scale * LOG2E,
            kv_scale if kv_scale is not None else lse,  # read only for a plain fp8 cache
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, FP8=fp8, ROPE_E4M3=kv_scale is not None, PARTIAL=partial,
            SCALE_LOGITS=cfg.scale_logits,
            DOT_F32=interpreted, TRIM_TAIL=trim, LAZY_RESCALE=cfg.lazy_rescale, PDL=pdl,
            PREFETCH_IDX=cfg.prefetch_idx,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=_maxnreg(q.device, cfg), launch_pdl=pdl,
        )
    if partial:
        # The interpreter's cost is per program: there one program merges a head's 512 dims
        # (test_merge_block_d_agrees checks the GPU's 32 and 64 against it).
        block_d = D_NOPE if interpreted else _merge_block_d(s_q, h_q, num_splits, num_sms)
        _merge_splits(dst_out, dst_lse, out, lse, block_d, pdl)
    return out, lse



# --------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------

def sparse_mla_fwd(q: Query, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                   d_v: int = D_NOPE, *, num_splits: int | None = None,
                   config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with a bf16 KV cache: (out [s_q, h_q, 512] bf16, lse [s_q, h_q] float32).

    q: [s_q, h_q, 576], or its (latent [s_q, h_q, 512], RoPE [s_q, h_q, 64]) halves, each with
    any strides (the same for every entry point). num_splits and config override the launcher's
    choices (tests and benchmarks).
    """
    q, q_rope = _query_halves(q)
    _check_common(q, indices, d_v)
    _check_bf16_kv(kv, q)
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"sparse MLA: kv must be bfloat16, got {kv.dtype}")
    if kv.stride(2) != 1:
        raise ValueError("sparse MLA: the 576 values of a kv token must be contiguous")
    return _run(q, q_rope, kv, kv.stride(0), kv.shape[0], indices, float(sm_scale), False, num_splits, config)


def sparse_mla_fwd_fp8(q: Query, kv_cache: torch.Tensor, indices: torch.Tensor,
                       sm_scale: float, d_v: int = D_NOPE, *, num_splits: int | None = None,
                       config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over an fp8_ds_mla cache: (out [s_q, h_q, 512] bf16, lse [s_q, h_q] float32)."""
    q, q_rope = _query_halves(q)
    _check_common(q, indices, d_v)
    rows = _fp8_rows(kv_cache, q)
    return _run(q, q_rope, rows, rows.stride(0), rows.shape[0], indices, float(sm_scale), True, num_splits, config)


def sparse_mla_fwd_fp8_e4m3(q: Query, kv_cache: torch.Tensor, indices: torch.Tensor,
                            sm_scale: float, kv_scale: torch.Tensor | float, d_v: int = D_NOPE, *,
                            num_splits: int | None = None,
                            config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a plain fp8 cache (vLLM's `fp8` MLA layout: 576 float8_e4m3 values per
    token, RoPE included, and one float32 scale for the cache, x = fp8 * kv_scale):
    (out [s_q, h_q, 512] bf16, lse [s_q, h_q] float32).

    kv_cache: float8_e4m3fn or its uint8 bytes, [..., 576] (e.g. [num_blocks, 64, 576] or
    [slots, 1, 576]); kv_scale: a float32 tensor of one element on q's device (read on the
    device, so CUDA graphs capture it), or a number.
    """
    q, q_rope = _query_halves(q)
    _check_common(q, indices, d_v)
    if kv_cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"sparse MLA fp8: a plain fp8 cache is float8_e4m3fn (or uint8), got {kv_cache.dtype}")
    if kv_cache.shape[-1] != D_QK or kv_cache.stride(-1) != 1:
        raise ValueError(f"sparse MLA fp8: the {D_QK} values of a token must be the contiguous last dim, "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.device != q.device:
        raise ValueError(f"sparse MLA fp8: kv_cache on {kv_cache.device}, q on {q.device}")
    rows = kv_cache.view(torch.uint8).reshape(-1, D_QK)
    scale = torch.as_tensor(kv_scale, dtype=torch.float32, device=q.device).reshape(-1)
    if scale.numel() != 1:
        raise ValueError(f"sparse MLA fp8: kv_scale must be one value, got {scale.numel()}")
    return _run(q, q_rope, rows, rows.stride(0), rows.shape[0], indices, float(sm_scale), True, num_splits,
                config, kv_scale=scale)


# --------------------------------------------------------------------------------------
# vLLM's KV cache by kv_cache_dtype (what every line's TRITON_MLA_SPARSE backend reads)
#
# - auto / bfloat16: [num_blocks, 64, 576] bf16, one token a row.
# - fp8_ds_mla: the 656-byte rows above. `--kv-cache-dtype fp8` serves this one: vLLM's MLA
#   layer (with the patch sets' mla-fp8-kv edits) turns fp8 into fp8_ds_mla before the cache
#   is allocated.
# - fp8 / fp8_e4m3 handed to the backend itself (nothing converted them; vLLM's own backend
#   tests build it so): vLLM's plain fp8 MLA cache, 576 float8_e4m3 values a token, RoPE
#   included, with the layer's one k_scale.
# --------------------------------------------------------------------------------------

BF16_ROWS = "bf16"
FP8_DS_MLA_ROWS = "fp8_ds_mla"
FP8_E4M3_ROWS = "fp8_e4m3"
# kv_cache_dtype -> how the cache holds a token
LAYOUTS: dict[str, str] = {
    "auto": BF16_ROWS,  # the model's dtype, which the backend requires to be bf16
    "bfloat16": BF16_ROWS,
    "fp8_ds_mla": FP8_DS_MLA_ROWS,
    "fp8": FP8_E4M3_ROWS,
    "fp8_e4m3": FP8_E4M3_ROWS,
}
ROW_WIDTH = {BF16_ROWS: 576, FP8_DS_MLA_ROWS: 656, FP8_E4M3_ROWS: 576}  # elements or bytes a token


def layout_of(kv_cache_dtype: str, known: list[str], backend: str = "TRITON_MLA_SPARSE") -> str:
    """The layout of a kv-cache dtype among `known` (the line's), or ValueError naming those."""
    if kv_cache_dtype not in known or kv_cache_dtype not in LAYOUTS:
        raise ValueError(f"{backend}: kv-cache dtype {kv_cache_dtype!r} is not supported; use one of "
                         f"{', '.join(known)}")
    return LAYOUTS[kv_cache_dtype]


def attend(layout: str, q: Query, rows: torch.Tensor, slots: torch.Tensor, scale: float,
           k_scale: torch.Tensor | None) -> torch.Tensor:
    """Sparse MLA over a cache seen as flat rows [n, ROW_WIDTH[layout]] (any dtype of that width):
    out [T, H, 512] bf16 for q [T, H, 576] (or its latent and RoPE halves) over slots [T, 1, k]
    (-1: none)."""
    if layout == BF16_ROWS:
        return sparse_mla_fwd(q, rows.unsqueeze(1), slots, scale, d_v=D_NOPE)[0]
    if layout == FP8_DS_MLA_ROWS:
        return sparse_mla_fwd_fp8(q, rows.view(torch.uint8), slots, scale, d_v=D_NOPE)[0]
    if layout == FP8_E4M3_ROWS:
        if k_scale is None:
            raise ValueError("a plain fp8 cache needs the layer's k_scale")
        return sparse_mla_fwd_fp8_e4m3(q, rows.view(torch.uint8).unsqueeze(1), slots, scale, k_scale,
                                       d_v=D_NOPE)[0]
    raise ValueError(f"unknown KV-cache layout {layout!r}")


# --------------------------------------------------------------------------------------
# fp8_ds_mla prefill through a bf16 workspace
#
# A prefill chunk reads only its requests' own contexts, and every context row many times (by
# each of the chunk's tokens and each 16-head block of a token), so the fp8 kernel would
# dequantise each row thousands of times. Here each prefill request's context is dequantised
# once into a bf16 workspace (request j's position p at row j * seg_rows + p), the indexer's
# positions are mapped onto those rows, and the bf16 kernel attends over the workspace: the
# same values (fp8 x scale rounded to bf16, as the fp8 kernel's tile), at the bf16 kernel's
# speed (H200: 0.54-0.57x the fp8 kernel's time at 8-128 heads, docs/perf-kernels.md). The
# backend decides per batch (use_prefill_workspace) and provides the workspace.
# --------------------------------------------------------------------------------------

CONTEXT_BLOCK_R = 16  # context rows a program dequantises (H200: 2.8-3.2 TB/s from 64k rows on)
WS_ROWS_BLOCK_K = 256  # positions a program maps onto workspace rows
PREFILL_WS_MIN_TOKENS = 64  # fewer prefill tokens: the fp8 kernel directly (a few launches saved)
PREFILL_WS_ROWS_PER_TOKEN = 256  # at most this many context rows dequantised per prefill token
# in the server's environment: "off" keeps every fp8_ds_mla token on the fp8 kernel (the operator's
# way back), "auto" (also unset or empty) lets the rule decide
PREFILL_WS_ENV = "MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE"
PREFILL_WS_CHOICES = ("auto", "off")


def prefill_segment_rows(max_seq_len: int) -> int:
    """Workspace rows per prefill request: its longest context rounded up to a cache block."""
    return -(-max(int(max_seq_len), 1) // FP8_BLOCK_SIZE) * FP8_BLOCK_SIZE


def use_prefill_workspace(prefill_tokens: int, num_prefills: int, max_seq_len: int, workspace_rows: int) -> bool:
    """Whether a batch's prefill tokens take the workspace (host values only, no GPU sync): enough
    tokens, a workspace that holds every prefill request's context, few enough rows a token, and
    PREFILL_WS_ENV not "off"."""
    choice = os.environ.get(PREFILL_WS_ENV, "").strip().lower() or "auto"
    if choice not in PREFILL_WS_CHOICES:
        raise ValueError(f"{PREFILL_WS_ENV}={os.environ[PREFILL_WS_ENV]!r} is not one of "
                         f"{', '.join(PREFILL_WS_CHOICES)}")
    rows = num_prefills * prefill_segment_rows(max_seq_len)
    return (choice == "auto" and num_prefills > 0 and prefill_tokens >= PREFILL_WS_MIN_TOKENS and rows <= workspace_rows
            and rows <= PREFILL_WS_ROWS_PER_TOKEN * prefill_tokens)


@triton.jit
def _fp8_e4m3_bits_to_f32(raw):
    """float8_e4m3 bytes (uint8, no NaN) as float32, exactly, -0 included (normal values by their
    bits, subnormals as m x 2^-9, the sign bit set last); instructions any GPU and the interpreter have."""
    x = raw.to(tl.int32)
    e = (x >> 3) & 15
    m = x & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)
    return (mag.to(tl.uint32, bitcast=True) | ((x & 0x80).to(tl.uint32) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_rne(x):
    """float32 (no NaN) to bfloat16, rounded to nearest even by its bits: the GPU's conversion,
    which Triton's interpreter (truncating) does not give."""
    u = x.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp8_ds_mla_context_kernel(ROWS, stride_row, BLOCK_TABLE, stride_bt, SEQ_LENS, rows_per_block,
                               OUT, stride_out, seg_rows, BLOCK_R: tl.constexpr, PAGE: tl.constexpr):
    """Program (i, j): positions i * BLOCK_R ... of request j's context, fp8_ds_mla -> bf16 rows."""
    seg = tl.program_id(1)
    start = tl.program_id(0) * BLOCK_R
    seq_len = tl.load(SEQ_LENS + seg)
    if start < seq_len:
        pos = start + tl.arange(0, BLOCK_R)
        ok = pos < seq_len
        blk = tl.load(BLOCK_TABLE + seg.to(tl.int64) * stride_bt + pos // PAGE, mask=ok, other=0)
        row = ROWS + (blk.to(tl.int64) * rows_per_block + pos % PAGE) * stride_row
        grp = tl.arange(0, 4)
        cols = tl.arange(0, 128)
        m3 = ok[:, None, None]
        lat = (grp * 128)[None, :, None] + cols[None, None, :]  # [1, 4, 128]: latent byte offsets
        raw = tl.load(row[:, None, None] + lat, mask=m3, other=0)
        scale = tl.load((row + 512).to(tl.pointer_type(tl.float32))[:, None] + grp[None, :], mask=ok[:, None], other=0.0)
        d_rope = tl.arange(0, 64)
        m = ok[:, None]
        rope = tl.load((row + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + d_rope[None, :], mask=m, other=0.0)
        dst = OUT + (seg.to(tl.int64) * seg_rows + pos)[:, None] * stride_out
        tl.store(dst[:, :, None] + lat, _f32_to_bf16_rne(_fp8_e4m3_bits_to_f32(raw) * scale[:, :, None]), mask=m3)
        tl.store(dst + 512 + d_rope[None, :], rope, mask=m)


@triton.jit
def _workspace_rows_kernel(POS, stride_pos, SEG_OF_TOKEN, SEQ_LENS, OUT, topk, seg_rows, BLOCK_K: tl.constexpr):
    """Program (t, c): a prefill token's positions (-1: none) as workspace rows (-1 past its context)."""
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = cols < topk
    seg = tl.load(SEG_OF_TOKEN + tok)
    seq_len = tl.load(SEQ_LENS + seg)
    p = tl.load(POS + tok * stride_pos + cols, mask=inside, other=-1)
    rows = tl.where((p >= 0) & (p < seq_len), seg * seg_rows + p, -1)
    tl.store(OUT + tok * topk + cols, rows.to(tl.int32), mask=inside)


def dequantize_context_fp8_ds_mla(rows: torch.Tensor, rows_per_block: int, block_table: torch.Tensor,
                                  seq_lens: torch.Tensor, out: torch.Tensor, seg_rows: int) -> torch.Tensor:
    """Prefill requests' contexts into a bf16 workspace: request j's positions 0 .. seq_lens[j]-1,
    read through block_table[j] (cache block b's position o at row b * rows_per_block + o of rows,
    the cache as uint8 [n, 656]), to out[j * seg_rows + p, :576]. Returns out."""
    n_req = seq_lens.shape[0]
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < FP8_TOKEN_BYTES or rows.stride(1) != 1:
        raise ValueError(f"fp8_ds_mla context: rows must be uint8 [n, {FP8_TOKEN_BYTES}] with contiguous "
                         f"bytes, got {rows.dtype} {tuple(rows.shape)}")
    if rows.stride(0) % 4 or rows.data_ptr() % 4:
        raise ValueError("fp8_ds_mla context: each token must start on a 4-byte boundary")
    if block_table.dim() != 2 or block_table.shape[0] < n_req or block_table.dtype != torch.int32:
        raise ValueError(f"fp8_ds_mla context: block_table must be int32 [>= {n_req}, blocks], "
                         f"got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError(f"fp8_ds_mla context: seq_lens must be int32 [requests], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if seg_rows % FP8_BLOCK_SIZE or seg_rows > FP8_BLOCK_SIZE * block_table.shape[1]:
        raise ValueError(f"fp8_ds_mla context: seg_rows {seg_rows} must be a multiple of {FP8_BLOCK_SIZE} "
                         f"within the block table's {block_table.shape[1]} blocks")
    if (out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[0] < n_req * seg_rows
            or out.shape[1] < D_QK or out.stride(1) != 1):
        raise ValueError(f"fp8_ds_mla context: out must be bf16 [>= {n_req * seg_rows}, {D_QK}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if n_req:
        _fp8_ds_mla_context_kernel[(seg_rows // CONTEXT_BLOCK_R, n_req)](
            rows, rows.stride(0), block_table, block_table.stride(0), seq_lens, rows_per_block,
            out, out.stride(0), seg_rows, BLOCK_R=CONTEXT_BLOCK_R, PAGE=FP8_BLOCK_SIZE, num_warps=4, num_stages=1)
    return out


def attend_prefill_fp8_ds_mla(q: Query, rows: torch.Tensor, rows_per_block: int, block_table: torch.Tensor,
                              seq_lens: torch.Tensor, seg_of_token: torch.Tensor, positions: torch.Tensor,
                              scale: float, workspace: torch.Tensor, seg_rows: int) -> torch.Tensor:
    """Prefill tokens over an fp8_ds_mla cache through a bf16 workspace: out [T, H, 512] bf16.

    rows: the cache as uint8 [n, 656] rows (block b's position o at b * rows_per_block + o);
    block_table [R, blocks] and seq_lens [R] (int32): the prefill requests'; seg_of_token [T]
    (int32): each token's request among them; positions [T, k]: the indexer's context positions
    (-1: none); workspace: bf16 [>= R * seg_rows, 576], seg_rows from prefill_segment_rows.
    """
    tokens, topk = positions.shape[0], positions.shape[-1]
    pos = positions.reshape(tokens, topk)
    if pos.dtype != torch.int32 or pos.stride(1) != 1:
        raise ValueError(f"prefill workspace: positions must be int32 [T, k] with contiguous rows, got "
                         f"{pos.dtype} {tuple(positions.shape)}")
    if seg_of_token.shape != (tokens,) or seg_of_token.dtype != torch.int32:
        raise ValueError(f"prefill workspace: seg_of_token must be int32 [{tokens}], got "
                         f"{seg_of_token.dtype} {tuple(seg_of_token.shape)}")
    ws = dequantize_context_fp8_ds_mla(rows, rows_per_block, block_table, seq_lens, workspace, seg_rows)
    ws_rows = torch.empty((tokens, 1, topk), dtype=torch.int32, device=pos.device)
    if tokens:
        _workspace_rows_kernel[(tokens, triton.cdiv(topk, WS_ROWS_BLOCK_K))](
            pos, pos.stride(0), seg_of_token, seq_lens, ws_rows, topk, seg_rows, BLOCK_K=WS_ROWS_BLOCK_K,
            num_warps=4, num_stages=1)
    n_rows = seq_lens.shape[0] * seg_rows
    return sparse_mla_fwd(q, ws[:n_rows, :D_QK].unsqueeze(1), ws_rows, scale, d_v=D_NOPE)[0]


def attend_with_prefill_workspace(q: Query, rows: torch.Tensor, rows_per_block: int, decode_slots: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor, req_of_token: torch.Tensor,
                                  num_decodes: int, num_prefills: int, positions: torch.Tensor, scale: float,
                                  workspace: torch.Tensor, seg_rows: int) -> torch.Tensor:
    """A batch over an fp8_ds_mla cache in vLLM's reordered form: out [T, H, 512] bf16.

    Its first num_decodes requests decode (their D tokens first, read from the cache at
    decode_slots [D, 1, k]); the next num_prefills requests prefill, their tokens through the
    workspace (attend_prefill_fp8_ds_mla). block_table, seq_lens and req_of_token (each token's
    request) are the whole batch's; positions [T, k] the indexer's."""
    tokens, n_dec = positions.shape[0], decode_slots.shape[0]
    first, last = num_decodes, num_decodes + num_prefills

    def part(start: int, end: int) -> Query:
        return q[start:end] if isinstance(q, torch.Tensor) else (q[0][start:end], q[1][start:end])

    prefill = attend_prefill_fp8_ds_mla(part(n_dec, tokens), rows.view(torch.uint8), rows_per_block,
                                        block_table[first:last], seq_lens[first:last],
                                        req_of_token[n_dec:tokens] - first, positions[n_dec:], scale, workspace,
                                        seg_rows)
    if not n_dec:
        return prefill
    return torch.cat([attend(FP8_DS_MLA_ROWS, part(0, n_dec), rows, decode_slots, scale, None), prefill])
