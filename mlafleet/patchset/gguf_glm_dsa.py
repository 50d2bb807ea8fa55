# SPDX-License-Identifier: Apache-2.0
"""GLM-5 (GGUF architecture ``glm-dsa``) for vLLM's GGUF loader. Added by the mlafleet patch set.

llama.cpp stores GLM-5 (the `gguf` package's MODEL_ARCH.GLM_DSA) with these differences from the
Hugging Face checkpoint that vLLM's GlmMoeDsaForCausalLM loads:

- tensor names `blk.N.*` (the `gguf` package's TensorNameMap gives them), including the DSA
  indexer's `blk.N.indexer.{attn_q_b, attn_k, k_norm, proj}`;
- the routed experts stacked into 3-D `ffn_{gate,up,down}_exps` (loaded like vLLM's deepseek2
  GGUF path: as expert 0 of each projection, the fused-MoE loader takes the whole stack);
- `kv_b_proj` [heads*(qk_nope+v_head), kv_lora] split per head into `attn_k_b`
  [heads, kv_lora, qk_nope] (transposed) and `attn_v_b` [heads, v_head, kv_lora]; this module
  rebuilds kv_b_proj from the two (dequantised when quantised) in the model's dtype;
- the hyperparameters in GGUF metadata (`glm-dsa.*`, in the first shard), from which
  `maybe_config_from_gguf` builds the GlmMoeDsaConfig (or the operator gives `--hf-config-path`).
  The tokenizer is not read from the GGUF: serve with `--tokenizer` (GLM-5's tokenizer files).

Split GGUFs must be complete: `all_gguf_shards` refuses a set with a missing shard (vLLM's own
discovery would skip it and leave weights uninitialised).
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

GGUF_ARCH = "glm-dsa"
MODEL_TYPE = "glm_moe_dsa"
_SHARD = re.compile(r"-(\d+)-of-(\d+)\.gguf$")
_UNQUANTISED = ("F32", "F16", "BF16")
# vLLM keeps these GlmMoeDsa parameters unquantised (plain linear layers / the router), so a
# quantised GGUF tensor for them is dequantised here; kv_b_proj is rebuilt from attn_k_b/attn_v_b.
_DENSE_ONLY = ("self_attn.kv_b_proj", "self_attn.indexer.wk", "self_attn.indexer.weights_proj", "mlp.gate")


# -- shards -------------------------------------------------------------------------------------


def all_gguf_shards(model_path: str) -> list[str]:
    """Every shard of the split GGUF `model_path` belongs to (`*-0000K-of-0000N.gguf`), in order.

    A path without a shard suffix is returned alone. Raises FileNotFoundError naming the missing
    shards when any of the N is absent.
    """
    match = _SHARD.search(model_path)
    if not match:
        return [model_path]
    total = int(match.group(2))
    width = len(match.group(1))
    if not 1 <= int(match.group(1)) <= total:
        raise ValueError(f"GGUF shard name {model_path!r} does not name a shard of a split model")
    prefix, suffix = model_path[: match.start(1)], model_path[match.end(2):]
    shards = [f"{prefix}{i:0{width}d}-of-{match.group(2)}{suffix}" for i in range(1, total + 1)]
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise FileNotFoundError(
            f"GGUF model {model_path} is split into {total} shards but {len(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing: {', '.join(missing)}. "
            "Every shard must be present to load the model.")
    return shards


def gguf_architecture(path: str | os.PathLike[str]) -> str | None:
    """`general.architecture` of a GGUF file (None if absent)."""
    reader = gguf.GGUFReader(path)
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    return None if field is None else field.contents()


def missing_tensor_names(gguf_files: Iterable[str], gguf_to_hf_name_map: dict[str, str]) -> list[str]:
    """Parameter names the map expects that no shard holds (the union of all shards counts)."""
    present: set[str] = set()
    for path in gguf_files:
        present.update(t.name for t in gguf.GGUFReader(path).tensors)
    return sorted({hf for g, hf in gguf_to_hf_name_map.items() if g not in present})


# -- names --------------------------------------------------------------------------------------


def glm_dsa_arch(gguf_module: Any = gguf) -> Any:
    """The `gguf` package's MODEL_ARCH.GLM_DSA, or a clear error when the installed one predates it."""
    arch = getattr(gguf_module.MODEL_ARCH, "GLM_DSA", None)
    if arch is None:
        raise RuntimeError(
            f"the installed gguf package ({getattr(gguf_module, '__file__', gguf_module)}) does not know "
            "MODEL_ARCH.GLM_DSA (GLM-5): install gguf 0.19.0 or newer in this environment")
    return arch


