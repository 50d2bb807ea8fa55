"""The tiny GLM-5 as a block-FP8 safetensors snapshot (mlafleet.lab.tinymodel.write_tiny_glm5_fp8),
read back with the `safetensors` package and put through the repository's own snapshot checks.

Most tests use a narrowed config (same structure, dimensions that are not multiples of 128, so
partial blocks are exercised) to stay fast; one writes the real tiny GLM-5, as the GPU run does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ansible_collections.mlafleet.fleet.plugins.module_utils import safetensors_check as check
from ansible_collections.mlafleet.fleet.plugins.module_utils import weights_stage
from mlafleet.lab.tinymodel import (FP8_BLOCK, FP8_E4M3_MAX, dequantize_fp8_block, fp8_block_quantized,
                                    hf_shapes, load_config, quantize_fp8_block, write_tiny_glm5,
                                    write_tiny_glm5_fp8)
from mlafleet.weights import shards as weights
from mlafleet.weights import snapshot

SEED = 5
# GLM-5's structure (MLA, indexer, a dense and an MoE layer) with small, block-unaligned sizes
SMALL = dict(load_config(), hidden_size=320, intermediate_size=384, moe_intermediate_size=192,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=200, kv_lora_rank=160,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=96, index_n_heads=4, index_head_dim=64,
             n_routed_experts=3)
# what GLM-5's FP8 checkpoints keep in bf16 among the matrices (norms and the router bias are 1-D)
KEPT = {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.1.self_attn.indexer.weights_proj.weight"}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("fp8")
    fp8 = write_tiny_glm5_fp8(work / "tiny-glm5-fp8", shards=3, seed=SEED, config=SMALL)
    bf16 = write_tiny_glm5(work / "tiny-glm5", gguf_shards=0, seed=SEED, config=SMALL)
    return {"fp8": fp8, "bf16": load_file(str(bf16["safetensors"]))}


def _read(paths: list[Path]) -> dict[str, dict]:
    """tensor -> {file, tensor} read with the safetensors package."""
    out = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for name in handle.keys():
                out[name] = {"file": path.name, "tensor": handle.get_tensor(name)}
    return out


def test_the_snapshot_is_laid_out_as_the_official_fp8_checkpoints(small: dict) -> None:
    fp8 = small["fp8"]
    assert sorted(p.name for p in fp8["dir"].iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads(fp8["config"].read_text())
    quant = config.pop("quantization_config")
    assert config == SMALL  # the bf16 writer's config, plus the quantization config
    assert {k: quant[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert sorted(quant["modules_to_not_convert"]) == sorted(n.removesuffix(".weight") for n in KEPT)
    assert json.loads(fp8["generation_config"].read_text()) == {"eos_token_id": 0, "pad_token_id": 0}
    assert fp8["fp8_weights"] == sum(1 for n, s in hf_shapes(SMALL).items() if len(s) == 2) - len(KEPT)


def test_the_index_covers_every_tensor_in_its_file(small: dict) -> None:
    fp8 = small["fp8"]
    index = json.loads(fp8["index"].read_text())
    read = _read(fp8["safetensors"])
    assert index["weight_map"] == {name: info["file"] for name, info in read.items()}
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    tensor_bytes = sum(i["tensor"].numel() * i["tensor"].element_size() for i in read.values())
    assert index["metadata"]["total_size"] == tensor_bytes
    assert len({i["file"] for i in read.values()}) == 3
    for name, info in read.items():  # each scale lies in its weight's file
        if name.endswith("_scale_inv"):
            assert read[name.removesuffix("_scale_inv")]["file"] == info["file"], name


def test_every_quantized_weight_is_e4m3_with_its_block_scale(small: dict) -> None:
    read = _read(small["fp8"]["safetensors"])
    bf16 = small["bf16"]
    quantized = {n for n, i in read.items() if i["tensor"].dtype == torch.float8_e4m3fn}
    assert set(read) == set(bf16) | {n + "_scale_inv" for n in quantized}
    assert quantized == {n for n, t in bf16.items() if t.ndim == 2 and n not in KEPT}
    assert quantized == {n for n, t in bf16.items() if fp8_block_quantized(n, tuple(t.shape))}
    for name in quantized:
        weight, scale = read[name]["tensor"], read[name + "_scale_inv"]["tensor"]
        assert weight.shape == bf16[name].shape
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == (math.ceil(weight.shape[0] / 128), math.ceil(weight.shape[1] / 128)), name
    # partial blocks are there: kv_a_proj (160 + 32 rows, 320 columns) has a half block each way
    assert read["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]["tensor"].shape == (2, 3)
    for name in set(read) - quantized - {n + "_scale_inv" for n in quantized}:  # the rest is bf16's, bit for bit
        assert torch.equal(read[name]["tensor"], bf16[name]) and read[name]["tensor"].dtype == bf16[name].dtype, name
    assert read["model.layers.1.mlp.gate.e_score_correction_bias"]["tensor"].dtype == torch.float32


def test_dequantized_weights_match_the_bf16_writer_within_e4m3_error(small: dict) -> None:
    read = _read(small["fp8"]["safetensors"])
    checked = 0
    for name, reference in small["bf16"].items():
        if name + "_scale_inv" not in read:
            continue
        q, scale = read[name]["tensor"], read[name + "_scale_inv"]["tensor"]
        w = reference.to(torch.float32)
        deq = dequantize_fp8_block(q, scale)
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        # e4m3: 3 mantissa bits (rounding error <= 2^-4 of the value), subnormal steps of 2^-9
        # (error <= 2^-10), in units of the block's scale
        bound = torch.maximum(w.abs() * 2.0**-4, full * 2.0**-10) * (1 + 1e-6) + 1e-12
        assert bool(((deq - w).abs() <= bound).all()), name
        assert (deq - w).norm() / w.norm() < 0.04, name
        # each block's largest magnitude is e4m3's largest: the block scale is amax / 448
        assert q.to(torch.float32).abs().max() == FP8_E4M3_MAX
        checked += 1
    assert checked == small["fp8"]["fp8_weights"]


def test_quantize_edge_cases() -> None:
    zero = torch.zeros(130, 5)
    q, s = quantize_fp8_block(zero)
    assert s.shape == (2, 1) and torch.equal(s, torch.ones(2, 1)) and torch.equal(dequantize_fp8_block(q, s), zero)
    exact = torch.tensor([[448.0, -2.0, 0.5], [1.0, 0.0, -448.0]])
    q, s = quantize_fp8_block(exact)
    assert s.item() == 1.0 and torch.equal(dequantize_fp8_block(q, s), exact)
    with pytest.raises(ValueError, match="matrices"):
        quantize_fp8_block(torch.ones(4))
    with pytest.raises(ValueError, match="does not cover"):
        dequantize_fp8_block(q, torch.ones(2, 1))
    assert FP8_BLOCK == (128, 128)


def _copy(fp8: dict, dest: Path) -> Path:
    dest.mkdir()
    for path in fp8["dir"].iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    return dest


def _drop(directory: Path, tensor: str, from_index: bool) -> None:
    index = json.loads((directory / check.INDEX).read_text())
    file = directory / index["weight_map"][tensor]
    state = load_file(str(file))
    del state[tensor]
    save_file(state, str(file), metadata={"format": "pt"})
    if from_index:
        del index["weight_map"][tensor]
        (directory / check.INDEX).write_text(json.dumps(index))


def test_the_repository_checks_accept_it_and_refuse_it_without_a_scale(small: dict, tmp_path: Path) -> None:
    directory = small["fp8"]["dir"]
    names = sorted(p.name for p in directory.iterdir())
    result = check.check_snapshot(str(directory), names)
    assert result["fp8_weights"] == small["fp8"]["fp8_weights"] and result["weight_block_size"] == [128, 128]
    assert result["tensors"] == len(json.loads(small["fp8"]["index"].read_text())["weight_map"])
    manifest = snapshot.build_from_directory(directory)
    assert manifest["fp8_weights"] == result["fp8_weights"] and manifest["safetensors_count"] == 3
    assert manifest["revision"] is None and manifest["model"] == "tiny-glm5-fp8"
    assert [f.name for f in weights_stage.check_manifest(manifest)] == names
    assert weights.main(["weights", "check", str(directory)]) == 0

    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    gone = _copy(small["fp8"], tmp_path / "no-scale")
    _drop(gone, scale, from_index=True)  # index and header agree, the scale is missing
    with pytest.raises(check.CheckError, match=r"block-FP8 checkpoint \(weight_block_size \[128, 128\]\): "
                                               r"model-0000\d-of-00003\.safetensors: FP8 weight "
                                               r"'model\.layers\.1\.self_attn\.o_proj\.weight' \[320, 192\] has no "
                                               r"scale 'model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv'$"):
        check.check_snapshot(str(gone), names)
    with pytest.raises(snapshot.SnapshotError, match="has no scale"):
        snapshot.build_from_directory(gone)
    assert weights.main(["weights", "check", str(gone)]) != 0

    stale = _copy(small["fp8"], tmp_path / "stale-index")
    _drop(stale, scale, from_index=False)  # the index still lists it, the file does not hold it
    with pytest.raises(check.CheckError,
                       match=f"the index assigns tensor '{scale}' to it, its header does not hold it"):
        check.check_snapshot(str(stale), names)


def test_bad_shard_counts_write_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shards 0 is not possible"):
        write_tiny_glm5_fp8(tmp_path / "m", shards=0, config=SMALL)
    with pytest.raises(ValueError, match="shards 1000 is not possible"):
        write_tiny_glm5_fp8(tmp_path / "m", shards=1000, config=SMALL)
    assert list(tmp_path.iterdir()) == []


def test_the_real_tiny_glm5_as_the_gpu_run_writes_it(tmp_path: Path) -> None:
    """GLM-5's attention geometry: 44 FP8 weights over 4 files, the shapes vLLM's loader will see."""
    fp8 = write_tiny_glm5_fp8(tmp_path / "tiny-glm5-fp8")
    names = sorted(p.name for p in fp8["dir"].iterdir())
    result = check.check_snapshot(str(fp8["dir"]), names)
    assert result["summary"] == ("4 of 4 safetensors headers match the index (107 tensors); "
                                 "44 FP8 weights each with its 128x128 block scale")
    headers = {}
    for path in fp8["safetensors"]:
        headers.update(check.read_header(str(path)))
    expect = {  # weight -> its scale's shape (ceil(rows/128), ceil(cols/128))
        "model.layers.0.self_attn.q_a_proj.weight": [4, 8],
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": [5, 8],  # 512 + 64 rows
        "model.layers.0.self_attn.kv_b_proj.weight": [224, 4],
        "model.layers.0.self_attn.o_proj.weight": [8, 128],
        "model.layers.0.self_attn.indexer.wq_b.weight": [32, 4],
        "model.layers.0.self_attn.indexer.wk.weight": [1, 8],
        "model.layers.1.mlp.experts.7.down_proj.weight": [8, 2],
        "model.layers.1.mlp.shared_experts.gate_proj.weight": [2, 8],
    }
    for name, shape in expect.items():
        assert headers[name]["dtype"] == "F8_E4M3" and headers[name + "_scale_inv"] == {"dtype": "F32", "shape": shape}
    for name in KEPT:
        assert headers[name]["dtype"] == "BF16", name
