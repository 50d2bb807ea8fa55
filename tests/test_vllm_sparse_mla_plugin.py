"""bench/vllm_sparse_mla_plugin.py: our backend joins a test module's backend_cls parameters.

A real pytest run (pytester-free: a subprocess) over a module shaped like vLLM's
test_sparse_mla_backends.py, with a stand-in backend module on the path as the plugin's import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODULE = '''
import pytest

class FlashMLASparseBackend: pass
class FlashInferMLASparseBackend: pass

@pytest.mark.parametrize("backend_cls", [FlashMLASparseBackend, FlashInferMLASparseBackend],
                         ids=["FlashMLA", "FlashInfer"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode(backend_cls, kv_cache_dtype):
    assert backend_cls.__name__.endswith("Backend")

def test_untouched():
    pass
'''


def test_plugin_appends_our_backend(tmp_path: Path) -> None:
    backend = tmp_path / "vllm" / "v1" / "attention" / "backends" / "mla"
    backend.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm/v1", tmp_path / "vllm/v1/attention",
              tmp_path / "vllm/v1/attention/backends", backend):
        (d / "__init__.py").write_text("")
    (backend / "triton_mla_sparse.py").write_text("class TritonMLASparseBackend: pass\n")
    (tmp_path / "test_shape.py").write_text(MODULE)
    env_path = f"{REPO / 'bench'}:{tmp_path}"
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "vllm_sparse_mla_plugin", "-q", "--collect-only",
                          "-p", "no:cacheprovider", str(tmp_path / "test_shape.py")],
                         capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": env_path}, timeout=120)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(i.split("::")[1] for i in ids) == sorted(
        [f"test_decode[{dtype}-{backend}]" for dtype in ("auto", "fp8")
         for backend in ("FlashMLA", "FlashInfer", "TritonMLASparse")] + ["test_untouched"])
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "vllm_sparse_mla_plugin", "-q", "-p",
                          "no:cacheprovider", str(tmp_path / "test_shape.py")],
                         capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": env_path}, timeout=120)
    assert "7 passed" in run.stdout, run.stdout
