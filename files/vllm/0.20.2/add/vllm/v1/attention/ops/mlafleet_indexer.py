# SPDX-License-Identifier: Apache-2.0
"""mlafleet: the DSA indexer without DeepGEMM, for GPUs DeepGEMM does not run on (SM12x).

vLLM 0.20.2's sparse attention indexer (GLM-5, DeepSeek-V3.2) scores cache positions with
DeepGEMM's `fp8_fp4_mqa_logits` / `fp8_fp4_paged_mqa_logits` and picks the top-k with
`torch.ops._C` kernels. DeepGEMM runs on compute capability 9.x and 10.x only. The patch
set points the indexer's calls at the functions below, which keep vLLM's own path where
DeepGEMM runs and otherwise use mlafleet's Triton kernels
(`vllm.third_party.mlafleet_kernels.indexer`, shipped by the patch set).

One decision, `use_deepgemm_free_indexer(capability, deep_gemm_installed)`:
  - MLAFLEET_INDEXER_FALLBACK=1 forces the DeepGEMM-free path (to test it on SM90);
  - otherwise the DeepGEMM-free path is taken when DeepGEMM is not installed or the
    device's major compute capability is not 9 or 10.
Top-k on the DeepGEMM-free path, `topk_implementation(capability)`: vLLM's
`top_k_per_row_prefill` / `top_k_per_row_decode` where they are known to run (capability 9.x
and 10.x, where vLLM ships them tested; never `persistent_topk`, whose shared-memory plan does
not fit SM120), mlafleet's Triton radix select elsewhere. MLAFLEET_INDEXER_TOPK=vllm|triton|torch
overrides the choice (torch: torch.topk, slower, runs wherever torch runs).
"""

from __future__ import annotations

import functools
import os

import torch

FALLBACK_ENV = "MLAFLEET_INDEXER_FALLBACK"
TOPK_ENV = "MLAFLEET_INDEXER_TOPK"
DEEPGEMM_MAJORS = (9, 10)


def _forced() -> bool:
    value = os.environ.get(FALLBACK_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FALLBACK_ENV} must be 1 (force the DeepGEMM-free indexer) or 0/unset, got {value!r}")
    return value == "1"


def use_deepgemm_free_indexer(capability: tuple[int, int], deep_gemm_installed: bool = True) -> bool:
    """True when the DSA indexer must run without DeepGEMM on a device of this capability."""
    if _forced() or not deep_gemm_installed:
        return True
    return int(capability[0]) not in DEEPGEMM_MAJORS


TOPK_IMPLEMENTATIONS = ("vllm", "triton", "torch")


def topk_implementation(capability: tuple[int, int]) -> str:
    """On the DeepGEMM-free path, whose top-k: 'vllm' (torch.ops._C), 'triton' or 'torch' (mlafleet)."""
    value = os.environ.get(TOPK_ENV, "")
    if value and value not in TOPK_IMPLEMENTATIONS:
        raise ValueError(f"{TOPK_ENV} must be one of {', '.join(TOPK_IMPLEMENTATIONS)} (or unset), got {value!r}")
    if value:
        return value
    return "vllm" if int(capability[0]) in DEEPGEMM_MAJORS else "triton"


@functools.cache
def _device_capability() -> tuple[int, int] | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None  # ROCm, XPU and CPU keep their own indexer paths
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


@functools.cache
def deepgemm_free_indexer_active() -> bool:
    """The decision for this process's device (False off CUDA)."""
    from vllm.logger import init_logger
    from vllm.utils.import_utils import has_deep_gemm

    capability = _device_capability()
    if capability is None:
        return False
    active = use_deepgemm_free_indexer(capability, has_deep_gemm())
    if active:
        init_logger(__name__).info(
            "DSA indexer: DeepGEMM-free path (mlafleet Triton MQA logits, %s top-k) on compute capability %d.%d",
            topk_implementation(capability), *capability)
    return active


