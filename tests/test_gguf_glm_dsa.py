"""The patch sets' GLM-5 GGUF module (mlafleet/patchset/gguf_glm_dsa.py, shipped into vLLM 0.20.2 and into
vllm-gguf-plugin 0.0.5 for vLLM 0.32.0) on its own, in the controller's Python.

The module imports only gguf, numpy and torch, so it runs here directly; the same file runs inside
vLLM in tests/test_gguf_vllm.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace

import gguf
import pytest
import torch
from safetensors.torch import load_file

from mlafleet.lab.tinymodel import load_config, split_kv_b, write_tiny_glm5

MODULE = Path(__file__).resolve().parent.parent / "mlafleet/patchset/gguf_glm_dsa.py"


@pytest.fixture(scope="module")
def glm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gguf_glm_dsa", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config() -> SimpleNamespace:
    return SimpleNamespace(**load_config())


@pytest.fixture(scope="module")
def model_q8(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_tiny_glm5(tmp_path_factory.mktemp("q8"), gguf_shards=3, gguf_type="Q8_0", seed=5)


def _collect(glm: ModuleType, paths: list[Path], config: SimpleNamespace) -> dict[str, torch.Tensor]:
    files = [str(p) for p in paths]
    return dict(glm.weights_iterator(files, glm.weights_map(config), torch.bfloat16))


def test_map_covers_exactly_the_written_tensors(glm: ModuleType, config: SimpleNamespace, model_q8: dict) -> None:
    mapping = glm.weights_map(config)
    written = {t.name for p in model_q8["gguf"] for t in gguf.GGUFReader(p).tensors}
    assert set(mapping) == written
    assert mapping["blk.1.exp_probs_b.bias"] == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert mapping["blk.0.attn_k_b.weight"] == mapping["blk.0.attn_v_b.weight"] == "model.layers.0.self_attn.kv_b_proj.weight"
    assert mapping["blk.0.indexer.attn_k.weight"] == "model.layers.0.self_attn.indexer.wk.weight"
    assert mapping["blk.0.indexer.proj.weight"] == "model.layers.0.self_attn.indexer.weights_proj.weight"
    assert mapping["blk.1.ffn_down_exps.weight"] == "model.layers.1.mlp.experts.0.down_proj.weight"


def test_rebuild_undoes_the_split(glm: ModuleType) -> None:
    kv_b = torch.randn(64 * 448, 512)
    k_b, v_b = split_kv_b(kv_b, 64, 192, 256)
    assert torch.equal(glm.rebuild_kv_b(k_b, v_b), kv_b)
    with pytest.raises(ValueError, match="halves"):
        glm.rebuild_kv_b(k_b, v_b[:, :, :10])


def test_kv_b_exact_from_bf16_halves_through_all_shards(glm: ModuleType, config: SimpleNamespace, tmp_path: Path) -> None:
    paths = write_tiny_glm5(tmp_path, gguf_shards=3, gguf_type="Q8_0", kv_b_type="BF16", seed=6)
    ref = load_file(str(paths["safetensors"]))
    got = _collect(glm, paths["gguf"], config)
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], ref[name])
    # every tensor of every shard came through (as itself, its raw bytes, or in kv_b_proj)
    mapping = glm.weights_map(config)
    for shard in paths["gguf"]:
        for t in gguf.GGUFReader(shard).tensors:
            name = mapping[t.name]
            assert name in got or name.removesuffix(".weight") + ".qweight" in got, (shard.name, t.name)


def test_quantised_halves_are_dequantised(glm: ModuleType, config: SimpleNamespace, model_q8: dict) -> None:
    ref = load_file(str(model_q8["safetensors"]))
    got = _collect(glm, model_q8["gguf"], config)
    tensors = {t.name: t for p in model_q8["gguf"] for t in gguf.GGUFReader(p).tensors}
    k_b = torch.from_numpy(gguf.quants.dequantize(tensors["blk.1.attn_k_b.weight"].data, gguf.GGMLQuantizationType.Q8_0))
    v_b = torch.from_numpy(gguf.quants.dequantize(tensors["blk.1.attn_v_b.weight"].data, gguf.GGMLQuantizationType.Q8_0))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(got[name], glm.rebuild_kv_b(k_b, v_b).to(torch.bfloat16))
    assert torch.allclose(got[name].float(), ref[name].float(), atol=2e-3)
    # quantised tensors of quantisable layers stay raw bytes with their type announced first
    names = list(got)
    assert "model.layers.1.self_attn.q_b_proj.qweight" in got
    assert names.index("model.layers.1.self_attn.q_b_proj.qweight_type") < names.index("model.layers.0.self_attn.q_a_proj.qweight")
    assert int(got["model.layers.1.self_attn.q_b_proj.qweight_type"]) == int(gguf.GGMLQuantizationType.Q8_0)
    # the indexer's wk is dense in vLLM: dequantised
    wk = got["model.layers.0.self_attn.indexer.wk.weight"]
    assert wk.dtype == torch.bfloat16 and torch.allclose(wk.float(), ref["model.layers.0.self_attn.indexer.wk.weight"].float(), atol=2e-3)


def test_a_missing_shard_is_an_error(glm: ModuleType, model_q8: dict, tmp_path: Path) -> None:
    shards = [str(p) for p in model_q8["gguf"]]
    assert glm.all_gguf_shards(shards[1]) == shards
    for s in (shards[0], shards[2]):
        (tmp_path / Path(s).name).symlink_to(s)
    with pytest.raises(FileNotFoundError, match=r"split into 3 shards but 1 is missing: .*tiny-glm5-00002-of-00003\.gguf"):
        glm.all_gguf_shards(str(tmp_path / Path(shards[0]).name))
    assert glm.all_gguf_shards(str(tmp_path / "plain.gguf")) == [str(tmp_path / "plain.gguf")]
    for bad in ("m-00004-of-00003.gguf", "m-00000-of-00003.gguf"):
        with pytest.raises(ValueError, match="does not name a shard"):
            glm.all_gguf_shards(str(tmp_path / bad))


def test_the_iterator_refuses_an_incomplete_set(glm: ModuleType, config: SimpleNamespace, model_q8: dict) -> None:
    files = [str(p) for p in model_q8["gguf"]]
    with pytest.raises(ValueError, match="is not shard 1 of 2"):
        list(glm.weights_iterator(files[:2], glm.weights_map(config), torch.bfloat16))
    mapping = dict(glm.weights_map(config), **{"blk.0.attn_extra.weight": "model.layers.0.extra.weight"})
    with pytest.raises(ValueError, match="blk.0.attn_extra.weight"):
        list(glm.weights_iterator(files, mapping, torch.bfloat16))


def test_config_from_metadata(glm: ModuleType, model_q8: dict) -> None:
    got = glm.config_dict_from_gguf(model_q8["gguf"][0])
    expected = load_config()
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads",
                "index_head_dim", "n_routed_experts", "first_k_dense_replace", "mlp_layer_types", "vocab_size"):
        assert got[key] == expected[key], key
    with pytest.raises(ValueError, match="lacks general.architecture"):
        glm.config_dict_from_gguf(model_q8["gguf"][1])  # only the first shard carries the metadata


def test_config_of_a_model_with_mtp_layers(glm: ModuleType, tmp_path: Path) -> None:
    """llama.cpp counts GLM-5's MTP (nextn) layers as blocks: 78 main + 1 MTP = block_count 79."""
    from mlafleet.lab.tinymodel import _add_metadata

    glm5 = dict(load_config(), num_hidden_layers=78, num_nextn_predict_layers=1, first_k_dense_replace=3,
                hidden_size=6144, q_lora_rank=2048, n_routed_experts=256, num_experts_per_tok=8,
                vocab_size=154880, max_position_embeddings=202752)
    path = tmp_path / "meta-only.gguf"
    writer = gguf.GGUFWriter(path, "glm-dsa")
    _add_metadata(writer, glm5, None, "Q8_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf.GGUFReader(path).get_field("glm-dsa.block_count").contents() == 79
    got = glm.config_dict_from_gguf(path)
    assert got["num_hidden_layers"] == 78 and got["num_nextn_predict_layers"] == 1
    assert got["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 75
    assert (got["hidden_size"], got["q_lora_rank"], got["n_routed_experts"], got["vocab_size"]) == (6144, 2048, 256, 154880)
    assert (got["num_attention_heads"], got["kv_lora_rank"], got["qk_nope_head_dim"], got["v_head_dim"]) == (64, 512, 192, 256)


def test_an_old_gguf_package_is_named(glm: ModuleType) -> None:
    assert glm.glm_dsa_arch() is gguf.MODEL_ARCH.GLM_DSA
    old = SimpleNamespace(MODEL_ARCH=SimpleNamespace(DEEPSEEK2=1), __file__="/old/gguf/__init__.py")
    with pytest.raises(RuntimeError, match=r"/old/gguf/__init__.py.*GLM_DSA.*gguf 0.19.0"):
        glm.glm_dsa_arch(old)