def _is_moe_layer(config: Any, layer: int) -> bool:
    return (config.n_routed_experts is not None and layer >= config.first_k_dense_replace
            and layer % getattr(config, "moe_layer_freq", 1) == 0)


def checkpoint_names(config: Any) -> list[str]:
    """The GLM-5 checkpoint tensors (Hugging Face names) a GGUF provides, for `config`.

    The routed experts appear as one name per projection (`mlp.experts.<proj>`): GGUF stacks them.
    `kv_b_proj` appears as `k_b_proj`/`v_b_proj`, the two halves GGUF stores.
    """
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{m}.weight" for m in (
            "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
            "k_b_proj", "v_b_proj", "o_proj", "indexer.wq_b", "indexer.wk", "indexer.k_norm",
            "indexer.weights_proj")]
        names.append(f"{p}.self_attn.indexer.k_norm.bias")
        if _is_moe_layer(config, i):
            names += [f"{p}.mlp.gate.weight", f"{p}.mlp.gate.e_score_correction_bias"]
            names += [f"{p}.mlp.experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
            if config.n_shared_experts:
                names += [f"{p}.mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        else:
            names += [f"{p}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    return names


def _vllm_name(hf_name: str) -> str:
    """The name vLLM's GlmMoeDsaForCausalLM.load_weights takes for a GGUF-layout tensor."""
    if ".mlp.experts." in hf_name:  # a stacked projection: loaded as expert 0, all experts at once
        return hf_name.replace(".mlp.experts.", ".mlp.experts.0.")
    if hf_name.endswith((".k_b_proj.weight", ".v_b_proj.weight")):
        return hf_name.rsplit(".", 2)[0] + ".kv_b_proj.weight"
    return hf_name


def weights_map(config: Any) -> dict[str, str]:
    """GGUF tensor name -> the parameter name vLLM's GlmMoeDsaForCausalLM loads it as.

    `blk.N.attn_k_b.weight` and `blk.N.attn_v_b.weight` both map to
    `model.layers.N.self_attn.kv_b_proj.weight`, which `weights_iterator` rebuilds from the pair.
    """
    tensor_names = gguf.get_tensor_name_map(glm_dsa_arch(), config.num_hidden_layers)
    mapping: dict[str, str] = {}
    for hf_name in checkpoint_names(config):
        base, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith(".e_score_correction_bias"):  # a parameter of the router, llama.cpp's exp_probs_b.bias
            base, suffix = hf_name.removesuffix("_bias"), "bias"
        gguf_base = tensor_names.get_name(base)
        if gguf_base is None:
            raise RuntimeError(f"the installed gguf package maps no GLM-DSA tensor to {hf_name}")
        mapping[f"{gguf_base}.{suffix}"] = _vllm_name(hf_name)
    return mapping


def dense_module_names(config: Any, also_dense: tuple[str, ...] = ()) -> list[str]:
    """Modules of a GLM-5 model that stay unquantised whatever the GGUF's types (see _DENSE_ONLY),
    with `also_dense` (module names inside a layer) where a loader cannot take them quantised."""
    out = []
    for i in range(config.num_hidden_layers):
        for m in _DENSE_ONLY + tuple(also_dense):
            if m == "mlp.gate" and not _is_moe_layer(config, i):
                continue
            out.append(f"model.layers.{i}.{m}")
    return out


# -- tensors ------------------------------------------------------------------------------------


def _as_float(tensor: Any) -> torch.Tensor:
    """A GGUFReader tensor as a float torch tensor in its logical shape (dequantised if needed)."""
    qtype = tensor.tensor_type
    if qtype.name in ("F32", "F16"):
        return torch.from_numpy(np.array(tensor.data))
    if qtype.name == "BF16":
        return torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), qtype))


def _raw(tensor: Any) -> torch.Tensor:
    """A quantised GGUFReader tensor as vLLM's GGUF layers take it: its raw bytes (uint8 rows)."""
    return torch.from_numpy(np.array(tensor.data))


def rebuild_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads*(qk_nope+v_head), kv_lora] from attn_k_b [heads, kv_lora, qk_nope] and
    attn_v_b [heads, v_head, kv_lora] (llama.cpp transposed k_b; this undoes it)."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not the two "
                         "halves of one kv_b_proj ([heads, kv_lora, qk_nope] and [heads, v_head, kv_lora])")
    per_head = torch.cat([k_b.transpose(1, 2), v_b.to(k_b.dtype)], dim=1)
    return per_head.reshape(-1, per_head.shape[-1]).contiguous()


