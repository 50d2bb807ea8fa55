"""A tiny GLM-5-architecture model, written from scratch: config, tokenizer, random weights.

The model has GLM-5's attention geometry (64 heads, kv_lora_rank 512, qk_nope 192, qk_rope 64,
v_head 256, a 32-head x 128 DSA indexer with topk 2048) but 2 layers (one dense, one MoE with
8 small experts) and a 2048-token vocabulary (`files/models/tiny-glm5/config.json`, the team's).

It is written in three forms that hold the same numbers:
- Hugging Face layout: `config.json`, `tokenizer.json` + `tokenizer_config.json`, and
  `model.safetensors` with GLM-5's checkpoint names (`model.layers.N.self_attn.kv_b_proj.weight`,
  per-expert `mlp.experts.E.gate_proj.weight`, ...), bf16 (the router bias in fp32).
- Block-FP8 safetensors snapshot, laid out as GLM-5's official FP8 checkpoints are
  (`write_tiny_glm5_fp8`): the same bf16 weights, every linear weight GLM-5-FP8 stores in FP8
  quantised to float8_e4m3fn in 128x128 blocks with a float32 `<name>_scale_inv` of shape
  ceil(rows/128) x ceil(cols/128) (weight ~= fp8 * scale_inv per block); config.json with the fp8
  `quantization_config`; `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`,
  `generation_config.json` and the tokenizer files.
- GGUF split into shards `<name>-0000K-of-0000N.gguf`, laid out the way llama.cpp converts GLM-5:
  architecture `glm-dsa`, tensor names from the `gguf` package (MODEL_ARCH.GLM_DSA), experts
  stacked into `ffn_{gate,up,down}_exps`, and `kv_b_proj` split per head into `attn_k_b`
  (the first qk_nope rows of each head, transposed to [heads, kv_lora_rank, qk_nope]) and
  `attn_v_b` (the remaining v_head rows, [heads, v_head, kv_lora_rank]).

Sizes: the attention geometry alone is ~40M parameters per layer (kv_b_proj 28672 x 512,
q_b_proj 16384 x 512, o_proj 1024 x 16384), so the model is ~104M parameters: ~120 MB as Q8_0
GGUF (~138 MB with attn_k_b/attn_v_b kept BF16), ~208 MB as safetensors. A few MB is not possible
without shrinking GLM-5's attention geometry, which the model exists to keep. Everything is
deterministic for a seed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch

CONFIG_PATH = Path(__file__).resolve().parents[2] / "files" / "models" / "tiny-glm5" / "config.json"

GGUF_NAME = "tiny-glm5"
# GGUF tensor types the writer can produce (numpy quantisers in the `gguf` package).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
SPECIAL_TOKENS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_config(path: Path = CONFIG_PATH) -> dict[str, Any]:
    """The tiny GLM-5 config (a plain dict, as in config.json)."""
    return json.loads(Path(path).read_text())


# ----------------------------------------------------------------------------------------------
# Weights in the Hugging Face checkpoint layout


def _layer_is_moe(config: dict[str, Any], layer: int) -> bool:
    return layer >= config["first_k_dense_replace"] and layer % config.get("moe_layer_freq", 1) == 0


def hf_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GLM-5 checkpoint (GLM-5's own names) with its shape, in a fixed order."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    idx_heads, idx_dim = config["index_n_heads"], config["index_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_a_proj.weight"] = (q_lora, h)
        shapes[f"{p}.self_attn.q_a_layernorm.weight"] = (q_lora,)
        shapes[f"{p}.self_attn.q_b_proj.weight"] = (heads * (nope + rope), q_lora)
        shapes[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] = (kv_lora + rope, h)
        shapes[f"{p}.self_attn.kv_a_layernorm.weight"] = (kv_lora,)
        shapes[f"{p}.self_attn.kv_b_proj.weight"] = (heads * (nope + v), kv_lora)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, heads * v)
        shapes[f"{p}.self_attn.indexer.wq_b.weight"] = (idx_heads * idx_dim, q_lora)
        shapes[f"{p}.self_attn.indexer.wk.weight"] = (idx_dim, h)
        shapes[f"{p}.self_attn.indexer.k_norm.weight"] = (idx_dim,)
        shapes[f"{p}.self_attn.indexer.k_norm.bias"] = (idx_dim,)
        shapes[f"{p}.self_attn.indexer.weights_proj.weight"] = (idx_heads, h)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        if _layer_is_moe(config, i):
            n_exp, ff = config["n_routed_experts"], config["moe_intermediate_size"]
            shapes[f"{p}.mlp.gate.weight"] = (n_exp, h)
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (n_exp,)
            for e in range(n_exp):
                shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (ff, h)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (ff, h)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, ff)
            shared = ff * config["n_shared_experts"]
            shapes[f"{p}.mlp.shared_experts.gate_proj.weight"] = (shared, h)
            shapes[f"{p}.mlp.shared_experts.up_proj.weight"] = (shared, h)
            shapes[f"{p}.mlp.shared_experts.down_proj.weight"] = (h, shared)
        else:
            ff = config["intermediate_size"]
            shapes[f"{p}.mlp.gate_proj.weight"] = (ff, h)
            shapes[f"{p}.mlp.up_proj.weight"] = (ff, h)
            shapes[f"{p}.mlp.down_proj.weight"] = (h, ff)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def hf_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with GLM-5's checkpoint names: bf16, the router's correction bias fp32.

    Norm weights are 1 + noise and matrices N(0, 0.02), so every tensor differs from every other
    (a test that mixes two of them up notices).
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in hf_shapes(config).items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            state[name] = (x * 0.01).contiguous()  # fp32, as GLM-5 ships it
            continue
        if len(shape) == 1:
            x = 1.0 + 0.05 * x if name.endswith(".weight") else 0.02 * x
        else:
            x = config.get("initializer_range", 0.02) * x
        state[name] = x.to(torch.bfloat16).contiguous()
    return state


# ----------------------------------------------------------------------------------------------
# The llama.cpp (GGUF) layout


def split_kv_b(kv_b: torch.Tensor, heads: int, qk_nope: int, v_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [heads*(qk_nope+v_head), kv_lora] -> (k_b [heads, kv_lora, qk_nope], v_b [heads, v_head, kv_lora]).

    The split llama.cpp's GLM-5/DeepSeek conversion stores as `attn_k_b` / `attn_v_b`.
    """
    rows, kv_lora = kv_b.shape
    if rows != heads * (qk_nope + v_head):
        raise ValueError(f"kv_b_proj has {rows} rows, expected heads*(qk_nope+v_head) = {heads * (qk_nope + v_head)}")
    per_head = kv_b.reshape(heads, qk_nope + v_head, kv_lora)
    k_b = per_head[:, :qk_nope, :].transpose(1, 2).contiguous()
    v_b = per_head[:, qk_nope:, :].contiguous()
    return k_b, v_b


