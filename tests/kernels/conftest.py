"""Kernel tests run on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (Triton decides at decoration
time whether a @triton.jit function is compiled or interpreted). `make test` exports it; this
file sets it too for a direct `pytest tests/kernels`, and refuses to run the kernels if Triton
was already imported without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _interpreter_active() -> None:
    from mlafleet.kernels import sparse_mla

    if not sparse_mla._interpreted():
        pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set: run the suite with "
                    "TRITON_INTERPRET=1 in the environment (as `make test` does)")


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh seeded generator per test: random inputs, reproducible failures."""
    return torch.Generator().manual_seed(20261129)
