"""The lab's model: a tiny random-weight Llama that vLLM's CPU build serves in seconds.

Written by the project itself (no hub): a transformers-style config, a byte-level BPE
tokenizer trained with the `tokenizers` package on a small built-in text, and float32
weights in safetensors. Deterministic for a seed, so every controller writes the same files.
Head dim 64: vLLM's CPU attention supports only some head sizes (32, 64, 80, ...), and a
model outside them starts, answers /health and then fails every completion.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN = 128
HEADS = 2
LAYERS = 2
INTERMEDIATE = 256
VOCAB = 512
MAX_POSITIONS = 2048

_CORPUS = """mlafleet rolls out vLLM to fleets of GPU hosts, batch by batch, and rolls back a batch
that fails its smoke test. The quick brown fox jumps over the lazy dog. Hello, world!
The patch set adds a Triton sparse attention backend, a DeepGEMM-free indexer and a GGUF
loader for GLM-5. Operators run ansible-playbook site.yml, molecule test and rollback.yml.
0 1 2 3 4 5 6 7 8 9 10 100 1000. What is the capital of France? Paris is the capital.
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL[0], "bos_token": SPECIAL[0],
        "pad_token": SPECIAL[0], "unk_token": None, "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return tok.get_vocab_size()


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float32),
         "lm_head.weight": normal(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            w[f"{p}self_attn.{proj}_proj.weight"] = normal(HIDDEN, HIDDEN)
        w[f"{p}mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[f"{p}mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[f"{p}mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        w[f"{p}input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        w[f"{p}post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    return w


def write_tiny_llama(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Llama (config, tokenizer, weights) to `out_dir` and return it."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out)
    if vocab > VOCAB:
        raise ValueError(f"tokenizer has {vocab} tokens, more than the model's {VOCAB}")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HIDDEN // HEADS,
        "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}) + "\n")
    save_file(_weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
