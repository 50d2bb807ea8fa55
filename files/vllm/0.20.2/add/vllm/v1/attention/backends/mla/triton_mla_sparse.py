"""TRITON_MLA_SPARSE: sparse MLA (DeepSeek Sparse Attention, e.g. GLM-5) with mlafleet's Triton kernels.

Added to vLLM 0.20.2 by the mlafleet patch set (files/vllm/0.20.2 in the mlafleet repository).

vLLM 0.20.2's sparse-MLA backends need FlashMLA (compute capability 9.x/10.x) or FlashInfer
(10.x); this one runs where they do not, e.g. SM120 (RTX PRO 6000) and SM8x. It reuses vLLM's
sparse-MLA metadata and builder (flashmla_sparse.py) and its index conversion
(sparse_utils.py), and calls mlafleet's kernels, shipped into the tree as
`vllm.third_party.mlafleet_kernels.sparse_mla`, instead of FlashMLA:

- the indexer leaves per-request top-k token positions in `indexer.topk_indices_buffer`;
- vLLM's `triton_convert_req_index_to_global_index` turns them into global slot ids
  (block * 64 + offset, -1 where invalid) through the block table;
- mlafleet's kernels attend over those slots for every query token, prefill and decode alike
  (no head padding, no FlashMLA scheduler metadata), reading the cache in the layout of its
  kv_cache_dtype: bf16, fp8_ds_mla, or (an impl handed "fp8" itself) vLLM's plain fp8 MLA
  cache. The layouts and that choice are `vllm.third_party.mlafleet_kernels.sparse_mla`;
- fp8_ds_mla prefill: where a batch has enough prefill tokens for its prefill requests' contexts
  (sparse_mla.use_prefill_workspace), those contexts are dequantised once into a bf16 workspace
  (PREFILL_WORKSPACE_MAX_ROWS rows at most, taken from vLLM's shared workspace manager, which
  vLLM's own FlashMLA fp8 backend reserves more of) and the prefill tokens attend over it with
  the bf16 kernel; decode tokens (first, as vLLM reorders the batch) read the fp8 cache.

What every line's backend shares (the backend's class methods, the impl's checks and
`forward_mqa`) is `vllm.third_party.mlafleet_kernels.sparse_mla_backend`, shipped beside the
kernels; this file holds 0.20.2's own parts: the metadata and builder, the cache dtypes and
shape, the indexer's buffer, the workspace, the index conversion.
"""

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config import get_current_vllm_config_or_none
from vllm.config.cache import CacheDType
from vllm.third_party.mlafleet_kernels import sparse_mla
from vllm.third_party.mlafleet_kernels.sparse_mla_backend import (
    BLOCK_SIZE,
    HEAD_SIZE,
    SparseMLABackendParts,
    SparseMLAImplParts,
)
from vllm.v1.attention.backend import AttentionBackend, SparseMLAAttentionImpl
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
    get_prefill_workspace_size,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

if TYPE_CHECKING:
    from vllm.model_executor.models.deepseek_v2 import Indexer

PREFILL_WORKSPACE_MAX_ROWS = 64 * 1024  # bf16 rows (75.5 MB), as vLLM 0.32.0's sparse builder caps its own

# the kv-cache dtypes vLLM 0.20.2 has that the kernels read (their layouts: sparse_mla.LAYOUTS)
KV_CACHE_DTYPES: list[str] = ["auto", "bfloat16", "fp8_ds_mla", "fp8"]


