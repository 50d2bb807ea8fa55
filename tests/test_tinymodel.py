"""The tiny GLM-5 writer: files, naming and layout as llama.cpp's glm-dsa conversion, determinism."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from mlafleet.lab.tinymodel import (_trained_tokenizer_json, build_tokenizer, hf_state_dict, load_config,
                                shard_counts, split_kv_b,
                                write_tiny_glm5)


def _digest(paths: list[Path]) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_tiny_glm5(tmp_path_factory.mktemp("tiny") / "m", gguf_shards=3, seed=0)


def test_files_and_shard_names(written: dict) -> None:
    assert [p.name for p in written["gguf"]] == [f"tiny-glm5-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    assert json.loads(written["config"].read_text()) == load_config()
    assert written["safetensors"].is_file()
    assert sum(p.stat().st_size for p in written["gguf"]) < 130e6


def test_gguf_uses_glm_dsa_names_and_split_metadata(written: dict) -> None:
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GLM_DSA]}
    names: list[str] = []
    for k, path in enumerate(written["gguf"]):
        reader = gguf.GGUFReader(path)
        assert reader.get_field("split.no").contents() == k
        assert reader.get_field("split.count").contents() == 3
        assert reader.tensors, f"{path.name} holds no tensor"
        names += [t.name for t in reader.tensors]
    first = gguf.GGUFReader(written["gguf"][0])
    assert first.get_field("general.architecture").contents() == "glm-dsa"
    assert first.get_field("glm-dsa.attention.indexer.top_k").contents() == 2048
    generic = {n.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.") for n in names}
    assert generic <= allowed
    assert len(names) == len(set(names)) == first.get_field("split.tensors.count").contents()
    for layer in (0, 1):
        for t in ("attn_k_b", "attn_v_b", "indexer.attn_k", "indexer.attn_q_b", "indexer.k_norm", "indexer.proj"):
            assert f"blk.{layer}.{t}.weight" in names
        assert f"blk.{layer}.attn_kv_b.weight" not in names
    assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.exp_probs_b.bias" in names


def test_gguf_shapes_follow_llama_cpp(written: dict) -> None:
    tensors = {t.name: t for p in written["gguf"] for t in gguf.GGUFReader(p).tensors}
    # GGUF lists dimensions innermost first: k_b is [heads, kv_lora, qk_nope], v_b [heads, v_head, kv_lora]
    assert list(tensors["blk.0.attn_k_b.weight"].shape) == [192, 512, 64]
    assert list(tensors["blk.0.attn_v_b.weight"].shape) == [512, 256, 64]
    assert list(tensors["blk.1.ffn_up_exps.weight"].shape) == [1024, 256, 8]
    assert tensors["blk.0.attn_q_b.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_shard_counts() -> None:
    assert shard_counts(44)[:4] == [1, 2, 3, 4] and 40 not in shard_counts(44) and 44 in shard_counts(44)


def test_split_kv_b_per_head() -> None:
    heads, nope, v, lora = 4, 3, 2, 5
    kv_b = torch.arange(heads * (nope + v) * lora, dtype=torch.float32).reshape(heads * (nope + v), lora)
    k_b, v_b = split_kv_b(kv_b, heads, nope, v)
    assert k_b.shape == (heads, lora, nope) and v_b.shape == (heads, v, lora)
    h = 2
    assert torch.equal(k_b[h], kv_b[h * (nope + v): h * (nope + v) + nope].T)
    assert torch.equal(v_b[h], kv_b[h * (nope + v) + nope: (h + 1) * (nope + v)])
    with pytest.raises(ValueError, match="rows"):
        split_kv_b(kv_b, heads + 1, nope, v)


def test_safetensors_hold_the_checkpoint(written: dict) -> None:
    state = load_file(str(written["safetensors"]))
    assert state.keys() == hf_state_dict(load_config(), 0).keys()
    assert state["model.layers.0.self_attn.kv_b_proj.weight"].shape == (64 * 448, 512)
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert state["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == torch.bfloat16


def test_deterministic_for_a_seed(written: dict, tmp_path: Path) -> None:
    _trained_tokenizer_json.cache_clear()  # train the tokenizer again too
    again = write_tiny_glm5(tmp_path / "same", gguf_shards=3, seed=0)
    assert _digest(again["gguf"] + [again["safetensors"]] + again["tokenizer"]) == \
        _digest(written["gguf"] + [written["safetensors"]] + written["tokenizer"])
    other = hf_state_dict(load_config(), 1)
    assert not torch.equal(other["model.layers.0.self_attn.kv_b_proj.weight"],
                           load_file(str(written["safetensors"]))["model.layers.0.self_attn.kv_b_proj.weight"])


def test_tokenizer_has_the_config_vocab_and_round_trips(written: dict) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(written["dir"] / "tokenizer.json"))
    assert tok.get_vocab_size() == load_config()["vocab_size"]
    assert tok.token_to_id("<|endoftext|>") == load_config()["eos_token_id"]
    text = "Hello, GLM-5 on Blackwell! 12345 ünïcode"
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode("the quick brown fox").ids) < len("the quick brown fox")
    reader = gguf.GGUFReader(written["gguf"][0])
    assert len(reader.get_field("tokenizer.ggml.tokens").data) == tok.get_vocab_size()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gguf_type"):
        write_tiny_glm5(tmp_path / "x", gguf_type="Q3_K")
    with pytest.raises(ValueError, match="gguf_shards"):
        write_tiny_glm5(tmp_path / "y", gguf_shards=-1)
    with pytest.raises(ValueError, match="gguf_shards"):
        write_tiny_glm5(tmp_path / "z", gguf_shards=1000)
    with pytest.raises(ValueError, match=r"gguf_shards 40 is not possible for 44 tensors"):
        write_tiny_glm5(tmp_path / "w", gguf_shards=40)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written


def test_build_tokenizer_refuses_a_vocab_it_cannot_fill() -> None:
    with pytest.raises(RuntimeError, match="tokens"):
        build_tokenizer(10_000_000)