def gguf_tensors(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint renamed and reshaped as llama.cpp writes GLM-5 (`glm-dsa`), in file order."""
    n_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, n_layers)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GLM_DSA]}

    def gguf_name(hf_base: str, suffix: str) -> str:
        name = names.get_name(hf_base)
        if name is None:
            raise KeyError(f"the gguf package has no GLM-DSA tensor for {hf_base}")
        generic = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if not any(a == name or a.endswith("." + generic) for a in allowed):
            raise KeyError(f"{name} is not a GLM-DSA tensor")
        return f"{name}.{suffix}"

    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], list[torch.Tensor]] = {}
    for hf_name, t in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith(".e_score_correction_bias"):
            # the router bias is a parameter, not a module: llama.cpp names it exp_probs_b.bias
            out[gguf_name(hf_name.removesuffix("_bias"), "bias")] = t
            continue
        parts = base.split(".")
        if ".mlp.experts." in base:
            layer, proj = int(parts[2]), parts[-1]
            experts.setdefault((layer, proj), []).append(t)
            if len(experts[(layer, proj)]) == config["n_routed_experts"]:
                stacked = torch.stack(experts.pop((layer, proj)), dim=0)
                out[gguf_name(f"model.layers.{layer}.mlp.experts.{proj}", suffix)] = stacked
            continue
        if base.endswith("self_attn.kv_b_proj"):
            k_b, v_b = split_kv_b(t, config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"])
            prefix = base.removesuffix("kv_b_proj")
            out[gguf_name(prefix + "k_b_proj", suffix)] = k_b
            out[gguf_name(prefix + "v_b_proj", suffix)] = v_b
            continue
        out[gguf_name(base, suffix)] = t
    if experts:
        raise ValueError(f"incomplete experts in the checkpoint: {sorted(experts)}")
    return out


def _tensor_type(name: str, tensor: torch.Tensor, gguf_type: str, kv_b_type: str) -> gguf.GGMLQuantizationType:
    """llama.cpp's choices: 1-D tensors and the router stay F32; attn_k_b/attn_v_b get
    `kv_b_type`; other matrices get `gguf_type`."""
    if tensor.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        return gguf.GGMLQuantizationType.F32
    if name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
        return gguf.GGMLQuantizationType[kv_b_type]
    return gguf.GGMLQuantizationType[gguf_type]


def _encode(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    data = tensor.to(torch.float32).numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _corpus(seed: int, n_words: int = 60000) -> list[str]:
    """Deterministic pseudo-text: syllable words, digits and punctuation (nothing downloaded)."""
    rng = np.random.default_rng(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "ch", "sh", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "ng", "ck"]
    words = []
    for _ in range(n_words):
        syl = rng.integers(1, 4)
        words.append("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                             + codas[rng.integers(len(codas))] for _ in range(syl)))
    lines, line = [], []
    for i, w in enumerate(words):
        if rng.random() < 0.08:
            w = w.capitalize()
        line.append(w)
        if rng.random() < 0.05:
            line.append(str(int(rng.integers(0, 10000))))
        if rng.random() < 0.08:
            lines.append(" ".join(line) + rng.choice([".", ",", "?", "!", ":"]))
            line = []
    return lines + ["The quick brown fox jumps over the lazy dog. Hello, world! 0123456789"]


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int, seed: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, the config says {vocab_size}")
    return tok.to_str()


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (`tokenizers` package), trained
    on `_corpus(seed)`; the training is cached per (vocab_size, seed) within a process."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size, seed))


def _write_tokenizer(tok, out_dir: Path) -> list[Path]:
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"]


# ----------------------------------------------------------------------------------------------
# GGUF


def _add_metadata(w: gguf.GGUFWriter, config: dict[str, Any], tok, gguf_type: str) -> None:
    """GLM-5's hyperparameters under the keys llama.cpp's `glm-dsa` conversion writes (and the
    tokenizer, when `tok` is given)."""
    heads = config["num_attention_heads"]
    rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    w.add_name(GGUF_NAME)
    file_type = gguf.LlamaFileType.ALL_F32 if gguf_type == "F32" else gguf.LlamaFileType[f"MOSTLY_{gguf_type}"]
    w.add_file_type(int(file_type))
    # llama.cpp counts the MTP (nextn) layers as blocks after the main ones
    w.add_block_count(config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0))
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)  # MLA is stored as MQA over the latent
    w.add_key_length(config["kv_lora_rank"] + rope)
    w.add_value_length(config["kv_lora_rank"])
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(config["v_head_dim"])
    w.add_q_lora_rank(config["q_lora_rank"])
    w.add_kv_lora_rank(config["kv_lora_rank"])
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_leading_dense_block_count(config["first_k_dense_replace"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_group_count(config["n_group"])
    w.add_expert_group_used_count(config["topk_group"])
    w.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    w.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if config["scoring_func"] == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_nextn_predict_layers(config.get("num_nextn_predict_layers", 0))
    w.add_indexer_head_count(config["index_n_heads"])
    w.add_indexer_key_length(config["index_head_dim"])
    w.add_indexer_top_k(config["index_topk"])
    if tok is None:
        return
    # tokenizer (llama.cpp's byte-level BPE form)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(SPECIAL_TOKENS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_chat_template(CHAT_TEMPLATE)


def shard_counts(n_tensors: int) -> list[int]:
    """Shard counts that split `n_tensors` into shards of ceil(n/k) tensors (the last may be smaller)."""
    return [k for k in range(1, n_tensors + 1) if math.ceil(n_tensors / math.ceil(n_tensors / k)) == k]


def write_gguf(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], tok, *,
               shards: int, gguf_type: str, kv_b_type: str | None = None) -> list[Path]:
    """Write `tensors` as `shards` GGUF files `<name>-0000K-of-0000N.gguf`; returns them in order."""
    kv_b_type = kv_b_type or gguf_type
    for label, value in (("gguf_type", gguf_type), ("kv_b_type", kv_b_type)):
        if value not in GGUF_TYPES:
            raise ValueError(f"{label} {value!r} is not one of {GGUF_TYPES}")
    if shards not in shard_counts(len(tensors)):
        raise ValueError(f"{len(tensors)} tensors cannot be split into {shards} shards; "
                         f"possible: {shard_counts(len(tensors))}")
    per_shard = math.ceil(len(tensors) / shards)
    base = out_dir / f"{GGUF_NAME}.gguf"
    w = gguf.GGUFWriter(base, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM_DSA],
                        split_max_tensors=per_shard if shards > 1 else 0)
    _add_metadata(w, config, tok, gguf_type)
    for name, t in tensors.items():
        qtype = _tensor_type(name, t, gguf_type, kv_b_type)
        data = _encode(t, qtype)
        plain = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(name, data, raw_dtype=None if plain else qtype)
    paths = w.format_shard_names(base) if shards > 1 else [base]
    if len(paths) != shards:
        raise RuntimeError(f"{len(tensors)} tensors split into {len(paths)} shards, not {shards}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if shards == 1:
        single = out_dir / f"{GGUF_NAME}-00001-of-00001.gguf"
        base.replace(single)
        paths = [single]
    return paths


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[tuple[Path, list[Path]]]:
    """A staging directory beside `out` and the list of files written into it; on a clean exit
    the files are moved into `out` (created if absent). A failure leaves `out` as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-staging-"))
    written: list[Path] = []
    try:
        yield staging, written
        out.mkdir(exist_ok=True)
        for path in written:
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_config_and_tokenizer(directory: Path, config: dict[str, Any], tok) -> list[Path]:
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [directory / "config.json"] + _write_tokenizer(tok, directory)


def write_tiny_glm5(out_dir: str | Path, *, gguf_shards: int = 3, safetensors: bool = True, seed: int = 0,
                    gguf_type: str = "Q8_0", kv_b_type: str | None = None,
                    config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the tiny GLM-5 model into `out_dir` (created if absent); deterministic for `seed`.

    Returns paths: `dir`, `config` (config.json), `tokenizer` (tokenizer.json,
    tokenizer_config.json), `safetensors` (model.safetensors or None) and `gguf` (the shards,
    in order). `gguf_shards=0` writes no GGUF. `gguf_type` is the type of the GGUF's matrices
    (1-D tensors and the router stay F32, as llama.cpp keeps them); `kv_b_type` that of
    attn_k_b/attn_v_b (default: `gguf_type`). vLLM's GGUF path needs the experts quantised
    (its GGUF MoE method takes quantised experts only), so the default is Q8_0.

    Everything is written into a staging directory beside `out_dir` first and moved into place
    at the end: bad arguments or a failed write leave `out_dir` as it was.
    """
    for label, value in (("gguf_type", gguf_type), ("kv_b_type", kv_b_type or gguf_type)):
        if value not in GGUF_TYPES:
            raise ValueError(f"{label} {value!r} is not one of {GGUF_TYPES}")
    config = dict(config or load_config())
    state = hf_state_dict(config, seed)
    tensors = gguf_tensors(config, state)
    if gguf_shards != 0 and gguf_shards not in shard_counts(len(tensors)):
        raise ValueError(f"gguf_shards {gguf_shards} is not possible for {len(tensors)} tensors "
                         f"(shards of equal tensor counts): use 0 or one of {shard_counts(len(tensors))}")
    tok = build_tokenizer(config["vocab_size"], seed)

    out = Path(out_dir)
    shards: list[Path] = []
    with _staged(out) as (staging, written):
        written += _write_config_and_tokenizer(staging, config, tok)
        if safetensors:
            from safetensors.torch import save_file

            written.append(staging / "model.safetensors")
            save_file(state, str(written[-1]), metadata={"format": "pt"})
        shards = write_gguf(staging, config, tensors, tok, shards=gguf_shards, gguf_type=gguf_type,
                            kv_b_type=kv_b_type) if gguf_shards else []
        written += shards
    return {
        "dir": out,
        "config": out / "config.json",
        "tokenizer": [out / "tokenizer.json", out / "tokenizer_config.json"],
        "safetensors": out / "model.safetensors" if safetensors else None,
        "gguf": [out / p.name for p in shards],
    }


# ----------------------------------------------------------------------------------------------
# Block-FP8 safetensors, as GLM-5's official FP8 checkpoints are laid out

FP8_BLOCK = (128, 128)
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_SCALE_SUFFIX = "_scale_inv"
# config.json's quantization_config of GLM-5-FP8 (read by vLLM's Fp8Config: quant_method,
# activation_scheme, weight_block_size, and modules_to_not_convert as its ignored layers);
# modules_to_not_convert is filled per model by fp8_quantization_config()
FP8_QUANTIZATION: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(FP8_BLOCK)}
# The matrices GLM-5's FP8 checkpoints keep in bf16: embeddings, lm_head, the MoE router
# (mlp.gate) and the indexer's per-head weights (indexer.weights_proj); norms and the router's
# correction bias are 1-D and never quantised. Every other matrix is FP8: q_a/q_b, kv_a/kv_b, o,
# the indexer's wq_b and wk, the dense MLP, the shared and the routed experts.
_FP8_KEPT_BF16 = ("model.embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight",
                  ".indexer.weights_proj.weight")


def fp8_block_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether GLM-5's FP8 checkpoints store this tensor as a block-FP8 weight."""
    return len(shape) == 2 and name.endswith(".weight") and not name.endswith(_FP8_KEPT_BF16)


def fp8_quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    """FP8_QUANTIZATION with modules_to_not_convert: the model's matrices kept in bf16, by module name."""
    kept = [name.removesuffix(".weight") for name, shape in hf_shapes(config).items()
            if len(shape) == 2 and not fp8_block_quantized(name, shape)]
    return {**FP8_QUANTIZATION, "modules_to_not_convert": kept}


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, cols] weight -> (float8_e4m3fn weight, float32 scale_inv [ceil(rows/R), ceil(cols/C)]).

    Each block's scale is its largest magnitude / 448 (1 for an all-zero block), so the block's
    largest value maps to e4m3's largest; weight ~= fp8 * scale_inv, block by block.
    """
    if weight.ndim != 2:
        raise ValueError(f"block-FP8 quantises matrices, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    n_r, n_c = _blocks(rows, cols, block)
    padded = torch.zeros(n_r * block[0], n_c * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    tiles = padded.view(n_r, block[0], n_c, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(n_r * block[0], n_c * block[1])[:rows, :cols].contiguous(), scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """float32 weight = fp8 * scale_inv, each scale over its block (the inverse of quantize_fp8_block)."""
    rows, cols = q.shape
    if tuple(scale_inv.shape) != _blocks(rows, cols, block):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not cover {rows} x {cols} in {block} blocks")
    full = scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]
    return q.to(torch.float32) * full


def fp8_block_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """hf_state_dict(config, seed) with every weight fp8_block_quantized() names as float8_e4m3fn,
    its `<name>_scale_inv` right after it; every other tensor as it is (bf16, the router bias fp32)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state_dict(config, seed).items():
        if fp8_block_quantized(name, tuple(tensor.shape)):
            out[name], out[name + FP8_SCALE_SUFFIX] = quantize_fp8_block(tensor)
        else:
            out[name] = tensor
    return out


def _shard_groups(state: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """The tensors in order, cut into `shards` runs of about equal bytes; a weight and its scale
    stay in one file (as the official checkpoints mostly keep them)."""
    units: list[list[str]] = []
    for name in state:
        if name.endswith(FP8_SCALE_SUFFIX) and units and units[-1][-1] == name.removesuffix(FP8_SCALE_SUFFIX):
            units[-1].append(name)
        else:
            units.append([name])
    if not 1 <= shards <= len(units):
        raise ValueError(f"shards {shards} is not possible for {len(units)} weights: use 1..{len(units)}")
    size = {n: t.numel() * t.element_size() for n, t in state.items()}
    total = sum(size.values())
    groups: list[list[str]] = [[]]
    done = 0
    for k, unit in enumerate(units):
        # start the next file once this one holds its share, leaving a weight for every file still to come
        full = done >= total * len(groups) / shards
        if groups[-1] and len(groups) < shards and (full or len(units) - k == shards - len(groups)):
            groups.append([])
        groups[-1] += unit
        done += sum(size[n] for n in unit)
    return groups


def write_safetensors_snapshot(directory: Path, state: dict[str, torch.Tensor], shards: int) -> list[Path]:
    """`state` as model-0000K-of-0000N.safetensors files and model.safetensors.index.json (tensor ->
    file, metadata.total_size: the tensors' bytes), the Hugging Face sharded layout; returns every path."""
    from safetensors.torch import save_file

    groups = _shard_groups(state, shards)
    paths, weight_map = [], {}
    for k, names in enumerate(groups, start=1):
        path = directory / f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(path), metadata={"format": "pt"})
        paths.append(path)
        weight_map.update(dict.fromkeys(names, path.name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    paths.append(directory / "model.safetensors.index.json")
    paths[-1].write_text(json.dumps(index, indent=2) + "\n")
    return paths


def write_tiny_glm5_fp8(out_dir: str | Path, *, shards: int = 4, seed: int = 0,
                        config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the tiny GLM-5 as a block-FP8 safetensors snapshot into `out_dir` (created if absent).

    The weights are write_tiny_glm5's for the same seed and config, quantised where GLM-5's FP8
    checkpoints are (fp8_block_quantized); config.json carries fp8_quantization_config(). Written
    into a staging directory first, like write_tiny_glm5. Returns paths: `dir`, `config`,
    `generation_config`, `tokenizer`, `safetensors` (the files, in order), `index`, and
    `fp8_weights` (how many weights are FP8).
    """
    config = dict(config or load_config())
    config["quantization_config"] = fp8_quantization_config(config)
    state = fp8_block_state_dict(config, seed)
    tok = build_tokenizer(config["vocab_size"], seed)
    out = Path(out_dir)
    with _staged(out) as (staging, written):
        written += _write_config_and_tokenizer(staging, config, tok)
        generation = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}
        written.append(staging / "generation_config.json")
        written[-1].write_text(json.dumps(generation, indent=2) + "\n")
        files = write_safetensors_snapshot(staging, state, shards)
        written += files
    return {
        "dir": out,
        "config": out / "config.json",
        "generation_config": out / "generation_config.json",
        "tokenizer": [out / "tokenizer.json", out / "tokenizer_config.json"],
        "safetensors": [out / p.name for p in files[:-1]],
        "index": out / files[-1].name,
        "fp8_weights": sum(1 for n in state if n + FP8_SCALE_SUFFIX in state),
    }
