"""DeepGEMM-free kernels for the DSA indexer (GLM-5, DeepSeek-V3.2): MQA logits and per-row top-k.

The indexer scores every (query token, cache position) pair with a small multi-head dot
product and keeps each query's `topk` best positions. vLLM 0.20.2 computes the scores with
DeepGEMM (`fp8_fp4_mqa_logits` for prefill, `fp8_fp4_paged_mqa_logits` for decode), which
runs on SM90/SM100 only. The Triton kernels here compute the same thing on any GPU Triton
targets with fp8 tensor cores (compute capability 8.9 and newer; older GPUs get a clear
error), sized to fit SM120's 99 KB of shared memory.

The function, for query token m and key position n:

    logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h, :] . k[n, :])

with q and k float8_e4m3fn, k_scale float32 (x = fp8 * scale per key token), weights float32
(vLLM folds the query's quantisation scale and the softmax scale into them). Only positions
inside each query's key range are defined; with `clean_logits=True` every other position of
the output is -inf, with `clean_logits=False` (what vLLM asks for) the rest of the output is
left as it was allocated, and the top-k that follows reads only the range.

Paged decode reads keys through a block table from the indexer's K cache. A cache block of
`block_size` tokens is `block_size * (D + 4)` bytes: first the `block_size * D` fp8 values
(token-major, D per token), then `block_size` float32 scales. Tensors of vLLM's shape
`[num_blocks, block_size, D + 4]` (or `[..., 1, D + 4]`) therefore hold 132 bytes per token
for D = 128, but the scale of token t of a block is NOT at bytes 128..131 of row t.

`top_k_per_row` picks each row's `topk` largest logits inside [start, end) and writes their
positions relative to `start`, -1 where the range holds fewer than `topk` positions, like
vLLM's `top_k_per_row_prefill`/`top_k_per_row_decode` (the order inside a row is not part of
the contract). It is an exact radix select in Triton (a few KB of shared memory; for a few
long rows, split over several programs a row); `top_k_per_row_torch` does the same through
torch.topk.

The tests compare each fast path with a readable float64 reference (tests/kernels/oracles.py).
This module imports only torch and triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")

# Tile sizes, from H200 sweeps (docs/perf-indexer.md). Shared memory for the prefill kernel:
# a [ROWS, D] fp8 query tile and num_stages - 1 buffers of a [BLOCK_N, D] fp8 key tile (the
# loads are pipelined); the sm_120 resource test in tests/kernels/ checks every config below
# 101376 bytes. Both logits kernels score key-major (KEY_MAJOR in _mqa_logits_kernel).
PREFILL_BLOCK_N = 64
PREFILL_ROWS = 256  # query tokens per program * padded heads (at least one token)
PREFILL_WARPS = 8
PREFILL_STAGES = 3
PREFILL_KEY_MAJOR = True  # the score tile's orientation (see _mqa_logits_kernel)
DECODE_WARPS = 4
DECODE_STAGES = 3
DECODE_KEY_MAJOR = True


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(device: torch.device, programs: int, blocks: int) -> int:
    """How many programs share one row block's keys: enough programs to fill the GPU."""
    if device.type != "cuda":
        return max(1, min(blocks, 2))
    target = 4 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(blocks, triton.cdiv(target, max(programs, 1))))


# On SM12x the prefill logits kernel runs one program per SM (its 56 KB of shared memory), so it
# may use every register: `.maxnreg`, without which ptxas 13.1 (Triton 3.7's) caps it at an
# occupancy step it cannot reach anyway and spills. Elsewhere ptxas keeps its own choice.
SM12X_MAXNREG = 255


@functools.cache
def _maxnreg(device_index: int) -> int | None:
    return SM12X_MAXNREG if torch.cuda.get_device_capability(device_index)[0] == 12 else None


