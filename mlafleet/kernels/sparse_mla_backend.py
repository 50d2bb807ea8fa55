"""TRITON_MLA_SPARSE's parts that every vLLM line shares: the backend's class methods, the impl's
checks and its forward over the kernels of sparse_mla.py.

Shipped by both patch sets beside the kernels (vllm/third_party/mlafleet_kernels/). Each line's
vllm/v1/attention/backends/mla/triton_mla_sparse.py (added by its patch set) holds only what that
line's interface needs: its metadata and builder, the KV-cache dtypes it has, its own checks, how
the top-k positions become cache rows (vLLM's index conversion, whose arguments differ by line),
and the classes vLLM instantiates, which put these parts first among their bases:

    class TritonMLASparseBackend(SparseMLABackendParts, AttentionBackend): ...
    class TritonMLASparseImpl(SparseMLAImplParts, <the line's sparse-MLA impl base>): ...

Imports torch and the kernels only (vLLM's logger on the one call that logs).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from . import sparse_mla

NAME = "TRITON_MLA_SPARSE"
BLOCK_SIZE = 64  # tokens per KV-cache block (fp8_ds_mla's layout fixes it)
HEAD_SIZE = 576  # kv_lora_rank 512 + RoPE 64
LATENT = 512  # the value part of a cached token
MAJORS = (8, 9, 12)  # compute capabilities the kernels are built and checked for


class SparseMLABackendParts:
    """The backend's answers that do not depend on the line (before vLLM's AttentionBackend)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int]:
        # vLLM 0.20.2 asks without an argument, 0.32.0 with the layer's KV-cache spec
        return [BLOCK_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_SIZE]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability.major in MAJORS


class SparseMLAImplParts:
    """The impl's common checks and state (`init_parts`, which the line's __init__ calls after its
    own checks) and `forward_mqa`. The line's impl gives `topk_indices_buffer` (the indexer's
    top-k positions, per request, -1 for none: an attribute, or vLLM 0.32.0's property) and
    `_cache_rows`."""

    def init_parts(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, kv_cache_dtype: str,
                   kv_cache_dtypes: list[str], mla_args: dict[str, Any]) -> None:
        if head_size != HEAD_SIZE or mla_args.get("kv_lora_rank", LATENT) != LATENT:
            raise ValueError(f"{NAME} supports head size {HEAD_SIZE} with kv_lora_rank {LATENT}, got "
                             f"{head_size} and {mla_args.get('kv_lora_rank')}")
        # the cache layout first: a dtype the kernels cannot read fails before anything is set
        self.layout = sparse_mla.layout_of(kv_cache_dtype, kv_cache_dtypes, NAME)
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.kv_lora_rank = LATENT

    def _cache_rows(self, topk: torch.Tensor, metadata: Any, cache: torch.Tensor
                    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The cache as flat rows, its rows per block, and each token's top-k positions as rows of it
        ([T, 1, k], -1 for none): the line's, through its vLLM's index conversion."""
        raise NotImplementedError

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: Any, layer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        # (latent q [T, H, 512], RoPE q [T, H, 64]) or both in one [T, H, 576]; the kernel reads
        # the halves where they are, so nothing is concatenated
        tokens = (q if isinstance(q, torch.Tensor) else q[0]).shape[0]
        assert self.topk_indices_buffer is not None
        topk = self.topk_indices_buffer[:tokens]
        md = attn_metadata
        if self.layout == sparse_mla.FP8_DS_MLA_ROWS and getattr(md, "prefill_workspace", None) is not None:
            # fp8_ds_mla: the decode tokens (first, as the builders order them) over the cache, the
            # prefill tokens over their requests' contexts dequantised into the bf16 workspace
            _logger().info_once(f"{NAME}: fp8_ds_mla prefill tokens attend through the bf16 prefill workspace")
            rows, rows_per_block, decode_slots = self._cache_rows(topk[:md.num_decode_tokens], md,
                                                                  kv_c_and_k_pe_cache)
            return sparse_mla.attend_with_prefill_workspace(
                q, rows, rows_per_block, decode_slots, md.block_table, md.seq_lens, md.req_id_per_token,
                md.num_decodes, md.num_prefills, topk, self.scale, md.prefill_workspace, md.prefill_seg_rows), None
        rows, _, slots = self._cache_rows(topk, md, kv_c_and_k_pe_cache)
        return sparse_mla.attend(self.layout, q, rows, slots, self.scale, getattr(layer, "_k_scale", None)), None


@functools.cache
def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger(__name__)