@functools.cache
def _topk_impl() -> str:
    capability = _device_capability()
    return "vllm" if capability is None else topk_implementation(capability)


def _mlafleet_topk():
    kernels = _kernels()
    return kernels.top_k_per_row_torch if _topk_impl() == "torch" else kernels.top_k_per_row


def _kernels():
    from vllm.third_party.mlafleet_kernels import indexer

    return indexer


def _fp8_only(q: tuple[torch.Tensor, torch.Tensor | None], what: str) -> torch.Tensor:
    values, scale = q
    if scale is not None:
        raise NotImplementedError(
            f"{what}: the DeepGEMM-free indexer supports the FP8 indexer cache only; "
            "use_fp4_indexer_cache needs DeepGEMM on SM100")
    return values


# -- DeepGEMM's entry points, as vllm.utils.deep_gemm names them ------------------------------


def fp8_fp4_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv: tuple[torch.Tensor, torch.Tensor],
                       weights: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                       clean_logits: bool) -> torch.Tensor:
    if not deepgemm_free_indexer_active():
        from vllm.utils import deep_gemm

        return deep_gemm.fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits)
    k, k_scale = kv
    return _kernels().mqa_logits(_fp8_only(q, "fp8_fp4_mqa_logits"), k, k_scale, weights,
                                 cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits)


def fp8_fp4_paged_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv_cache: torch.Tensor,
                             weights: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                             schedule_metadata: torch.Tensor, max_model_len: int,
                             clean_logits: bool) -> torch.Tensor:
    if not deepgemm_free_indexer_active():
        from vllm.utils import deep_gemm

        return deep_gemm.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                                                  schedule_metadata, max_model_len, clean_logits=clean_logits)
    return _kernels().paged_mqa_logits(_fp8_only(q, "fp8_fp4_paged_mqa_logits"), kv_cache, weights,
                                       context_lens, block_tables, max_model_len, clean_logits=clean_logits)


# -- torch.ops._C's top-k entry points, same arguments ------------------------------------------


def top_k_per_row_prefill(logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                          topk_indices: torch.Tensor, num_rows: int, stride0: int, stride1: int,
                          topk_tokens: int) -> None:
    if not deepgemm_free_indexer_active() or _topk_impl() == "vllm":
        torch.ops._C.top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows,
                                           stride0, stride1, topk_tokens)
        return
    _mlafleet_topk()(logits[:num_rows], cu_seqlen_ks[:num_rows], cu_seqlen_ke[:num_rows],
                             topk_tokens, out=topk_indices[:num_rows])


def _decode_ends(seq_lens: torch.Tensor, next_n: int, rows: int) -> torch.Tensor:
    if seq_lens.dim() == 2:  # [B, next_n]: each query token's own length
        return seq_lens.reshape(-1)[:rows]
    return _kernels().decode_row_ends(seq_lens, next_n)[:rows]


def top_k_per_row_decode(logits: torch.Tensor, next_n: int, seq_lens: torch.Tensor, topk_indices: torch.Tensor,
                         num_rows: int, stride0: int, stride1: int, topk_tokens: int) -> None:
    if not deepgemm_free_indexer_active() or _topk_impl() == "vllm":
        torch.ops._C.top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1,
                                          topk_tokens)
        return
    _mlafleet_topk()(logits[:num_rows], None, _decode_ends(seq_lens, next_n, num_rows), topk_tokens,
                             out=topk_indices[:num_rows])


def persistent_topk(logits: torch.Tensor, seq_lens: torch.Tensor, topk_indices: torch.Tensor,
                    workspace: torch.Tensor, topk_tokens: int, max_seq_len: int) -> None:
    if not deepgemm_free_indexer_active():
        torch.ops._C.persistent_topk(logits, seq_lens, topk_indices, workspace, topk_tokens, max_seq_len)
        return
    rows = logits.shape[0]
    next_n = seq_lens.shape[1] if seq_lens.dim() == 2 else 1
    top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, rows, logits.stride(0), logits.stride(1),
                         topk_tokens)