def _launch_maxnreg(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return _maxnreg(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _fp8_dot_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _check_device(device: torch.device, what: str) -> None:
    """The logits kernels feed fp8 straight to the tensor cores: compute capability 8.9+."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not _fp8_dot_capable(index):
            major, minor = torch.cuda.get_device_capability(index)
            raise RuntimeError(f"{what}: the Triton indexer kernels need fp8 tensor cores (compute capability "
                               f"8.9 or newer); this GPU is {major}.{minor}")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# Prefill: MQA logits over a contiguous K with a [ks, ke) key range per query token.
# ----------------------------------------------------------------------------------------------


# Triton specialises integer arguments on divisibility by 16 and on 1, one compiled variant each:
# a prefill chunk's token and key counts vary with the batch's make-up, so they are not
# specialised (else the first batch of a new make-up compiles inside a request: 0.3-0.9 s
# seen in the engine, docs/e2e-h200.md, "third round"), and the logits rows are padded to
# LOGITS_ROW_ALIGN floats so their stride is one specialisation (and stores stay vectorised).
LOGITS_ROW_ALIGN = 16


@triton.jit(do_not_specialize=["M", "N", "SPLIT"])
def _mqa_logits_kernel(
    q_ptr, k_ptr, ks_ptr, ke_ptr, scale_ptr, w_ptr, out_ptr,
    M, N, H,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kd,
    stride_wm, stride_wh,
    stride_om, stride_on,
    stride_scale,
    SPLIT,
    BLOCK_M: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    CLEAN: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    # KEY_MAJOR: the score tile is [BLOCK_N keys, rows] (keys along the MMA's M, the query rows
    # along its N), so the sum over a token's heads runs inside each thread and its lane quad
    # instead of across warps through shared memory. Otherwise [rows, BLOCK_N keys].
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_M * HP

    # Rows of the query tile: token-major, heads padded to HP (padded heads get weight 0).
    r = tl.arange(0, ROWS)
    tok = pid_m * BLOCK_M + r // HP
    head = r % HP
    row_ok = (tok < M) & (head < H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qm + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    w = tl.load(w_ptr + tok.to(tl.int64) * stride_wm + head * stride_wh, mask=row_ok, other=0.0)

    # Key range of each token of the block, and the union of them.
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    ks = tl.load(ks_ptr + m, mask=m_ok, other=0)
    ke = tl.load(ke_ptr + m, mask=m_ok, other=0)
    ke = tl.minimum(ke, N)
    lo = tl.min(tl.where(m_ok & (ks < ke), ks, N), axis=0)
    hi = tl.max(tl.where(m_ok & (ks < ke), ke, 0), axis=0)

    # Only the key blocks inside [lo, hi) are scored, in a loop without branches around the
    # loads (Triton pipelines only those); with CLEAN the blocks outside get -inf after it.
    blk_lo = lo // BLOCK_N
    blk_hi = tl.where(lo < hi, tl.cdiv(hi, BLOCK_N), blk_lo)
    if KEY_MAJOR:
        qt = tl.trans(q)  # [D, ROWS]: the dot's second operand
        out_tile = out_ptr + m.to(tl.int64)[None, :] * stride_om  # [1, BLOCK_M]
    else:
        out_tile = out_ptr + m.to(tl.int64)[:, None] * stride_om  # [BLOCK_M, 1]
    for blk in range(blk_lo + pid_s, blk_hi, SPLIT):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kt = tl.load(k_ptr + n.to(tl.int64)[:, None] * stride_kn + d[None, :] * stride_kd,
                     mask=n_ok[:, None], other=0.0)
        ksc = tl.load(scale_ptr + n.to(tl.int64) * stride_scale, mask=n_ok, other=0.0)
        if KEY_MAJOR:
            s = tl.dot(kt, qt, out_dtype=tl.float32)                       # [BLOCK_N, ROWS]
            s = tl.maximum(s, 0.0) * w[None, :]
            logit = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, HP)), axis=2)  # [BLOCK_N, BLOCK_M]
            logit = logit * ksc[:, None]
            inside = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
            dest = out_tile + n.to(tl.int64)[:, None] * stride_on
            writable = n_ok[:, None] & m_ok[None, :]
        else:
            s = tl.dot(q, tl.trans(kt), out_dtype=tl.float32)              # [ROWS, BLOCK_N]
            s = tl.maximum(s, 0.0) * w[:, None]
            logit = tl.sum(tl.reshape(s, (BLOCK_M, HP, BLOCK_N)), axis=1)  # [BLOCK_M, BLOCK_N]
            logit = logit * ksc[None, :]
            inside = (n[None, :] >= ks[:, None]) & (n[None, :] < ke[:, None])
            dest = out_tile + n.to(tl.int64)[None, :] * stride_on
            writable = m_ok[:, None] & n_ok[None, :]
        if CLEAN:
            tl.store(dest, tl.where(inside, logit, float("-inf")), mask=writable)
        else:
            tl.store(dest, logit, mask=writable & inside)
    if CLEAN:
        num_blocks = tl.cdiv(N, BLOCK_N)
        for blk in range(pid_s, num_blocks, SPLIT):
            if (blk < blk_lo) | (blk >= blk_hi):
                n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = n < N
                if KEY_MAJOR:
                    tl.store(out_tile + n.to(tl.int64)[:, None] * stride_on,
                             tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32),
                             mask=n_ok[:, None] & m_ok[None, :])
                else:
                    tl.store(out_tile + n.to(tl.int64)[None, :] * stride_on,
                             tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32),
                             mask=m_ok[:, None] & n_ok[None, :])


def _prefill_block_m(h_padded: int) -> int:
    return max(1, PREFILL_ROWS // h_padded)


def mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool = False,
               num_splits: int | None = None) -> torch.Tensor:
    """MQA logits for prefill, what DeepGEMM's `fp8_fp4_mqa_logits` computes on FP8 inputs.

    q [M, H, D] float8_e4m3fn; k [N, D] float8_e4m3fn; k_scale [N] float32; weights [M, H]
    float32; ks, ke [M] int32: query m scores keys [ks[m], ke[m]). Returns [M, N] float32, its
    rows LOGITS_ROW_ALIGN floats apart (as DeepGEMM's are padded: consumers take the row stride).
    """
    _check(q.dim() == 3, f"mqa_logits: q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    M, H, D = q.shape
    _check(q.dtype == FP8 and k.dtype == FP8,
           f"mqa_logits: q and k must be float8_e4m3fn, got {q.dtype} and {k.dtype}")
    _check(k.dim() == 2 and k.shape[1] == D,
           f"mqa_logits: k must be [keys, {D}], got shape {tuple(k.shape)}")
    N = k.shape[0]
    _check(k_scale.shape == (N,) and k_scale.dtype == torch.float32,
           f"mqa_logits: k_scale must be float32 [{N}], got {k_scale.dtype} {tuple(k_scale.shape)}")
    _check(weights.shape == (M, H) and weights.dtype == torch.float32,
           f"mqa_logits: weights must be float32 [{M}, {H}], got {weights.dtype} {tuple(weights.shape)}")
    for name, t in (("ks", ks), ("ke", ke)):
        _check(t.shape == (M,) and t.dtype == torch.int32,
               f"mqa_logits: {name} must be int32 [{M}], got {t.dtype} {tuple(t.shape)}")
    _check(D == triton.next_power_of_2(D) and D >= 16,
           f"mqa_logits: head_dim must be a power of two >= 16, got {D}")
    devices = {t.device for t in (q, k, k_scale, weights, ks, ke)}
    _check(len(devices) == 1, f"mqa_logits: all inputs must be on one device, got {devices}")
    _check_device(q.device, "mqa_logits")

    padded = triton.cdiv(N, LOGITS_ROW_ALIGN) * LOGITS_ROW_ALIGN
    logits = torch.empty((M, padded), dtype=torch.float32, device=q.device)[:, :N]
    if M == 0 or N == 0:
        return logits
    hp = triton.next_power_of_2(H)
    block_m = _prefill_block_m(hp)
    programs = triton.cdiv(M, block_m)
    splits = num_splits or _default_splits(q.device, programs, triton.cdiv(N, PREFILL_BLOCK_N))
    _mqa_logits_kernel[(programs, splits)](
        q, k, ks, ke, k_scale, weights, logits,
        M, N, H,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1),
        weights.stride(0), weights.stride(1),
        logits.stride(0), logits.stride(1),
        k_scale.stride(0),
        splits,
        BLOCK_M=block_m, HP=hp, D=D, BLOCK_N=PREFILL_BLOCK_N,
        CLEAN=clean_logits, KEY_MAJOR=PREFILL_KEY_MAJOR,
        num_warps=PREFILL_WARPS, num_stages=PREFILL_STAGES, maxnreg=_launch_maxnreg(q.device),
    )
    return logits


# ----------------------------------------------------------------------------------------------
# Decode: MQA logits over the paged indexer K cache.
# ----------------------------------------------------------------------------------------------


def _per_token_context_lens(context_lens: torch.Tensor, batch: int, next_n: int) -> torch.Tensor:
    """[B, next_n] context length of each query token: 2D as given, or from 1D per-request
    lengths L as L - next_n + j + 1 (token j of the request's last next_n)."""
    if context_lens.dim() == 2:
        return context_lens
    j = torch.arange(next_n, device=context_lens.device, dtype=context_lens.dtype)
    return context_lens[:, None] - next_n + j[None, :] + 1


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, values_ptr, scales_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    H, NEXT_N, MAX_LEN, SCALE_OFF,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_vblk, stride_sblk,
    stride_wm, stride_wh,
    stride_cb, stride_cn,
    stride_btb,
    stride_om,
    SPLIT,
    NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CTX_2D: tl.constexpr, CLEAN: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    # KEY_MAJOR as in _mqa_logits_kernel: a [BLOCK_SIZE keys, rows] score tile
    b = tl.program_id(0)
    pid_s = tl.program_id(1)
    ROWS: tl.constexpr = NP * HP

    r = tl.arange(0, ROWS)
    j_of_row = r // HP
    head = r % HP
    row_ok = (j_of_row < NEXT_N) & (head < H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + j_of_row[:, None] * stride_qn
                + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    token = b.to(tl.int64) * NEXT_N + j_of_row
    w = tl.load(w_ptr + token * stride_wm + head * stride_wh, mask=row_ok, other=0.0)

    j = tl.arange(0, NP)
    j_ok = j < NEXT_N
    if CTX_2D:
        ctx = tl.load(ctx_ptr + b * stride_cb + j * stride_cn, mask=j_ok, other=0)
    else:
        ctx = tl.load(ctx_ptr + b * stride_cb) - NEXT_N + j + 1
    ctx = tl.minimum(tl.where(j_ok, ctx, 0), MAX_LEN)
    max_ctx = tl.max(ctx, axis=0)

    # The cache blocks below max_ctx in a loop without branches around the loads (Triton
    # pipelines only those); with CLEAN the rest of each row gets -inf after it.
    num_blocks = tl.cdiv(max_ctx, BLOCK_SIZE)
    pos = tl.arange(0, BLOCK_SIZE)
    if KEY_MAJOR:
        qt = tl.trans(q)
        out_tile = out_ptr + (b.to(tl.int64) * NEXT_N + j)[None, :] * stride_om  # [1, NP]
    else:
        out_tile = out_ptr + (b.to(tl.int64) * NEXT_N + j)[:, None] * stride_om  # [NP, 1]
    for blk in range(pid_s, num_blocks, SPLIT):
        n = blk * BLOCK_SIZE + pos
        phys = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + blk).to(tl.int64)
        kt = tl.load(values_ptr + phys * stride_vblk + pos[:, None] * D + d[None, :])
        ksc = tl.load(scales_ptr + phys * stride_sblk + SCALE_OFF + pos)
        if KEY_MAJOR:
            s = tl.dot(kt, qt, out_dtype=tl.float32)                           # [BLOCK_SIZE, ROWS]
            s = tl.maximum(s, 0.0) * w[None, :]
            logit = tl.sum(tl.reshape(s, (BLOCK_SIZE, NP, HP)), axis=2)        # [BLOCK_SIZE, NP]
            logit = logit * ksc[:, None]
            inside = n[:, None] < ctx[None, :]
            dest = out_tile + n[:, None]
            writable = j_ok[None, :] & (n[:, None] < MAX_LEN)
        else:
            s = tl.dot(q, tl.trans(kt), out_dtype=tl.float32)                  # [ROWS, BLOCK_SIZE]
            s = tl.maximum(s, 0.0) * w[:, None]
            logit = tl.sum(tl.reshape(s, (NP, HP, BLOCK_SIZE)), axis=1)        # [NP, BLOCK_SIZE]
            logit = logit * ksc[None, :]
            inside = n[None, :] < ctx[:, None]
            dest = out_tile + n[None, :]
            writable = j_ok[:, None] & (n[None, :] < MAX_LEN)
        if CLEAN:
            tl.store(dest, tl.where(inside, logit, float("-inf")), mask=writable)
        else:
            tl.store(dest, logit, mask=writable & inside)
    if CLEAN:
        for blk in range(num_blocks + pid_s, tl.cdiv(MAX_LEN, BLOCK_SIZE), SPLIT):
            n = blk * BLOCK_SIZE + pos
            if KEY_MAJOR:
                tl.store(out_tile + n[:, None], tl.full((BLOCK_SIZE, NP), float("-inf"), tl.float32),
                         mask=j_ok[None, :] & (n[:, None] < MAX_LEN))
            else:
                tl.store(out_tile + n[None, :], tl.full((NP, BLOCK_SIZE), float("-inf"), tl.float32),
                         mask=j_ok[:, None] & (n[None, :] < MAX_LEN))


def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor, max_model_len: int,
                     clean_logits: bool = False, num_splits: int | None = None) -> torch.Tensor:
    """MQA logits for decode, what DeepGEMM's `fp8_fp4_paged_mqa_logits` computes on FP8 inputs.

    q [B, next_n, H, D] float8_e4m3fn; kv_cache uint8 [num_blocks, block_size, (1,) D + 4] in
    the indexer layout (module docstring); weights [B * next_n, H] float32; context_lens int32
    [B] (per request: token j sees L - next_n + j + 1 keys) or [B, next_n] (per token);
    block_table int32 [B, max_blocks]. Returns [B * next_n, max_model_len] float32.
    """
    _check(q.dim() == 4, f"paged_mqa_logits: q must be [batch, next_n, heads, head_dim], got {tuple(q.shape)}")
    B, next_n, H, D = q.shape
    _check(q.dtype == FP8, f"paged_mqa_logits: q must be float8_e4m3fn, got {q.dtype}")
    _check(kv_cache.dtype == torch.uint8 and kv_cache.dim() in (3, 4) and kv_cache.shape[-1] == D + 4
           and (kv_cache.dim() == 3 or kv_cache.shape[2] == 1),
           f"paged_mqa_logits: kv_cache must be uint8 [blocks, block_size, (1,) {D + 4}], "
           f"got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[1]
    _check(block_size == triton.next_power_of_2(block_size) and block_size >= 16,
           f"paged_mqa_logits: block_size must be a power of two >= 16, got {block_size}")
    _check(kv_cache.stride(-1) == 1 and kv_cache.stride(1) == D + 4 and kv_cache.stride(0) % 4 == 0,
           f"paged_mqa_logits: each cache block must be contiguous with a 4-byte aligned block stride, "
           f"got strides {kv_cache.stride()}")
    _check(weights.shape == (B * next_n, H) and weights.dtype == torch.float32,
           f"paged_mqa_logits: weights must be float32 [{B * next_n}, {H}], got {weights.dtype} {tuple(weights.shape)}")
    _check(context_lens.dtype == torch.int32 and (context_lens.shape == (B,) or context_lens.shape == (B, next_n)),
           f"paged_mqa_logits: context_lens must be int32 [{B}] or [{B}, {next_n}], "
           f"got {context_lens.dtype} {tuple(context_lens.shape)}")
    _check(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == B
           and block_table.stride(1) == 1,
           f"paged_mqa_logits: block_table must be int32 [{B}, max_blocks] with unit column stride, "
           f"got {block_table.dtype} {tuple(block_table.shape)}")
    _check(max_model_len > 0, f"paged_mqa_logits: max_model_len must be positive, got {max_model_len}")
    _check(D == triton.next_power_of_2(D) and D >= 16,
           f"paged_mqa_logits: head_dim must be a power of two >= 16, got {D}")
    devices = {t.device for t in (q, kv_cache, weights, context_lens, block_table)}
    _check(len(devices) == 1, f"paged_mqa_logits: all inputs must be on one device, got {devices}")
    _check_device(q.device, "paged_mqa_logits")

    logits = torch.empty((B * next_n, max_model_len), dtype=torch.float32, device=q.device)
    if B == 0 or next_n == 0:
        return logits
    # The same memory seen as fp8 values and as float32 words; the kernel adds the offsets.
    _check(kv_cache.storage_offset() % 4 == 0,
           f"paged_mqa_logits: kv_cache must start 4-byte aligned, storage offset {kv_cache.storage_offset()}")
    values = kv_cache.view(FP8)
    scales = kv_cache.view(torch.float32)
    blk_bytes = kv_cache.stride(0)
    ctx2d = context_lens.dim() == 2
    np_ = triton.next_power_of_2(next_n)
    hp = triton.next_power_of_2(H)
    blocks = triton.cdiv(max_model_len, block_size)
    splits = num_splits or _default_splits(q.device, B, blocks)
    _paged_mqa_logits_kernel[(B, splits)](
        q, values, scales, weights, context_lens, block_table, logits,
        H, next_n, max_model_len, (block_size * D) // 4,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        blk_bytes, blk_bytes // 4,
        weights.stride(0), weights.stride(1),
        context_lens.stride(0), context_lens.stride(1) if ctx2d else 0,
        block_table.stride(0),
        logits.stride(0),
        splits,
        NP=np_, HP=hp, D=D, BLOCK_SIZE=block_size,
        CTX_2D=ctx2d, CLEAN=clean_logits, KEY_MAJOR=DECODE_KEY_MAJOR,
        num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
    )
    return logits


# ----------------------------------------------------------------------------------------------
# Top-k per row.
# ----------------------------------------------------------------------------------------------


def decode_row_ends(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Per logits row (b * next_n + j), the exclusive end of its key range for paged decode."""
    return _per_token_context_lens(context_lens, context_lens.shape[0], next_n).reshape(-1)


@triton.jit
def _ordered_key(bits):
    """Float order as signed int32 order: flip the 31 low bits of negative floats."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _digit_histogram(key, ok, prefix, PASS: tl.constexpr):
    """The 256-bin histogram of pass PASS's byte (the highest first) over the keys that match
    the bytes already chosen (`prefix`)."""
    shift = 24 - 8 * PASS
    high = 0 if PASS == 0 else -(1 << (32 - 8 * PASS))  # the bits already decided
    digit = (key >> shift) & 0xFF
    if PASS == 0:
        digit = digit ^ 0x80  # the sign byte: order it as unsigned
    return tl.histogram(digit, 256, mask=ok & ((key & high) == prefix))


@triton.jit
def _choose_digit_counted(hist, prefix, remaining, PASS: tl.constexpr):
    """The byte of the TOPK-th largest key in this pass, how many at the new prefix are still
    to take, and how many keys have the new prefix (the chosen bin's count)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist   # elements with digit >= bin
    chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
    remaining -= tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    if PASS == 0:
        chosen = chosen ^ 0x80
    return prefix | (chosen << (24 - 8 * PASS)), remaining, in_bin


@triton.jit
def _choose_digit(hist, prefix, remaining, PASS: tl.constexpr):
    """The byte of the TOPK-th largest key in this pass, and how many at the new prefix are still to take."""
    prefix, remaining, _ = _choose_digit_counted(hist, prefix, remaining, PASS)
    return prefix, remaining


@triton.jit
def _topk_one_block(src, dst, start, end, length, TOPK, stride_lc, BLOCK: tl.constexpr, EARLY_STOP: tl.constexpr):
    """The select of one range of at most BLOCK keys, read once and kept in registers for all
    passes; the passes stop as soon as the chosen bin is taken whole (random float32 rows of a
    few thousand: after the second or third byte), which also leaves no ties to rank."""
    lanes = tl.arange(0, BLOCK)
    i = start + lanes
    ok = i < end
    key = _ordered_key(tl.load(src + i * stride_lc, mask=ok, other=0.0).to(tl.int32, bitcast=True))
    # int32 scalars from the start: the passes below run under a branch that rewrites them
    prefix = length * 0
    remaining = length * 0 + TOPK  # how many of the elements matching `prefix` are still to take
    whole_bin = length < 0  # becomes True once every key at the chosen prefix is taken: stop early
    for p in tl.static_range(4):
        if not whole_bin:
            prefix, remaining, in_bin = _choose_digit_counted(
                _digit_histogram(key, ok, prefix, p), prefix, remaining, p)
            if EARLY_STOP:
                whole_bin = in_bin == remaining
    if whole_bin:
        # prefix's undecided low bits are 0, so key >= prefix is "at or above the chosen
        # bin", exactly TOPK keys: no ties to rank
        take = ok & (key >= prefix)
    else:
        tie = ok & (key == prefix)
        take = (ok & (key > prefix)) | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= remaining))
    tl.store(dst + tl.cumsum(take.to(tl.int32), 0) - 1, lanes, mask=take)


@triton.jit(do_not_specialize=["N"])  # a prefill chunk's key count (see LOGITS_ROW_ALIGN)
def _topk_kernel(
    logits_ptr, starts_ptr, ends_ptr, out_ptr,
    N, TOPK,
    stride_lr, stride_lc, stride_or,
    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, EARLY_STOP: tl.constexpr,
    SHORT_RANGES: tl.constexpr,
):
    """One row per program: exact radix select of the TOPK-th largest logit in [start, end)
    (four 8-bit histogram passes over the row), then one pass writing the positions of
    everything above it and of the first ties at it, relative to start. A range of at most
    BLOCK keys takes _topk_one_block: always with ONE_BLOCK (every row within BLOCK,
    N <= BLOCK: the streaming code is not compiled), else with SHORT_RANGES when the row's own
    range is that short (prefill: each token's range, its request's keys, is a short slice of
    a row as long as the chunk's keys)."""
    row = tl.program_id(0).to(tl.int64)
    start = 0
    if HAS_STARTS:
        start = tl.load(starts_ptr + row)
    end = tl.minimum(tl.load(ends_ptr + row), N)
    length = tl.maximum(end - start, 0)
    src = logits_ptr + row * stride_lr
    dst = out_ptr + row * stride_or
    lanes = tl.arange(0, BLOCK)

    if length <= TOPK:
        # Every position of the range, then -1.
        for c in range(0, TOPK, BLOCK):
            i = c + lanes
            tl.store(dst + i, tl.where(i < length, i, -1), mask=i < TOPK)
    elif ONE_BLOCK:
        _topk_one_block(src, dst, start, end, length, TOPK, stride_lc, BLOCK, EARLY_STOP)
    elif SHORT_RANGES and length <= BLOCK:
        _topk_one_block(src, dst, start, end, length, TOPK, stride_lc, BLOCK, EARLY_STOP)
    else:
        prefix = 0
        remaining = TOPK
        for p in tl.static_range(4):
            hist = tl.zeros((256,), tl.int32)
            for c in range(start, end, BLOCK):
                i = c + lanes
                ok = i < end
                key = _ordered_key(tl.load(src + i * stride_lc, mask=ok, other=0.0).to(tl.int32, bitcast=True))
                hist += _digit_histogram(key, ok, prefix, p)
            prefix, remaining = _choose_digit(hist, prefix, remaining, p)
        # prefix is now the exact key of the TOPK-th largest; take all above and `remaining` equal.
        written = 0
        ties = 0
        for c in range(start, end, BLOCK):
            i = c + lanes
            ok = i < end
            key = _ordered_key(tl.load(src + i * stride_lc, mask=ok, other=0.0).to(tl.int32, bitcast=True))
            above = ok & (key > prefix)
            tie = ok & (key == prefix)
            tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
            take = above | (tie & (tie_rank < remaining))
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(dst + slot, i - start, mask=take)
            written += tl.sum(take.to(tl.int32), axis=0)
            ties += tl.sum(tie.to(tl.int32), axis=0)


TOPK_BLOCK = 4096
TOPK_WARPS = 8


# Fewer rows than about two per SM, each longer than one block (decode at long contexts), leave
# SMs idle with one program per row: there the same radix select runs split, each row's range
# shared by several programs, one launch per histogram pass (histograms merged with atomics),
# one to choose each pass's digit, one to write. Ties at the k-th value are then taken in no
# fixed order (the set's size is still exact). H200, topk 2048 (docs/perf-indexer.md, top-k
# launch rule): 32 rows x 100k 344 -> 104 us split 8 ways, 32 x 16k 57 -> 32 us, 4 x 100k 343 -> 32 us.


@triton.jit
def _topk_split_hist_kernel(
    logits_ptr, starts_ptr, ends_ptr, hist_ptr, state_ptr,
    N, TOPK, stride_lr, stride_lc, SPLIT,
    PASS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    start = 0
    if HAS_STARTS:
        start = tl.load(starts_ptr + row)
    end = tl.minimum(tl.load(ends_ptr + row), N)
    if end - start > TOPK:
        prefix = 0
        if PASS > 0:
            prefix = tl.load(state_ptr + row * 2)
        lanes = tl.arange(0, BLOCK)
        hist = tl.zeros((256,), tl.int32)
        for c in range(start + pid_s * BLOCK, end, SPLIT * BLOCK):
            i = c + lanes
            ok = i < end
            bits = tl.load(logits_ptr + row * stride_lr + i * stride_lc, mask=ok, other=0.0).to(tl.int32, bitcast=True)
            hist += _digit_histogram(_ordered_key(bits), ok, prefix, PASS)
        tl.atomic_add(hist_ptr + row * 256 + tl.arange(0, 256), hist, sem="relaxed")


@triton.jit
def _topk_split_choose_kernel(hist_ptr, state_ptr, TOPK, PASS: tl.constexpr):
    """Per row: the digit of this pass, the prefix and count still to take (state), and a
    zeroed histogram for the next pass."""
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + row * 256 + bins)
    prefix = 0
    remaining = TOPK
    if PASS > 0:
        prefix = tl.load(state_ptr + row * 2)
        remaining = tl.load(state_ptr + row * 2 + 1)
    prefix, remaining = _choose_digit(hist, prefix, remaining, PASS)
    tl.store(state_ptr + row * 2, prefix)
    tl.store(state_ptr + row * 2 + 1, remaining)
    tl.store(hist_ptr + row * 256 + bins, tl.zeros((256,), tl.int32))


@triton.jit
def _topk_split_select_kernel(
    logits_ptr, starts_ptr, ends_ptr, state_ptr, count_ptr, out_ptr,
    N, TOPK, stride_lr, stride_lc, stride_or, SPLIT,
    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    start = 0
    if HAS_STARTS:
        start = tl.load(starts_ptr + row)
    end = tl.minimum(tl.load(ends_ptr + row), N)
    length = tl.maximum(end - start, 0)
    dst = out_ptr + row * stride_or
    lanes = tl.arange(0, BLOCK)
    if length <= TOPK:
        for c in range(pid_s * BLOCK, TOPK, SPLIT * BLOCK):
            i = c + lanes
            tl.store(dst + i, tl.where(i < length, i, -1), mask=i < TOPK)
    else:
        threshold = tl.load(state_ptr + row * 2)
        remaining = tl.load(state_ptr + row * 2 + 1)
        for c in range(start + pid_s * BLOCK, end, SPLIT * BLOCK):
            i = c + lanes
            ok = i < end
            bits = tl.load(logits_ptr + row * stride_lr + i * stride_lc, mask=ok, other=0.0).to(tl.int32, bitcast=True)
            key = _ordered_key(bits)
            above = ok & (key > threshold)
            tie = ok & (key == threshold)
            n_above = tl.sum(above.to(tl.int32), axis=0)
            n_tie = tl.sum(tie.to(tl.int32), axis=0)
            first_above = tl.atomic_add(count_ptr + row * 2, n_above, sem="relaxed")
            first_tie = tl.atomic_add(count_ptr + row * 2 + 1, n_tie, sem="relaxed")
            tl.store(dst + first_above + tl.cumsum(above.to(tl.int32), 0) - 1, i - start, mask=above)
            tie_rank = first_tie + tl.cumsum(tie.to(tl.int32), 0) - 1
            take = tie & (tie_rank < remaining)
            tl.store(dst + (TOPK - remaining) + tie_rank, i - start, mask=take)




def top_k_per_row(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, topk: int,
                  out: torch.Tensor | None = None, splits: int | None = None,
                  one_block: bool | None = None, early_stop: bool = True,
                  num_warps: int = TOPK_WARPS) -> torch.Tensor:
    """Top-k of each logits row inside [starts[r], ends[r]) (starts None: 0), as positions
    relative to the start, int32 [rows, topk], -1 past the range's length. Triton radix select.

    Reads only the range, so logits made with clean_logits=False are fine; the range's own
    values must not be NaN. `splits` programs share each row (default: one a row's 4096-block, at
    most about two programs per SM in all, so 1 for rows within one block or for 264+ rows on
    132 SMs); with one, ties at the k-th value go to the lowest positions. No host
    synchronisation (CUDA graphs). A range of at most TOPK_BLOCK keys is kept in registers across
    the passes instead of being read five times: `one_block` (default: when every row fits one
    TOPK_BLOCK, i.e. decode at contexts up to 4096 tokens) compiles only that path; otherwise
    each row whose own range is that short takes it at run time (prefill: a token's range is its
    request's keys, in rows as long as the chunk's); False forces the streaming passes for every
    row (tests, benchmarks).
    `early_stop` (one-block rows; False only to compare) ends the passes once the chosen bin
    is taken whole; `num_warps` is the one-program-a-row kernel's width (benchmarks).
    """
    rows, n, out = _check_topk_args(logits, starts, ends, topk, out)
    short_ranges = one_block is not False
    if one_block is None:
        one_block = n <= TOPK_BLOCK
    _check(not one_block or n <= TOPK_BLOCK, f"top_k_per_row: one_block needs rows of at most {TOPK_BLOCK}, got {n}")
    if rows == 0:
        return out
    _check(logits.stride(1) == 1 or n == 1, "top_k_per_row: logits rows must be contiguous")
    _check(out.stride(1) == 1, "top_k_per_row: out rows must be contiguous")
    _check(ends.dtype == torch.int32 and (starts is None or starts.dtype == torch.int32),
           "top_k_per_row: starts and ends must be int32")
    if splits is None:
        splits = 1
        if logits.device.type == "cuda":
            splits = max(1, min(triton.cdiv(n, TOPK_BLOCK), (2 * _num_sms(logits.device.index or 0)) // rows))
    starts_arg = ends if starts is None else starts
    if splits == 1:
        _topk_kernel[(rows,)](
            logits, starts_arg, ends, out,
            n, topk,
            logits.stride(0), logits.stride(1), out.stride(0),
            HAS_STARTS=starts is not None, BLOCK=TOPK_BLOCK, ONE_BLOCK=one_block, EARLY_STOP=early_stop,
            SHORT_RANGES=short_ranges,
            num_warps=num_warps,
        )
        return out
    hist = torch.zeros((rows, 256), dtype=torch.int32, device=logits.device)
    state = torch.zeros((rows, 2), dtype=torch.int32, device=logits.device)
    counts = torch.zeros((rows, 2), dtype=torch.int32, device=logits.device)
    for p in range(4):
        _topk_split_hist_kernel[(rows, splits)](
            logits, starts_arg, ends, hist, state, n, topk, logits.stride(0), logits.stride(1), splits,
            PASS=p, HAS_STARTS=starts is not None, BLOCK=TOPK_BLOCK, num_warps=TOPK_WARPS)
        _topk_split_choose_kernel[(rows,)](hist, state, topk, PASS=p, num_warps=1)
    _topk_split_select_kernel[(rows, splits)](
        logits, starts_arg, ends, state, counts, out, n, topk,
        logits.stride(0), logits.stride(1), out.stride(0), splits,
        HAS_STARTS=starts is not None, BLOCK=TOPK_BLOCK, num_warps=TOPK_WARPS)
    return out


def _check_topk_args(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, topk: int,
                     out: torch.Tensor | None) -> tuple[int, int, torch.Tensor]:
    _check(logits.dim() == 2 and logits.dtype == torch.float32,
           f"top_k_per_row: logits must be float32 [rows, keys], got {logits.dtype} {tuple(logits.shape)}")
    rows, n = logits.shape
    _check(topk > 0, f"top_k_per_row: topk must be positive, got {topk}")
    _check(ends.shape == (rows,), f"top_k_per_row: ends must be [{rows}], got {tuple(ends.shape)}")
    _check(starts is None or starts.shape == (rows,),
           f"top_k_per_row: starts must be [{rows}], got {None if starts is None else tuple(starts.shape)}")
    if out is None:
        out = torch.empty((rows, topk), dtype=torch.int32, device=logits.device)
    _check(out.shape[0] >= rows and out.shape[1] == topk and out.dtype == torch.int32,
           f"top_k_per_row: out must be int32 [{rows}, {topk}], got {out.dtype} {tuple(out.shape)}")
    return rows, n, out


def top_k_per_row_torch(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, topk: int,
                        out: torch.Tensor | None = None, max_chunk_bytes: int = 256 << 20) -> torch.Tensor:
    """`top_k_per_row` through torch.topk (runs wherever torch does; slower), on a masked copy
    made in row chunks of at most `max_chunk_bytes`."""
    rows, n, out = _check_topk_args(logits, starts, ends, topk, out)
    if rows == 0:
        return out
    k = min(topk, n)
    if k < topk:
        out[:rows, k:] = -1
    if k == 0:
        return out
    cols = torch.arange(n, device=logits.device)
    rank = torch.arange(k, device=logits.device)
    step = max(1, max_chunk_bytes // max(1, n * 4))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        start = torch.zeros(r1 - r0, dtype=torch.int64, device=logits.device) if starts is None \
            else starts[r0:r1].long()
        end = ends[r0:r1].long().clamp(max=n)
        inside = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
        masked = torch.where(inside, logits[r0:r1], NEG_INF)
        idx = torch.topk(masked, k, dim=1, sorted=True).indices
        count = (end - start).clamp(min=0)
        rel = torch.where(rank[None, :] < count[:, None], idx - start[:, None], -1)
        out[r0:r1, :k] = rel.to(torch.int32)
    return out
