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

What every line's dispatchers share (the switches, the decision for this device, the logits and
the prefill top-k on either path) is `vllm.third_party.mlafleet_kernels.indexer_dispatch`,
shipped beside the kernels; this file holds 0.20.2's rule and the entry points with 0.20.2's
arguments (its decode top-k included).
"""

from __future__ import annotations

import functools

import torch

from vllm.third_party.mlafleet_kernels import indexer_dispatch as dispatch

VLLM_TOPK_MAJORS = dispatch.DEEPGEMM_MAJORS  # where 0.20.2 ships its top-k kernels tested


def use_deepgemm_free_indexer(capability: tuple[int, int], deep_gemm_installed: bool = True) -> bool:
    """True when the DSA indexer must run without DeepGEMM on a device of this capability."""
    if dispatch.forced() or not deep_gemm_installed:
        return True
    return int(capability[0]) not in dispatch.DEEPGEMM_MAJORS


def topk_implementation(capability: tuple[int, int]) -> str:
    """On the DeepGEMM-free path, whose top-k: 'vllm' (torch.ops._C), 'triton' or 'torch' (mlafleet)."""
    return dispatch.topk_implementation(capability, VLLM_TOPK_MAJORS)


@functools.cache
def deepgemm_free_indexer_active() -> bool:
    """The decision for this process's device (False off CUDA), logged once."""
    return dispatch.decide(use_deepgemm_free_indexer, topk_implementation)


@functools.cache
def _topk_impl() -> str:
    return dispatch.device_topk(topk_implementation)


# -- DeepGEMM's entry points, as vllm.utils.deep_gemm names them ------------------------------


def fp8_fp4_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv: tuple[torch.Tensor, torch.Tensor],
                       weights: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                       clean_logits: bool) -> torch.Tensor:
    return dispatch.mqa_logits(deepgemm_free_indexer_active(), q, kv, weights, cu_seqlen_ks, cu_seqlen_ke,
                               clean_logits)


def fp8_fp4_paged_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv_cache: torch.Tensor,
                             weights: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                             schedule_metadata: torch.Tensor, max_model_len: int,
                             clean_logits: bool) -> torch.Tensor:
    return dispatch.paged_mqa_logits(deepgemm_free_indexer_active(), q, kv_cache, weights, context_lens,
                                     block_tables, schedule_metadata, max_model_len, clean_logits)


# -- torch.ops._C's top-k entry points, same arguments ------------------------------------------


def top_k_per_row_prefill(logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                          topk_indices: torch.Tensor, num_rows: int, stride0: int, stride1: int,
                          topk_tokens: int) -> None:
    if not deepgemm_free_indexer_active() or _topk_impl() == "vllm":
        torch.ops._C.top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows,
                                           stride0, stride1, topk_tokens)
        return
    dispatch.prefill_topk(_topk_impl(), logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, topk_tokens)


def _decode_ends(seq_lens: torch.Tensor, next_n: int, rows: int) -> torch.Tensor:
    if seq_lens.dim() == 2:  # [B, next_n]: each query token's own length
        return seq_lens.reshape(-1)[:rows]
    return dispatch.kernels().decode_row_ends(seq_lens, next_n)[:rows]


def top_k_per_row_decode(logits: torch.Tensor, next_n: int, seq_lens: torch.Tensor, topk_indices: torch.Tensor,
                         num_rows: int, stride0: int, stride1: int, topk_tokens: int) -> None:
    if not deepgemm_free_indexer_active() or _topk_impl() == "vllm":
        torch.ops._C.top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1,
                                          topk_tokens)
        return
    dispatch.mlafleet_topk(_topk_impl())(logits[:num_rows], None, _decode_ends(seq_lens, next_n, num_rows),
                                         topk_tokens, out=topk_indices[:num_rows])


def persistent_topk(logits: torch.Tensor, seq_lens: torch.Tensor, topk_indices: torch.Tensor,
                    workspace: torch.Tensor, topk_tokens: int, max_seq_len: int) -> None:
    if not deepgemm_free_indexer_active():
        torch.ops._C.persistent_topk(logits, seq_lens, topk_indices, workspace, topk_tokens, max_seq_len)
        return
    rows = logits.shape[0]
    next_n = seq_lens.shape[1] if seq_lens.dim() == 2 else 1
    top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, rows, logits.stride(0), logits.stride(1),
                         topk_tokens)
