"""Load a tiny GLM-5 GGUF through vLLM 0.32.0's GGUF support (the patched vllm-gguf-plugin), on the CPU.

    python gguf_plugin_load.py MODEL_DIR SHARD1 OUT_DIR   (PYTHONPATH: a patched vLLM 0.32.0 tree)

What runs is vLLM's own path with the plugin registered the way vLLM registers it (its
`vllm.general_plugins` entry point): EngineArgs -> create_engine_config (the plugin turns the
GGUF into model = its directory, quantization and load format gguf) -> the plugin's
GGUFModelLoader.load_model -> GlmMoeDsaForCausalLM.load_weights. Two stand-ins, both outside the
loader: the CPU platform has no sparse-MLA backend, so it is told to name TRITON_MLA_SPARSE (the
attention implementation object is built, never run); and post-load processing (MLA weight
absorption, GGUF kernels) needs CUDA, so it is skipped. Writes OUT_DIR/report.json and each
loaded (materialised) parameter as OUT_DIR/<name>.pt.
"""

import json
import os
import sys

import torch

model_dir, shard1, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]

from torch.nn.parameter import UninitializedParameter  # noqa: E402

from single_rank import record_loaded_names, single_cpu_rank  # noqa: E402  (this directory)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()  # vllm-gguf-plugin registers itself through its entry point
import vllm_gguf_plugin.loader as plugin_loader  # noqa: E402

type(current_platform).get_attn_backend_cls = classmethod(
    lambda cls, *a, **k: "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend")
plugin_loader.process_weights_after_loading = lambda *a, **k: None

from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM  # noqa: E402

report = {"plugin": plugin_loader.__file__}
args = EngineArgs(model=shard1, tokenizer=model_dir, dtype="bfloat16", enforce_eager=True,
                  max_model_len=4096, distributed_executor_backend="uni")
vc = args.create_engine_config()
report["architectures"] = vc.model_config.architectures
report["quantization"] = vc.model_config.quantization
report["load_format"] = str(vc.load_config.load_format)
report["config"] = vc.model_config.hf_config.to_dict()
loaded = {}
record_loaded_names(GlmMoeDsaForCausalLM, loaded)
with single_cpu_rank(vc):
    loader = get_model_loader(vc.load_config)
    report["loader"] = f"{type(loader).__module__}.{type(loader).__qualname__}"
    model = loader.load_model(vc, vc.model_config)
    adapter = loader._prepare_adapter(vc.model_config)
    report["adapter"] = type(adapter).__name__
    report["shards"] = adapter.load_spec.weights_source
    report["unquantized_modules"] = sorted(set(vc.quant_config.unquantized_modules))
    report["attention_impls"] = sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})
    # a shard gone: the plugin must refuse, naming it
    partial = os.path.join(out_dir, "partial")
    os.makedirs(partial)
    for shard in report["shards"][::2]:
        os.symlink(shard, os.path.join(partial, os.path.basename(shard)))
    try:
        adapter._get_all_gguf_files(os.path.join(partial, os.path.basename(shard1)))
        report["missing_shard_error"] = None
    except FileNotFoundError as exc:
        report["missing_shard_error"] = str(exc)
params = {}
for name, p in model.named_parameters():
    if isinstance(p, UninitializedParameter):  # GGUF fused layers: shards collected, merged after loading
        params[name] = {"pending_shards": len(getattr(p, "data_container", []))}
    else:
        params[name] = {"shape": list(p.shape), "dtype": str(p.dtype)}
        torch.save(p.data, os.path.join(out_dir, name + ".pt"))
report["params"] = params
report["loaded"] = loaded["names"]
with open(os.path.join(out_dir, "report.json"), "w") as handle:
    json.dump(report, handle)
