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
- `sparse_mla_fwd` (bf16 cache, [slots, 1, 576]) or `sparse_mla_fwd_fp8` (fp8_ds_mla cache,
  uint8 [num_blocks, 64, 1, 656]) attend over those slots for every query token, prefill and
  decode alike (no head padding, no FlashMLA scheduler metadata, no prefill workspace).
"""

from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config.cache import CacheDType
from vllm.platforms.interface import DeviceCapability
from vllm.third_party.mlafleet_kernels.sparse_mla import sparse_mla_fwd, sparse_mla_fwd_fp8
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
FP8_DS_MLA_TOKEN_BYTES = 656  # 512 fp8 values, 4 float32 scales, 64 bf16 RoPE values


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "bfloat16",
        "fp8_ds_mla",
        "fp8",  # alias: the MLA layer turns it into fp8_ds_mla (patch set's mla-fp8-kv edit)
    ]

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
        if cache_dtype_str == "fp8_ds_mla":
            return (num_blocks, block_size, FP8_DS_MLA_TOKEN_BYTES)
        return (num_blocks, block_size, head_size)


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
        if head_size != HEAD_SIZE:
            raise ValueError(f"TRITON_MLA_SPARSE supports head size {HEAD_SIZE}, got {head_size}")
        if kv_cache_dtype == "fp8":
            raise ValueError("TRITON_MLA_SPARSE: kv-cache dtype 'fp8' reached the backend "
                             "unconverted; the MLA layer turns it into fp8_ds_mla (is the "
                             "patch set's mla_attention.py edit in place?)")
        if kv_cache_dtype not in TritonMLASparseBackend.supported_kv_cache_dtypes:
            raise ValueError(f"TRITON_MLA_SPARSE: kv-cache dtype {kv_cache_dtype!r} is not "
                             "supported (use auto, bfloat16, fp8_ds_mla or fp8)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.topk_indices_buffer: torch.Tensor | None = indexer.topk_indices_buffer

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):  # (ql_nope [T, H, 512], q_pe [T, H, 64])
            q = torch.cat(q, dim=-1)
        num_tokens = q.shape[0]
        assert self.topk_indices_buffer is not None
        topk_indices = self.topk_indices_buffer[:num_tokens]

        # Per-request token positions -> global slot ids (block * 64 + offset, -1 invalid).
        global_indices = triton_convert_req_index_to_global_index(
            attn_metadata.req_id_per_token,
            attn_metadata.block_table,
            topk_indices,
            BLOCK_SIZE=attn_metadata.block_size,
            NUM_TOPK_TOKENS=topk_indices.shape[1],
        ).view(num_tokens, 1, -1)

        if self.kv_cache_dtype == "fp8_ds_mla":
            # [num_blocks, 64, 656] -> the kernel's [num_blocks, 64, 1, 656] uint8
            kv_cache = kv_c_and_k_pe_cache.view(torch.uint8).unsqueeze(-2)
            out, _ = sparse_mla_fwd_fp8(
                q, kv_cache, global_indices, self.scale, d_v=self.kv_lora_rank
            )
        else:
            # [num_blocks, 64, 576] -> [slots, 1, 576]
            kv_cache = kv_c_and_k_pe_cache.view(-1, 1, kv_c_and_k_pe_cache.shape[-1])
            out, _ = sparse_mla_fwd(
                q, kv_cache, global_indices, self.scale, d_v=self.kv_lora_rank
            )
        return out, None
