"""The DSA indexer's dispatch between vLLM's DeepGEMM path and mlafleet's Triton kernels
(indexer.py): the parts every vLLM line shares.

Shipped by both patch sets beside the kernels (vllm/third_party/mlafleet_kernels/). Each line's
vllm/v1/attention/ops/mlafleet_indexer.py (added by its patch set) holds that line's rule (where
the DeepGEMM-free path runs, where vLLM's own top-k kernels do) and the entry points its edited
vLLM modules call, with that line's arguments; those hand the decision and the arguments here:

- `forced()`: MLAFLEET_INDEXER_FALLBACK=1 forces the DeepGEMM-free path (to test it on SM90);
- `topk_implementation(capability, vllm_majors)`: on that path, whose top-k: vLLM's own kernels
  ('vllm') on the majors the line gives, mlafleet's Triton radix select ('triton') elsewhere;
  MLAFLEET_INDEXER_TOPK=vllm|triton|torch overrides it (torch: torch.topk, slow, runs anywhere);
- `decide(rule, topk_rule)`, `device_topk(topk_rule)`: the line's rules for this process's device
  (nothing changes off CUDA), the DeepGEMM-free path logged once;
- `mqa_logits`, `paged_mqa_logits`: DeepGEMM's logits as vllm.utils.deep_gemm gives them, or the
  Triton kernels (the FP8 indexer cache only);
- `mlafleet_topk(impl)`, `prefill_topk(...)`: mlafleet's select.

Imports torch only: vLLM, DeepGEMM and the kernels on first use (vLLM imports this module with
its indexer, on every platform).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

FALLBACK_ENV = "MLAFLEET_INDEXER_FALLBACK"
TOPK_ENV = "MLAFLEET_INDEXER_TOPK"
DEEPGEMM_MAJORS = (9, 10)  # where DeepGEMM's indexer kernels run on every line
TOPK_IMPLEMENTATIONS = ("vllm", "triton", "torch")


def forced() -> bool:
    """MLAFLEET_INDEXER_FALLBACK=1: the DeepGEMM-free path everywhere (0 or unset: the line's rule)."""
    value = os.environ.get(FALLBACK_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FALLBACK_ENV} must be 1 (force the DeepGEMM-free indexer) or 0/unset, got {value!r}")
    return value == "1"


def topk_implementation(capability: tuple[int, int], vllm_majors: tuple[int, ...]) -> str:
    """On the DeepGEMM-free path, whose top-k: 'vllm' on vllm_majors, else 'triton'; or the override."""
    value = os.environ.get(TOPK_ENV, "")
    if value and value not in TOPK_IMPLEMENTATIONS:
        raise ValueError(f"{TOPK_ENV} must be one of {', '.join(TOPK_IMPLEMENTATIONS)} (or unset), got {value!r}")
    if value:
        return value
    return "vllm" if int(capability[0]) in vllm_majors else "triton"


@functools.cache
def device_capability() -> tuple[int, int] | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None  # ROCm, XPU and CPU keep their own indexer paths
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def decide(rule: Callable[[tuple[int, int], bool], bool], topk_rule: Callable[[tuple[int, int]], str]) -> bool:
    """rule(capability, deep_gemm_installed) for this process's device (False off CUDA); the
    DeepGEMM-free path is logged with topk_rule(capability), its top-k."""
    from vllm.logger import init_logger
    from vllm.utils.import_utils import has_deep_gemm

    capability = device_capability()
    if capability is None:
        return False
    active = rule(capability, has_deep_gemm())
    if active:
        init_logger(__name__).info(
            "DSA indexer: DeepGEMM-free path (mlafleet Triton MQA logits, %s top-k) on compute capability %d.%d",
            topk_rule(capability), *capability)
    return active


def device_topk(topk_rule: Callable[[tuple[int, int]], str]) -> str:
    """topk_rule(capability) for this process's device ('vllm' off CUDA)."""
    capability = device_capability()
    return "vllm" if capability is None else topk_rule(capability)


def kernels() -> Any:
    """mlafleet's indexer kernels (imported on first use)."""
    from . import indexer

    return indexer


def mlafleet_topk(impl: str) -> Callable[..., torch.Tensor]:
    """mlafleet's select for impl 'triton' (the radix select) or 'torch' (torch.topk)."""
    module = kernels()
    return module.top_k_per_row_torch if impl == "torch" else module.top_k_per_row


def fp8_query(q: tuple[torch.Tensor, torch.Tensor | None], what: str) -> torch.Tensor:
    values, scale = q
    if scale is not None:
        raise NotImplementedError(
            f"{what}: the DeepGEMM-free indexer reads the FP8 indexer cache only; the MXFP4 one "
            "(use_fp4_indexer_cache) needs DeepGEMM")
    return values


def mqa_logits(free: bool, q: tuple[torch.Tensor, torch.Tensor | None], kv: tuple[torch.Tensor, torch.Tensor],
               weights: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
               clean_logits: bool) -> torch.Tensor:
    """DeepGEMM's fp8_fp4_mqa_logits (free False) or the Triton kernel, with its arguments."""
    if not free:
        from vllm.utils import deep_gemm

        return deep_gemm.fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits)
    keys, key_scales = kv
    return kernels().mqa_logits(fp8_query(q, "fp8_fp4_mqa_logits"), keys, key_scales, weights,
                                 cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits)


def paged_mqa_logits(free: bool, q: tuple[torch.Tensor, torch.Tensor | None], kv_cache: torch.Tensor,
                     weights: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                     schedule_metadata: torch.Tensor, max_model_len: int, clean_logits: bool,
                     **deep_gemm_args: Any) -> torch.Tensor:
    """DeepGEMM's fp8_fp4_paged_mqa_logits (free False; deep_gemm_args: what the line's adds) or
    the Triton kernel, with its arguments."""
    if not free:
        from vllm.utils import deep_gemm

        return deep_gemm.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                                                  schedule_metadata, max_model_len=max_model_len,
                                                  clean_logits=clean_logits, **deep_gemm_args)
    return kernels().paged_mqa_logits(fp8_query(q, "fp8_fp4_paged_mqa_logits"), kv_cache, weights,
                                       context_lens, block_tables, max_model_len, clean_logits=clean_logits)


def prefill_topk(impl: str, logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                 topk_indices: torch.Tensor, num_rows: int, topk_tokens: int) -> None:
    """vLLM's top_k_per_row_prefill (its rows' key ranges [ks, ke), into topk_indices) with mlafleet's
    select `impl`."""
    mlafleet_topk(impl)(logits[:num_rows], cu_seqlen_ks[:num_rows], cu_seqlen_ke[:num_rows],
                        topk_tokens, out=topk_indices[:num_rows])
