# SPDX-License-Identifier: Apache-2.0
"""mlafleet: vLLM 0.32.0's DSA indexer without DeepGEMM, where DeepGEMM is not used.

Added by the mlafleet patch set (files/vllm/0.32.0 in the mlafleet repository). vLLM 0.32.0's
sparse attention indexer (GLM-5, DeepSeek-V3.2) scores cache positions with DeepGEMM's
`fp8_fp4_mqa_logits` / `fp8_fp4_paged_mqa_logits` (its vendored DeepGEMM compiles them at run
time, SM120 included, so a host needs a CUDA toolkit) and refuses to start without DeepGEMM.
The patch set points those calls, and the two top-k calls after them, at the functions below.

One decision, `use_deepgemm_free_indexer(capability, deep_gemm_installed)`:
  - MLAFLEET_INDEXER_FALLBACK=1 forces the DeepGEMM-free path (to test it on SM90);
  - DeepGEMM not installed: DeepGEMM-free;
  - compute capability 12.x: DeepGEMM-free only with the operator switch
    MLAFLEET_TRITON_SPARSE_MLA=1 (mlafleet_selection), which also makes TRITON_MLA_SPARSE the
    attention backend there: no run-time compilation of CUDA sources at all;
  - 9.x and 10.x: DeepGEMM; anything else (8.x): DeepGEMM-free.
On the DeepGEMM-free path the logits come from mlafleet's Triton kernels
(`vllm.third_party.mlafleet_kernels.indexer`). Top-k: vLLM 0.32.0's own kernels on 9.x, 10.x and
12.x (where vLLM runs them), mlafleet's Triton radix select elsewhere;
MLAFLEET_INDEXER_TOPK=vllm|triton|torch overrides that (torch: torch.topk, slow, runs anywhere).

What every line's dispatchers share (the switches, the decision for this device, the logits and
the prefill top-k on either path) is `vllm.third_party.mlafleet_kernels.indexer_dispatch`,
shipped beside the kernels; this file holds 0.32.0's rule and the entry points with 0.32.0's
arguments (its decode top-k included).
"""

from __future__ import annotations

import functools

import torch

from vllm.third_party.mlafleet_kernels import indexer_dispatch as dispatch

VLLM_TOPK_MAJORS = (9, 10, 12)  # where vLLM 0.32.0's top-k kernels run


def use_deepgemm_free_indexer(capability: tuple[int, int], deep_gemm_installed: bool = True) -> bool:
    """True when the DSA indexer runs without DeepGEMM on a device of this capability."""
    from vllm.v1.attention.backends.mla.mlafleet_selection import triton_sparse_mla_requested

    if dispatch.forced() or not deep_gemm_installed:
        return True
    major = int(capability[0])
    if major == 12:
        return triton_sparse_mla_requested()
    return major not in dispatch.DEEPGEMM_MAJORS


def topk_implementation(capability: tuple[int, int]) -> str:
    """On the DeepGEMM-free path, whose top-k: 'vllm', 'triton' or 'torch' (mlafleet's two)."""
    return dispatch.topk_implementation(capability, VLLM_TOPK_MAJORS)


@functools.cache
def deepgemm_free_indexer_active() -> bool:
    """The decision for this process's device (False off CUDA), logged once."""
    return dispatch.decide(use_deepgemm_free_indexer, topk_implementation)


def indexer_uses_deep_gemm() -> bool:
    """`has_deep_gemm()` as the indexer's metadata builder should see it: False on the free path."""
    from vllm.utils.import_utils import has_deep_gemm

    return has_deep_gemm() and not deepgemm_free_indexer_active()


@functools.cache
def _topk_impl() -> str:
    return dispatch.device_topk(topk_implementation)


# -- the logits: DeepGEMM's entry points, as vllm.utils.deep_gemm names them ---------------------


def fp8_fp4_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv: tuple[torch.Tensor, torch.Tensor],
                       weights: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                       clean_logits: bool) -> torch.Tensor:
    return dispatch.mqa_logits(deepgemm_free_indexer_active(), q, kv, weights, cu_seqlen_ks, cu_seqlen_ke,
                               clean_logits)


def fp8_fp4_paged_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv_cache: torch.Tensor,
                             weights: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                             schedule_metadata: torch.Tensor, max_model_len: int, clean_logits: bool,
                             indices: torch.Tensor | None = None) -> torch.Tensor:
    free = deepgemm_free_indexer_active()
    if free and indices is not None:
        raise NotImplementedError("fp8_fp4_paged_mqa_logits: the DeepGEMM-free indexer has no "
                                  "varlen decode (indices), which only SM100 DeepGEMM uses")
    return dispatch.paged_mqa_logits(free, q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                                     max_model_len, clean_logits, indices=indices)


# -- the top-k ------------------------------------------------------------------------------------


def top_k_per_row_prefill(logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                          topk_indices: torch.Tensor, num_rows: int, stride0: int, stride1: int,
                          topk_tokens: int) -> None:
    """vllm._custom_ops.top_k_per_row_prefill's arguments; mlafleet's select where vLLM's does not run."""
    if not deepgemm_free_indexer_active() or _topk_impl() == "vllm":
        from vllm import _custom_ops as ops

        ops.top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows,
                                  stride0, stride1, topk_tokens)
        return
    dispatch.prefill_topk(_topk_impl(), logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, topk_tokens)


def _mlafleet_decode_topk(logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, topk_indices: torch.Tensor,
                          topk_tokens: int, max_seq_len: int) -> None:
    """vLLM's decode top-k call (SparseIndexerTopk.forward's arguments) with mlafleet's select."""
    del max_seq_len  # the select reads each row's own end
    rows = logits.shape[0]
    if seq_lens.numel() == rows:  # one length per row: [B, next_n], or [B, 1] with next_n 1
        ends = seq_lens.reshape(-1)
    else:  # one length per request: row j of a request sees L - next_n + j + 1 keys
        ends = dispatch.kernels().decode_row_ends(seq_lens.reshape(-1), next_n)[:rows]
    dispatch.mlafleet_topk(_topk_impl())(logits, None, ends, topk_tokens, out=topk_indices[:rows])


def decode_topk(backend: str):
    """The decode top-k to call: vLLM's `get_indexer_topk(backend)`, or mlafleet's select."""
    if not deepgemm_free_indexer_active() or _topk_impl() == "vllm":
        from vllm.model_executor.layers.indexer_topk import get_indexer_topk

        return get_indexer_topk(backend)
    return _mlafleet_decode_topk