def _check_split(readers: list[gguf.GGUFReader], files: list[str]) -> None:
    """Each shard says it is split.no K of split.count N: all N read, and the tensor count adds up."""
    if len(readers) == 1 and readers[0].get_field(gguf.Keys.Split.LLM_KV_SPLIT_COUNT) is None:
        return
    declared_tensors = None
    for k, (reader, path) in enumerate(zip(readers, files)):
        count = reader.get_field(gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
        number = reader.get_field(gguf.Keys.Split.LLM_KV_SPLIT_NO)
        if count is None or number is None or count.contents() != len(files) or number.contents() != k:
            raise ValueError(f"{path} is not shard {k + 1} of {len(files)} by its split metadata")
        field = reader.get_field(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        if field is not None:
            declared_tensors = field.contents()
    read = sum(len(r.tensors) for r in readers)
    if declared_tensors is not None and read != declared_tensors:
        raise ValueError(f"the {len(files)} GGUF shards hold {read} tensors, their metadata says {declared_tensors}")


def weights_iterator(gguf_files: list[str], gguf_to_hf_name_map: dict[str, str],
                     dtype: torch.dtype, also_dense: tuple[str, ...] = ()) -> Generator[tuple[str, torch.Tensor], None, None]:
    """(parameter name, tensor) for vLLM's GlmMoeDsaForCausalLM.load_weights, from all shards.

    As vLLM's GGUF iterator does, every `<name>.qweight_type` comes first, then the data
    (`<name>.qweight` raw bytes for quantised tensors, float tensors otherwise). Tensors of
    modules vLLM keeps unquantised are dequantised to `dtype`; kv_b_proj is rebuilt from
    attn_k_b and attn_v_b. Raises if a mapped tensor is in no shard (only lm_head may be absent:
    tied embeddings) or a layer has one half of kv_b_proj without the other.
    """
    readers = [gguf.GGUFReader(f) for f in gguf_files]
    _check_split(readers, gguf_files)
    tensors = [t for r in readers for t in r.tensors if t.name in gguf_to_hf_name_map]
    seen = {t.name for t in tensors}
    missing = sorted(g for g in gguf_to_hf_name_map if g not in seen and g != "output.weight")
    if missing:
        raise ValueError(f"GLM-5 GGUF {gguf_files[0]}: tensors missing from all {len(gguf_files)} shards: {missing}")

    def dense(name: str) -> bool:
        return any(f".{m}." in name for m in _DENSE_ONLY + tuple(also_dense))

    for t in tensors:
        name = gguf_to_hf_name_map[t.name]
        if t.tensor_type.name not in _UNQUANTISED and not dense(name):
            yield name.removesuffix(".weight") + ".qweight_type", torch.tensor(int(t.tensor_type))

    halves: dict[str, dict[str, torch.Tensor]] = {}
    for t in tensors:
        name = gguf_to_hf_name_map[t.name]
        if t.name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            pair = halves.setdefault(name, {})
            pair["k" if t.name.endswith(".attn_k_b.weight") else "v"] = _as_float(t)
            if len(pair) == 2:
                del halves[name]
                yield name, rebuild_kv_b(pair["k"].float(), pair["v"].float()).to(dtype)
        elif dense(name):
            value = _as_float(t)
            # weights in the model's dtype; the router's correction bias stays fp32 as vLLM keeps it
            yield name, value.to(dtype) if name.endswith(".weight") else value
        elif t.tensor_type.name in _UNQUANTISED:
            yield name, _as_float(t)
        else:
            yield name.removesuffix(".weight") + ".qweight", _raw(t)
    if halves:
        raise ValueError(f"GLM-5 GGUF {gguf_files[0]}: only one of attn_k_b/attn_v_b for {sorted(halves)}")


# -- config -------------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.get_field(key.format(arch=GGUF_ARCH))
    if field is None:
        if default is ...:
            raise ValueError(f"GGUF metadata lacks {key.format(arch=GGUF_ARCH)}: give the model's config "
                             "with --hf-config-path")
        return default
    return field.contents()


def config_dict_from_gguf(path: str | os.PathLike[str]) -> dict[str, Any]:
    """GlmMoeDsaConfig arguments from a `glm-dsa` GGUF's metadata (the first shard holds it)."""
    r = gguf.GGUFReader(path)
    K = gguf.Keys
    arch = _field(r, K.General.ARCHITECTURE)
    if arch != GGUF_ARCH:
        raise ValueError(f"{path} is a {arch!r} GGUF, not {GGUF_ARCH!r}")
    # llama.cpp counts GLM-5's MTP (nextn) layers as blocks after the main ones
    nextn = _field(r, K.LLM.NEXTN_PREDICT_LAYERS, 0)
    n_layers = _field(r, K.LLM.BLOCK_COUNT) - nextn
    heads = _field(r, K.Attention.HEAD_COUNT)
    rope = _field(r, K.Rope.DIMENSION_COUNT)
    first_dense = _field(r, K.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    tokens = r.get_field(K.Tokenizer.LIST)
    vocab = _field(r, K.LLM.VOCAB_SIZE, None) or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF metadata gives no vocabulary size")
    gating = _field(r, K.LLM.EXPERT_GATING_FUNC, int(gguf.ExpertGatingFuncType.SIGMOID))
    eos = _field(r, K.Tokenizer.EOS_ID, None)
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": int(vocab),
        "hidden_size": _field(r, K.LLM.EMBEDDING_LENGTH),
        "intermediate_size": _field(r, K.LLM.FEED_FORWARD_LENGTH),
        "moe_intermediate_size": _field(r, K.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "num_hidden_layers": n_layers,
        "first_k_dense_replace": first_dense,
        "mlp_layer_types": ["dense" if i < first_dense else "sparse" for i in range(n_layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # GGUF stores MLA as MQA (head_count_kv 1); the model has one KV head per head
        "q_lora_rank": _field(r, K.Attention.Q_LORA_RANK),
        "kv_lora_rank": _field(r, K.Attention.KV_LORA_RANK),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": _field(r, K.Attention.KEY_LENGTH_MLA) - rope,
        "v_head_dim": _field(r, K.Attention.VALUE_LENGTH_MLA),
        "head_dim": rope,
        "index_topk": _field(r, K.Attention.Indexer.TOP_K),
        "index_n_heads": _field(r, K.Attention.Indexer.HEAD_COUNT),
        "index_head_dim": _field(r, K.Attention.Indexer.KEY_LENGTH),
        "indexer_rope_interleave": True,  # GLM-5's indexer RoPE is interleaved (not in GGUF metadata)
        "n_routed_experts": _field(r, K.LLM.EXPERT_COUNT),
        "num_experts_per_tok": _field(r, K.LLM.EXPERT_USED_COUNT),
        "n_shared_experts": _field(r, K.LLM.EXPERT_SHARED_COUNT, 0),
        "n_group": _field(r, K.LLM.EXPERT_GROUP_COUNT, 1),
        "topk_group": _field(r, K.LLM.EXPERT_GROUP_USED_COUNT, 1),
        "routed_scaling_factor": float(_field(r, K.LLM.EXPERT_WEIGHTS_SCALE, 1.0)),
        "norm_topk_prob": bool(_field(r, K.LLM.EXPERT_WEIGHTS_NORM, True)),
        "scoring_func": "sigmoid" if gating == int(gguf.ExpertGatingFuncType.SIGMOID) else "softmax",
        "topk_method": "noaux_tc" if gating == int(gguf.ExpertGatingFuncType.SIGMOID) else "greedy",
        "num_nextn_predict_layers": nextn,
        "hidden_act": "silu",
        "max_position_embeddings": _field(r, K.LLM.CONTEXT_LENGTH),
        "rope_parameters": {"rope_theta": float(_field(r, K.Rope.FREQ_BASE)), "rope_type": "default"},
        "rms_norm_eps": float(_field(r, K.Attention.LAYERNORM_RMS_EPS)),
        # the loader ties the embeddings when no shard holds output.weight
        "tie_word_embeddings": False,
        "bos_token_id": _field(r, K.Tokenizer.BOS_ID, None),
        "eos_token_id": eos,
        "pad_token_id": _field(r, K.Tokenizer.PAD_ID, eos),
        "dtype": "bfloat16",
    }


def maybe_config_from_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Any] | None:
    """(config dict, GlmMoeDsaConfig) if `path` is a local `glm-dsa` GGUF, else None."""
    path = Path(path)
    if not path.is_file() or gguf_architecture(path) != GGUF_ARCH:
        return None
    from transformers import GlmMoeDsaConfig

    config_dict = config_dict_from_gguf(path)
    return config_dict, GlmMoeDsaConfig(**{k: v for k, v in config_dict.items() if k != "model_type"})
