"""Sparse MLA attention (DeepSeek Sparse Attention) for vLLM's TRITON_MLA_SPARSE backend.

The contract is the one of vLLM 0.20.2's FlashMLA sparse calls (DESIGN.md section 4):

    q        [s_q, h_q, 576] bf16 (any strides)
    kv       [s_kv, 1, 576] bf16, or the fp8_ds_mla cache: uint8 [num_blocks, 64, 1, 656]
    indices  [s_q, 1, topk] int32 global slot ids; -1 or >= s_kv means "no token"
    out      [s_q, h_q, 512] bf16 = softmax(q . K[idx]^T * sm_scale) @ K[idx][:, :512]
    lse      [s_q, h_q] float32, natural log; +inf (and out 0) for a row with no valid index

fp8_ds_mla: 656 bytes per token. Bytes 0-511: 512 float8_e4m3 values; 512-527: four
float32 scales, one per 128 values (x = fp8 * scale); 528-655: the 64 bf16 RoPE values.

This module holds the readable float32 references, the fp8_ds_mla quantiser, and the
public entry points. It imports only torch and triton.
"""

from __future__ import annotations

import torch

D_NOPE = 512  # latent part of a token: the value vector
D_ROPE = 64  # RoPE part, only in the key
D_QK = D_NOPE + D_ROPE  # 576
FP8_GROUP = 128  # values per fp8 scale
FP8_GROUPS = D_NOPE // FP8_GROUP  # 4
FP8_MAX = 448.0  # largest float8_e4m3fn value
FP8_AMAX_FLOOR = 1e-4  # a tile of zeros still gets a finite scale
FP8_TOKEN_BYTES = D_NOPE + 4 * FP8_GROUPS + 2 * D_ROPE  # 656
FP8_SCALE_OFFSET = D_NOPE  # 512
FP8_ROPE_OFFSET = D_NOPE + 4 * FP8_GROUPS  # 528
FP8_BLOCK_SIZE = 64  # tokens per cache block for fp8_ds_mla


# --------------------------------------------------------------------------------------
# fp8_ds_mla layout
# --------------------------------------------------------------------------------------

def quantize_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """Pack tokens [..., 576] (bf16 or float32) into the fp8_ds_mla layout, uint8 [..., 656].

    Each group of 128 latent values gets one float32 scale: its absolute maximum (at least
    1e-4) divided by 448 and rounded up to a power of two, so every value fits float8_e4m3
    without saturating. The RoPE part is stored as bf16, unquantised.
    """
    if kv.shape[-1] != D_QK:
        raise ValueError(f"quantize_fp8_ds_mla: last dim must be {D_QK}, got {tuple(kv.shape)}")
    if not kv.is_floating_point():
        raise TypeError(f"quantize_fp8_ds_mla: expected a float tensor, got {kv.dtype}")
    lead = kv.shape[:-1]
    x = kv.reshape(-1, D_QK).float()
    nope = x[:, :D_NOPE].reshape(-1, FP8_GROUPS, FP8_GROUP)
    amax = nope.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)  # [n, 4]
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))  # power of two, scale*448 >= amax
    fp8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).reshape(-1, D_NOPE)
    rope = x[:, D_NOPE:].to(torch.bfloat16)
    packed = torch.cat([fp8.view(torch.uint8), scale.contiguous().view(torch.uint8),
                        rope.contiguous().view(torch.uint8)], dim=-1)
    return packed.reshape(*lead, FP8_TOKEN_BYTES)


def dequantize_fp8_ds_mla(cache: torch.Tensor) -> torch.Tensor:
    """Unpack fp8_ds_mla tokens uint8 [..., 656] into float32 [..., 576] (exact)."""
    if cache.dtype != torch.uint8 or cache.shape[-1] != FP8_TOKEN_BYTES:
        raise ValueError(f"dequantize_fp8_ds_mla: expected uint8 [..., {FP8_TOKEN_BYTES}], "
                         f"got {cache.dtype} {tuple(cache.shape)}")
    lead = cache.shape[:-1]
    rows = cache.reshape(-1, FP8_TOKEN_BYTES).contiguous()
    fp8 = rows[:, :D_NOPE].view(torch.float8_e4m3fn).float().reshape(-1, FP8_GROUPS, FP8_GROUP)
    scale = rows[:, FP8_SCALE_OFFSET:FP8_ROPE_OFFSET].contiguous().view(torch.float32)
    rope = rows[:, FP8_ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    nope = (fp8 * scale[..., None]).reshape(-1, D_NOPE)
    return torch.cat([nope, rope], dim=-1).reshape(*lead, D_QK)


# --------------------------------------------------------------------------------------
# references (float32, readable; the tests' ground truth)
# --------------------------------------------------------------------------------------

def _attend_reference(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, sm_scale: float,
                      d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s_q, h, 576], k [s_q, topk, 576] (the gathered keys), valid [s_q, topk] bool."""
    k = torch.where(valid[..., None], k.float(), 0.0)  # invalid rows never contribute (even NaN)
    logits = torch.einsum("shd,std->sht", q.float(), k) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf where nothing is valid
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)  # rows with no valid index: 0
    out = torch.einsum("sht,std->shd", probs, k[..., :d_v])
    lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    return out, lse


def reference_sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA in float32 with torch: (out [s_q, h_q, d_v] float32, lse [s_q, h_q] float32)."""
    _check_common(q, indices, d_v)
    _check_bf16_kv(kv, q)
    s_kv = kv.shape[0]
    idx = indices[:, 0, :].long()
    valid = (idx >= 0) & (idx < s_kv)
    k = kv[:, 0, :][idx.clamp(0, max(s_kv - 1, 0))] if s_kv else q.new_zeros(*idx.shape, D_QK)
    return _attend_reference(q, k, valid, sm_scale, d_v)


def reference_sparse_mla_fp8(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                             sm_scale: float, d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over an fp8_ds_mla cache, in float32 with torch (dequantise, then attend)."""
    _check_common(q, indices, d_v)
    rows = _fp8_rows(kv_cache, q)
    n_slots = rows.shape[0]
    idx = indices[:, 0, :].long()
    valid = (idx >= 0) & (idx < n_slots)
    k = dequantize_fp8_ds_mla(rows[idx.clamp(0, max(n_slots - 1, 0))])
    return _attend_reference(q, k, valid, sm_scale, d_v)


# --------------------------------------------------------------------------------------
# input checks (clear errors, before anything is launched)
# --------------------------------------------------------------------------------------

def _check_common(q: torch.Tensor, indices: torch.Tensor, d_v: int) -> None:
    if d_v != D_NOPE:
        raise ValueError(f"sparse MLA: d_v must be {D_NOPE}, got {d_v}")
    if q.dim() != 3 or q.shape[-1] != D_QK:
        raise ValueError(f"sparse MLA: q must be [s_q, h_q, {D_QK}], got {tuple(q.shape)}")
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
# public entry points
# --------------------------------------------------------------------------------------

def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                   d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with a bf16 KV cache: (out [s_q, h_q, 512] bf16, lse [s_q, h_q] float32)."""
    out, lse = reference_sparse_mla(q, kv, indices, sm_scale, d_v)
    return out.to(torch.bfloat16), lse


def sparse_mla_fwd_fp8(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                       sm_scale: float, d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over an fp8_ds_mla cache: (out [s_q, h_q, 512] bf16, lse [s_q, h_q] float32)."""
    out, lse = reference_sparse_mla_fp8(q, kv_cache, indices, sm_scale, d_v)
    return out.to(torch.bfloat16), lse
