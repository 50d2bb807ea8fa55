"""Load the tiny GLM-5 block-FP8 safetensors snapshot through vLLM 0.32.0's own loader, on the CPU.

    python fp8_block_load.py MODEL_DIR OUT_DIR   (PYTHONPATH: a patched vLLM 0.32.0 tree)

What runs is vLLM's path for a GLM-5-FP8 checkpoint: EngineArgs -> create_engine_config (the fp8
quantization_config of config.json read into Fp8Config) -> DefaultModelLoader.load_model (the
model built with Fp8LinearMethod / Fp8MoEMethod parameters) -> GlmMoeDsaForCausalLM.load_weights
over the sharded files and their index. Three stand-ins, all outside the loader: the CPU platform
has no sparse-MLA backend, so it is told to name TRITON_MLA_SPARSE (built, never run); vLLM's
CPU FP8 GEMM kernel wants AMX (a Sapphire Rapids CPU) before it is chosen, so it is told it may
be (chosen, never run: which GEMM the GPU picks is the GPU's, see docs/e2e-h200.md); and the
post-load processing (the kernels' weight layouts, MLA weight absorption) is skipped: the
parameters are compared as loaded. Writes OUT_DIR/report.json (the quantization
vLLM read, which method each layer got, the loaded names) and each parameter as OUT_DIR/<name>.pt.
"""

import json
import os
import sys

import torch

model_dir, out_dir = sys.argv[1], sys.argv[2]

from single_rank import record_loaded_names, single_cpu_rank  # noqa: E402  (this directory)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import base_loader, get_model_loader  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

type(current_platform).get_attn_backend_cls = classmethod(
    lambda cls, *a, **k: "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend")
base_loader.process_weights_after_loading = lambda *a, **k: None
from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_scaled_mm  # noqa: E402

cpu_scaled_mm.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, *a, **k: (True, None))

from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM  # noqa: E402

report = {}
args = EngineArgs(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=4096,
                  distributed_executor_backend="uni")
vc = args.create_engine_config()
report["architectures"] = vc.model_config.architectures
report["quantization"] = vc.model_config.quantization
report["quant_config"] = {"class": type(vc.quant_config).__name__,
                          "weight_block_size": vc.quant_config.weight_block_size,
                          "activation_scheme": vc.quant_config.activation_scheme,
                          "ignored_layers": vc.quant_config.ignored_layers}
loaded = {}
record_loaded_names(GlmMoeDsaForCausalLM, loaded)
with single_cpu_rank(vc):
    loader = get_model_loader(vc.load_config)
    report["loader"] = f"{type(loader).__module__}.{type(loader).__qualname__}"
    model = loader.load_model(vc, vc.model_config)
report["methods"] = {name: type(m.quant_method).__name__ for name, m in model.named_modules()
                     if getattr(m, "quant_method", None) is not None}
report["attention_impls"] = sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})
params = {}
for name, p in model.named_parameters():
    params[name] = {"shape": list(p.shape), "dtype": str(p.dtype)}
    torch.save(p.data, os.path.join(out_dir, name + ".pt"))
report["params"] = params
report["loaded"] = loaded["names"]
with open(os.path.join(out_dir, "report.json"), "w") as handle:
    json.dump(report, handle)
