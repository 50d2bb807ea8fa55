"""The kernels' test oracles: readable torch references and the KV-cache writers tests build caches with.

What the kernels compute (mlafleet/kernels/sparse_mla.py, indexer.py), written the plain way in
float32 (sparse MLA) or float64 (the indexer), and the fp8 cache layouts written from their
description, not from the kernels: the tests compare the kernels with these, and the benchmarks
check their outputs with them before timing. Nothing in mlafleet imports this module, and the
patch sets do not ship it.

It imports only torch, so the same file serves the controller's tests (`import oracles`:
tests/kernels is on pytest's path), the scripts run in the vLLM installs
(tests/vllm_side/backend_forward.py, the indexer scripts of tests/kernels/test_indexer_vllm*.py)
and bench/ (`from tests.kernels import oracles`, the repository on PYTHONPATH).

Sparse MLA:

    out[t, h] = softmax_j(q[t, h] . K[idx[t, j]] * sm_scale) @ K[idx[t, j]][:512]

over the valid indices j of token t (0 <= idx < the cache's slots); lse = the log-sum-exp of
those logits, +inf (and out 0) for a row with no valid index. fp8_ds_mla: 656 bytes a token,
bytes 0-511 float8_e4m3 values, 512-527 four float32 scales (one per 128 values, x = fp8 * scale),
528-655 the 64 bf16 RoPE values. vLLM's plain fp8 MLA cache: 576 float8_e4m3 values a token,
one float32 scale for the layer.

The DSA indexer (logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n]), -inf
outside each row's key range) and its per-row top-k.
"""

from __future__ import annotations

import torch

D_NOPE = 512  # the latent part of a token: the value vector
D_QK = 576  # latent + 64 RoPE values
FP8_GROUP = 128  # values per fp8_ds_mla scale
FP8_GROUPS = D_NOPE // FP8_GROUP
FP8_MAX = 448.0  # the largest float8_e4m3fn value
FP8_AMAX_FLOOR = 1e-4  # a group of zeros still gets a finite scale
FP8_TOKEN_BYTES = 656
FP8_SCALE_OFFSET = 512
FP8_ROPE_OFFSET = 528
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------
# KV-cache writers
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


def quantize_fp8_e4m3(kv: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, float]:
    """A plain fp8 cache of kv [..., 576]: (float8_e4m3fn values x, scale), kv ~ x * scale.

    One scale for the whole cache (vLLM's per-layer k_scale), by default amax / 448."""
    if scale is None:
        scale = max(float(kv.float().abs().nan_to_num(0.0).amax()), FP8_AMAX_FLOOR) / FP8_MAX
    return (kv.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# --------------------------------------------------------------------------------------
# sparse MLA (float32)
# --------------------------------------------------------------------------------------

def _attend(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, sm_scale: float,
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


def _gather(rows: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [slots, width] at indices [s_q, 1, topk] (any row where the index is invalid), and
    which indices are valid (0 <= idx < slots)."""
    slots = rows.shape[0]
    idx = indices[:, 0, :].long()
    valid = (idx >= 0) & (idx < slots)
    return (rows[idx.clamp(0, max(slots - 1, 0))] if slots else rows.new_zeros(*idx.shape, rows.shape[1])), valid


def reference_sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a bf16 cache [s_kv, 1, 576]: (out [s_q, h_q, d_v], lse [s_q, h_q]), float32."""
    k, valid = _gather(kv.reshape(-1, D_QK), indices)
    return _attend(q, k, valid, sm_scale, d_v)


def reference_sparse_mla_fp8(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                             sm_scale: float, d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over an fp8_ds_mla cache (any shape [..., 656]): gather, dequantise, attend."""
    rows, valid = _gather(kv_cache.reshape(-1, FP8_TOKEN_BYTES), indices)
    return _attend(q, dequantize_fp8_ds_mla(rows), valid, sm_scale, d_v)


def reference_sparse_mla_fp8_e4m3(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                                  sm_scale: float, kv_scale: float,
                                  d_v: int = D_NOPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a plain fp8 cache [..., 576] (float8_e4m3fn or its bytes) with one scale."""
    keys = kv_cache.view(torch.float8_e4m3fn).reshape(-1, D_QK).float() * float(kv_scale)
    k, valid = _gather(keys, indices)
    return _attend(q, k, valid, sm_scale, d_v)


# --------------------------------------------------------------------------------------
# the DSA indexer (float64)
# --------------------------------------------------------------------------------------

def mqa_logits_reference(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                         weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """Prefill logits: [M, N] float32, -inf outside each row's [ks, ke)."""
    qf = q.to(torch.float64)                                   # [M, H, D]
    kf = k.to(torch.float64)                                   # [N, D]
    scores = torch.einsum("mhd,nd->mhn", qf, kf).clamp_min(0)  # relu
    logits = (scores * weights.to(torch.float64)[:, :, None]).sum(dim=1)
    logits = logits * k_scale.to(torch.float64)[None, :]
    n = torch.arange(k.shape[0], device=q.device)[None, :]
    inside = (n >= ks.long()[:, None]) & (n < ke.long()[:, None])
    return logits.masked_fill(~inside, NEG_INF).to(torch.float32)


def split_kv_cache(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer cache's fp8 values [num_blocks, block_size, D] and float32 scales
    [num_blocks, block_size]: a block holds its block_size * D values, then its block_size scales."""
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    flat = kv_cache.reshape(num_blocks, block_size, -1).flatten(1)   # [blocks, block_size * (D + 4)]
    values = flat[:, : block_size * head_dim].view(torch.float8_e4m3fn).reshape(num_blocks, block_size, head_dim)
    scales = flat[:, block_size * head_dim:].contiguous().view(torch.float32)
    return values, scales


def paged_mqa_logits_reference(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                               context_lens: torch.Tensor, block_table: torch.Tensor,
                               max_model_len: int) -> torch.Tensor:
    """Decode logits over the paged cache: [B * next_n, max_model_len] float32, -inf past each
    row's context. context_lens: [B, next_n] per query token, or [B] per request (token j of its
    last next_n sees L - next_n + j + 1 keys)."""
    B, next_n, H, D = q.shape
    values, scales = split_kv_cache(kv_cache, D)
    block_size = values.shape[1]
    out = torch.full((B * next_n, max_model_len), NEG_INF, dtype=torch.float32, device=q.device)
    for b in range(B):
        for j in range(next_n):
            length = int(context_lens[b, j]) if context_lens.dim() == 2 else int(context_lens[b]) - next_n + j + 1
            if length <= 0:
                continue
            pos = torch.arange(length, device=q.device)
            phys = block_table[b, pos // block_size].long()
            keys = values[phys, pos % block_size].to(torch.float64)       # [L, D]
            ksc = scales[phys, pos % block_size].to(torch.float64)        # [L]
            s = (q[b, j].to(torch.float64) @ keys.T).clamp_min(0)         # [H, L]
            row = (s * weights[b * next_n + j].to(torch.float64)[:, None]).sum(0) * ksc
            out[b * next_n + j, :length] = row.to(torch.float32)
    return out


def top_k_per_row_reference(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor,
                            topk: int) -> list[set[int]]:
    """Per row, the set of positions (relative to start) of the topk largest logits in range."""
    result = []
    for row in range(logits.shape[0]):
        s = 0 if starts is None else int(starts[row])
        e = int(ends[row])
        vals = logits[row, s:max(s, e)].to(torch.float64)
        order = torch.argsort(vals, descending=True, stable=True)[:topk]
        result.append({int(i) for i in order})
    return result
