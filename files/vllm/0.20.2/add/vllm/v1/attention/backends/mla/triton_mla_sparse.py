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
  (no head padding, no FlashMLA scheduler metadata, no prefill workspace), reading the cache in
  the layout of its kv_cache_dtype: bf16, fp8_ds_mla, or (an impl handed "fp8" itself) vLLM's
  plain fp8 MLA cache. The layouts and that choice are
  `vllm.third_party.mlafleet_kernels.sparse_mla`, shared with the other vLLM lines' backends.
"""

from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config.cache import CacheDType
from vllm.platforms.interface import DeviceCapability
from vllm.third_party.mlafleet_kernels import sparse_mla
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    MultipleOf,
    SparseMLAAttentionImpl,
)
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)

if TYPE_CHECKING:
    from vllm.model_executor.models.deepseek_v2 import Indexer

BLOCK_SIZE = 64  # tokens per KV-cache block (fp8_ds_mla's layout fixes it)
HEAD_SIZE = 576  # 512 latent (kv_lora_rank) + 64 RoPE
LATENT = 512  # the value part of a cached token

# the kv-cache dtypes vLLM 0.20.2 has that the kernels read (their layouts: sparse_mla.LAYOUTS)
KV_CACHE_DTYPES: list[str] = ["auto", "bfloat16", "fp8_ds_mla", "fp8"]


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA_SPARSE"

    @staticmethod
    def get_builder_cls() -> type["TritonMLASparseMetadataBuilder"]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["TritonMLASparseImpl"]:
        return TritonMLASparseImpl

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
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
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major in (8, 9, 12)

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


class TritonMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    """vLLM's sparse-MLA builder, without the FlashMLA-only fp8 scheduling metadata.

    Our fp8 kernel reads global slot ids straight from the fp8_ds_mla cache for prefill and
    decode alike, so the builder's common fields (block table, request id per token, slot
    mapping, top-k) are all it needs.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.use_fp8_kv_cache = False  # skips FlashMLA's get_mla_metadata in build()


class TritonMLASparseImpl(SparseMLAAttentionImpl[FlashMLASparseMetadata]):
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
        if head_size != HEAD_SIZE or mla_args.get("kv_lora_rank", LATENT) != LATENT:
            raise ValueError(f"TRITON_MLA_SPARSE supports head size {HEAD_SIZE} with kv_lora_rank "
                             f"{LATENT}, got {head_size} and {mla_args.get('kv_lora_rank')}")
        # the cache layout first: a dtype the kernels cannot read fails before anything is set
        self.layout = sparse_mla.layout_of(kv_cache_dtype, KV_CACHE_DTYPES)
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.kv_lora_rank = LATENT
        self.topk_indices_buffer: torch.Tensor | None = indexer.topk_indices_buffer

    def _cache_slots(self, topk: torch.Tensor, metadata: FlashMLASparseMetadata) -> torch.Tensor:
        """Each token's top-k positions (per request, -1 for none) as cache slots, [T, 1, k]."""
        slots = triton_convert_req_index_to_global_index(
            metadata.req_id_per_token, metadata.block_table, topk,
            BLOCK_SIZE=metadata.block_size, NUM_TOPK_TOKENS=topk.shape[1])
        return slots.view(topk.shape[0], 1, topk.shape[1])

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # (latent q [T, H, 512], RoPE q [T, H, 64]) or both in one [T, H, 576]; the kernel reads
        # the halves where they are, so nothing is concatenated
        tokens = (q if isinstance(q, torch.Tensor) else q[0]).shape[0]
        assert self.topk_indices_buffer is not None
        slots = self._cache_slots(self.topk_indices_buffer[:tokens], attn_metadata)
        rows = kv_c_and_k_pe_cache.view(-1, kv_c_and_k_pe_cache.shape[-1])  # [num_blocks * 64, width]
        out = sparse_mla.attend(self.layout, q, rows, slots, self.scale, getattr(layer, "_k_scale", None))
        return out, None