class TritonMLASparseBackend(SparseMLABackendParts, AttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_builder_cls() -> type["TritonMLASparseMetadataBuilder"]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["TritonMLASparseImpl"]:
        return TritonMLASparseImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,  # 1 for MLA
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        layout = sparse_mla.LAYOUTS.get(cache_dtype_str, sparse_mla.BF16_ROWS)
        return (num_blocks, block_size, sparse_mla.ROW_WIDTH[layout])


def prefill_workspace_rows(vllm_config) -> int:
    """Rows of the fp8_ds_mla prefill workspace: vLLM's own fp8 prefill size for the model's
    length, capped at PREFILL_WORKSPACE_MAX_ROWS."""
    return min(get_prefill_workspace_size(vllm_config.model_config.max_model_len), PREFILL_WORKSPACE_MAX_ROWS)


def prefill_workspace(rows: int) -> torch.Tensor:
    """The workspace as bf16 [rows, 576], a view of vLLM's shared workspace (grown to it if needed)."""
    (workspace,) = current_workspace_manager().get_simultaneous(((rows, HEAD_SIZE), torch.bfloat16))
    return workspace


@dataclass
class TritonMLASparseMetadata(FlashMLASparseMetadata):
    """vLLM's sparse-MLA metadata and, for a batch whose prefill tokens take the bf16 workspace,
    its decode/prefill split (decode requests first), the sequence lengths and the workspace
    (prefill_seg_rows rows a prefill request). prefill_workspace None: every token reads the cache."""

    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    seq_lens: torch.Tensor | None = None
    prefill_workspace: torch.Tensor | None = None
    prefill_seg_rows: int = 0


class TritonMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    """vLLM's sparse-MLA builder, without the FlashMLA-only fp8 scheduling metadata.

    Our fp8 kernel reads global slot ids straight from the fp8_ds_mla cache, so the builder's
    common fields (block table, request id per token, slot mapping, top-k) are all a batch needs,
    except an fp8_ds_mla batch whose prefill tokens take the workspace (host values only).
    """

    metadata_cls = TritonMLASparseMetadata

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_ds_mla = self.use_fp8_kv_cache
        self.use_fp8_kv_cache = False  # skips FlashMLA's get_mla_metadata in build()
        self.prefill_workspace_rows = prefill_workspace_rows(self.vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> FlashMLASparseMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.fp8_ds_mla:
            return metadata
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold or 1)
        if not num_prefills:
            return metadata
        longest = int(cm.seq_lens_cpu_upper_bound[num_decodes:num_decodes + num_prefills].max())
        if not sparse_mla.use_prefill_workspace(num_prefill_tokens, num_prefills, longest,
                                                self.prefill_workspace_rows):
            return metadata
        return TritonMLASparseMetadata(
            **{f.name: getattr(metadata, f.name) for f in fields(metadata)},
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
            seq_lens=cm.seq_lens, prefill_workspace=prefill_workspace(self.prefill_workspace_rows),
            prefill_seg_rows=sparse_mla.prefill_segment_rows(longest))


class TritonMLASparseImpl(SparseMLAImplParts, SparseMLAAttentionImpl[FlashMLASparseMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA specific arguments
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: "Indexer | None" = None,
        **mla_args,
    ) -> None:
        if indexer is None:
            raise ValueError("TRITON_MLA_SPARSE needs the model's sparse-attention indexer "
                             "(a DeepSeek-V3.2 / GLM-5 style model)")
        self.init_parts(num_heads, head_size, scale, num_kv_heads, kv_cache_dtype, KV_CACHE_DTYPES, mla_args)
        self.topk_indices_buffer: torch.Tensor | None = indexer.topk_indices_buffer
        vllm_config = get_current_vllm_config_or_none()
        if self.layout == sparse_mla.FP8_DS_MLA_ROWS and vllm_config and is_workspace_manager_initialized():
            # reserved now, while vLLM measures memory; batches take views of it (the builder)
            prefill_workspace(prefill_workspace_rows(vllm_config))

    def _cache_rows(self, topk: torch.Tensor, metadata: FlashMLASparseMetadata, cache: torch.Tensor
                    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The cache as flat rows ([num_blocks * 64, width]: blocks are contiguous here), 64 rows a
        block, and each token's top-k positions as cache slots, [T, 1, k]."""
        tokens = topk.shape[0]
        slots = triton_convert_req_index_to_global_index(
            metadata.req_id_per_token[:tokens], metadata.block_table, topk,
            BLOCK_SIZE=metadata.block_size, NUM_TOPK_TOKENS=topk.shape[1])
        return cache.view(-1, cache.shape[-1]), BLOCK_SIZE, slots.view(tokens, 1, topk.shape[1])
