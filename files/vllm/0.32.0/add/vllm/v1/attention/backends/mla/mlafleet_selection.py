# SPDX-License-Identifier: Apache-2.0
"""mlafleet: where TRITON_MLA_SPARSE stands among vLLM 0.32.0's sparse-MLA backends.

Added by the mlafleet patch set (files/vllm/0.32.0 in the mlafleet repository). vLLM's CUDA
platform builds its MLA priority list per compute capability (cached); the patched
`CudaPlatform.get_valid_backends` passes that list through `sparse_mla_priorities` for every
sparse-MLA (DSA) layer, so the result can follow the operator switch below at any time.

The outcome, by the device's major compute capability:

- 8.x: vLLM has no sparse-MLA backend; TRITON_MLA_SPARSE first, whatever the KV dtype.
- 12.x: vLLM's only sparse backend is FLASHINFER_MLA_SPARSE_SM120, which holds an fp8_ds_mla
  cache only (it turns `auto` into fp8_ds_mla) and compiles FlashInfer's CUDA sources at run
  time. An unquantised cache (`auto`, `bfloat16`, `float16`) gets TRITON_MLA_SPARSE first; a
  quantised one keeps vLLM's order, TRITON_MLA_SPARSE last (taken only when nothing else is
  valid). With MLAFLEET_TRITON_SPARSE_MLA=1 TRITON_MLA_SPARSE comes first for every KV dtype.
- anything else (9.x, 10.x): vLLM's list, unchanged.

`--attention-backend TRITON_MLA_SPARSE` bypasses the list (vLLM checks the named backend
alone): the backend accepts 8.x, 9.x and 12.x.
"""

from __future__ import annotations

import os
from typing import Any

SWITCH_ENV = "MLAFLEET_TRITON_SPARSE_MLA"
UNQUANTISED_KV = (None, "auto", "bfloat16", "float16")


def triton_sparse_mla_requested() -> bool:
    """The operator switch: MLAFLEET_TRITON_SPARSE_MLA=1 (0 or unset: off), read on every call."""
    value = os.environ.get(SWITCH_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SWITCH_ENV} must be 1 (TRITON_MLA_SPARSE and the DeepGEMM-free indexer on "
                         f"compute capability 12.x) or 0/unset, got {value!r}")
    return value == "1"


def triton_first(major: int, kv_cache_dtype: str | None) -> bool | None:
    """True: TRITON_MLA_SPARSE leads; False: it follows vLLM's backends; None: not offered."""
    if major == 8:
        return True
    if major == 12:
        return triton_sparse_mla_requested() or kv_cache_dtype in UNQUANTISED_KV
    return None


def sparse_mla_priorities(upstream: list[Any], capability: Any, kv_cache_dtype: str | None) -> list[Any]:
    """vLLM's MLA priority list with TRITON_MLA_SPARSE placed for this device and KV dtype."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    ours = AttentionBackendEnum.TRITON_MLA_SPARSE
    lead = triton_first(capability.major, kv_cache_dtype)
    others = [backend for backend in upstream if backend is not ours]
    if lead is None:
        return others
    return [ours, *others] if lead else [*others, ours]
