# SPDX-License-Identifier: Apache-2.0
"""TRITON_MLA_SPARSE for vLLM 0.32.0: sparse MLA (DeepSeek Sparse Attention, e.g. GLM-5) with
mlafleet's Triton kernels.

Added by the mlafleet patch set (files/vllm/0.32.0 in the mlafleet repository); where vLLM picks
it is vllm/v1/attention/backends/mla/mlafleet_selection.py (also added).

What a sparse-MLA backend of vLLM 0.32.0 consists of, and what this one puts there:

- the metadata: vLLM's common sparse-MLA metadata and builder (sparse_mla_attention.py). The
  builder gets no dense-MHA prefill backend from the layer (the impl says it has none), so every
  token, prefill and decode alike, reaches `forward_mqa`;
- the KV cache: [num_blocks, 64, 576] bf16 for an unquantised cache, or DeepSeek's fp8_ds_mla,
  656 bytes a token (512 float8_e4m3 latent values, four float32 scales, 64 bf16 RoPE values);
  blocks sit a whole number of rows apart (customize_spec), so the cache reads as flat rows.
  The layouts, by kv_cache_dtype, are `vllm.third_party.mlafleet_kernels.sparse_mla`, shared
  with the other vLLM lines' backends;
- the attention: the indexer leaves each token's top-k positions (per request, -1 for none) in
  the shared top-k buffer; vLLM's `triton_convert_req_index_to_global_index` turns them into
  cache rows through the block table, and mlafleet's kernels (shipped as
  vllm.third_party.mlafleet_kernels) attend over those rows;
- fp8_ds_mla prefill: where a batch has enough prefill tokens for its prefill requests' contexts
  (sparse_mla.use_prefill_workspace), those contexts are dequantised once into the bf16
  workspace vLLM's sparse builder allocates anyway (chunked_prefill_workspace) and the prefill
  tokens attend over it with the bf16 kernel (their positions mapped onto its rows); decode tokens
  read the fp8 cache. Otherwise every token reads the fp8 cache.

`--kv-cache-dtype fp8` (and fp8_e4m3) serves the fp8_ds_mla cache, as for vLLM's own sparse
backends: the MLA layer turns it into fp8_ds_mla before the cache is allocated (patch set,
mla-fp8-kv.yml). An impl handed "fp8" itself (vLLM's own backend tests build it so) reads
vLLM's plain fp8 MLA cache (the kernel module's layouts).

What every line's backend shares (the backend's class methods, the impl's checks and
`forward_mqa`) is `vllm.third_party.mlafleet_kernels.sparse_mla_backend`, shipped beside the
kernels; this file holds 0.32.0's own parts: the metadata and builder, the cache dtypes, the
spec and combination checks, the top-k buffer, the index conversion with the block stride.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SharedTopkIndicesBuffer,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.third_party.mlafleet_kernels import sparse_mla
from vllm.third_party.mlafleet_kernels.sparse_mla_backend import (
    NAME,
    SparseMLABackendParts,
    SparseMLAImplParts,
)
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionType,
    MLAAttentionImpl,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    align_blocks_to_rows,
    flat_kv_row_view,
    triton_convert_req_index_to_global_index,
)
from vllm.v1.kv_cache_interface import AttentionSpec

TOPK_MULTIPLE = 128  # vLLM's index conversion takes top-k widths in tiles of 128

# the kv-cache dtypes vLLM 0.32.0 has that the kernels read (their layouts: sparse_mla.LAYOUTS)
KV_CACHE_DTYPES: list[str] = ["auto", "bfloat16", "fp8_ds_mla", "fp8", "fp8_e4m3"]


class TritonMLASparseBackend(SparseMLABackendParts, AttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_builder_cls() -> type[TritonMLASparseMetadataBuilder]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TritonMLASparseImpl]:
        return TritonMLASparseImpl

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        # the kernels index the cache as flat rows: blocks must be whole rows apart
        return align_blocks_to_rows(spec)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: CacheDType | None,
                             block_size: int | None, use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool, device_capability: DeviceCapability) -> str | None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            return None
        if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
            return f"{NAME} reads the whole KV cache from the GPU (no HiSparse host offload)"
        model_config = vllm_config.model_config
        topk = getattr(model_config.hf_text_config, "index_topk", None) if model_config is not None else None
        if topk is not None and int(topk) % TOPK_MULTIPLE:
            return f"{NAME} needs index_topk to be a multiple of {TOPK_MULTIPLE}, got {topk}"
        return None


@dataclass(kw_only=True)
class TritonMLASparseMetadata(SparseMLACommonMetadata):
    """vLLM's common sparse-MLA metadata, and the bf16 workspace for this batch's prefill
    requests' contexts (None: every token reads the cache), prefill_seg_rows rows a request."""

    prefill_workspace: torch.Tensor | None = None
    prefill_seg_rows: int = 0


