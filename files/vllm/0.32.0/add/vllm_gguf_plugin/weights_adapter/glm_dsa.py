# SPDX-License-Identifier: Apache-2.0
"""mlafleet: GLM-5 GGUFs (llama.cpp architecture ``glm-dsa``) in vllm-gguf-plugin 0.0.5.

Added by the mlafleet patch set (files/vllm/0.32.0 in the mlafleet repository), which registers
it in weights_adapter/__init__.py. The plugin's default adapter finds a model's GGUF tensor
names through `gguf.MODEL_ARCH_NAMES[model_type]` and a dummy Hugging Face model; neither knows
GLM-5 (`glm_moe_dsa`), and a split GGUF with a missing shard loads the shards it finds. This
adapter keeps the plugin's flow (config patching from the GGUF, the weight-type map, the
per-expert split of stacked experts) and takes what is GLM-5's from mlafleet's GLM-5 GGUF logic
(mlafleet/gguf_glm_dsa.py, shipped beside as vllm_gguf_plugin/gguf_glm_dsa.py):

- every shard of `*-0000K-of-0000N.gguf` must be present; a missing one is an error naming it;
- names from the `gguf` package's MODEL_ARCH.GLM_DSA map, the DSA indexer's tensors included;
- kv_b_proj rebuilt from attn_k_b/attn_v_b (dequantised when quantised) in the model's dtype,
  and the modules vLLM keeps dense (kv_b_proj, the indexer's wk/weights_proj, the router)
  dequantised and listed as unquantised; so is the indexer's wq_b, a ReplicatedLinear, which
  the plugin 0.0.5 cannot load quantised (ReplicatedLinear has no weight_loader_v2 for it);
- tied embeddings only when no shard holds output.weight.

The config comes as the plugin reads it: config.json of the GGUF's directory, `--tokenizer` or
`--hf-config-path` (GLM-5's Hugging Face files).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .. import gguf_glm_dsa
from .default import GGUFWeightsAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import ModelConfig


ALSO_DENSE = ("self_attn.indexer.wq_b",)  # dense here, though GGUF may hold it quantised


class GlmDsaGGUFAdapter(GGUFWeightsAdapter):
    """The weights adapter for GLM-5 (model type glm_moe_dsa, GGUF architecture glm-dsa)."""

    @classmethod
    def matches(cls, config) -> bool:
        return getattr(config, "model_type", None) == gguf_glm_dsa.MODEL_TYPE

    def build_name_map(self, model_config: ModelConfig) -> dict[str, str]:
        return gguf_glm_dsa.weights_map(model_config.hf_config.get_text_config())

    @staticmethod
    def _get_all_gguf_files(model_path: str) -> list[str]:
        return gguf_glm_dsa.all_gguf_shards(model_path)

    def update_tie_word_embeddings(self, model_path: str, hf_config: PretrainedConfig,
                                   gguf_to_hf_name_map: dict[str, str]) -> None:
        missing = gguf_glm_dsa.missing_tensor_names(self._get_all_gguf_files(model_path), gguf_to_hf_name_map)
        hf_config.update({"tie_word_embeddings": "lm_head.weight" in missing})

    def prepare_loading(self, model_path: str, model_config: ModelConfig):
        spec = super().prepare_loading(model_path, model_config)
        text_config = model_config.hf_config.get_text_config()
        spec.unquantized_modules.extend(
            m for m in gguf_glm_dsa.dense_module_names(text_config, ALSO_DENSE) if m not in spec.unquantized_modules)
        return spec

    def prepare_weights(self, model_config: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
        weights = gguf_glm_dsa.weights_iterator(self.load_spec.weights_source,
                                                self.load_spec.gguf_to_hf_name_map, model_config.dtype, ALSO_DENSE)
        yield from self.map_weights(weights)