class TritonMLASparseMetadataBuilder(SparseMLACommonMetadataBuilder[TritonMLASparseMetadata]):
    """vLLM's sparse-MLA metadata, built for a backend whose every token takes the top-k path.

    The kernels need only the common fields (block table, request of each token, block size,
    sequence lengths); nothing in them depends on the host, so uniform decode batches can be
    captured in CUDA graphs, speculative tokens included. Batches with prefill requests get the
    workspace where the rule takes it (host values only).
    """

    metadata_cls = TritonMLASparseMetadata
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> TritonMLASparseMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if metadata.num_prefills:
            first = metadata.num_decodes
            longest = int(common_attn_metadata.seq_lens_cpu_upper_bound[first:first + metadata.num_prefills].max())
            prefill_tokens = metadata.num_actual_tokens - metadata.num_decode_tokens
            workspace = self.chunked_prefill_workspace
            if sparse_mla.use_prefill_workspace(prefill_tokens, metadata.num_prefills, longest, workspace.shape[0]):
                metadata.prefill_workspace = workspace
                metadata.prefill_seg_rows = sparse_mla.prefill_segment_rows(longest)
        return metadata


class TritonMLASparseImpl(SparseMLAImplParts, MLAAttentionImpl[TritonMLASparseMetadata], SharedTopkIndicesBuffer):
    is_sparse = True
    supports_dense_mha_prefill = False  # prefill goes through forward_mqa too
    supports_pcp = False

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
        indexer: object | None = None,
        **mla_args,
    ) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap}
        named = sorted(k for k, v in unsupported.items() if v)
        if named or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{NAME} serves decoder self-attention without "
                                      f"{', '.join(unsupported)}; got {named or attn_type}")
        self.init_parts(num_heads, head_size, scale, num_kv_heads, kv_cache_dtype, KV_CACHE_DTYPES, mla_args)
        self.init_topk_indices_buffer(indexer, mla_args.get("topk_indices_buffer"))
        if self.topk_indices_buffer is None:
            raise ValueError(f"{NAME} needs the top-k buffer of the model's sparse-attention indexer "
                             "(a DeepSeek-V3.2 / GLM-5 style model)")

    def record_logical_topk_ready(self) -> None:
        """The model reports the indexer's top-k as written; this backend reads it in-stream."""

    def _cache_rows(self, topk: torch.Tensor, metadata: SparseMLACommonMetadata, cache: torch.Tensor
                    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The cache as flat rows, its rows per block (blocks sit whole rows apart: customize_spec),
        and each token's top-k positions as rows of it ([T, 1, k])."""
        rows, rows_per_block = flat_kv_row_view(cache, metadata.block_size)
        tokens = topk.shape[0]
        slots = triton_convert_req_index_to_global_index(
            metadata.req_id_per_token[:tokens], metadata.block_table, topk,
            BLOCK_SIZE=metadata.block_size, BLOCK_STRIDE_ROWS=rows_per_block,
            NUM_TOPK_TOKENS=topk.shape[1])
        return rows, rows_per_block, slots.view(tokens, 1, topk.shape[1])
