"""pytest plugin: vLLM's own sparse-MLA backend tests, with TRITON_MLA_SPARSE among their backends.

    cd <vllm sdist>; python -m pytest -p vllm_sparse_mla_plugin tests/v1/attention/test_sparse_mla_backends.py
    (this folder on PYTHONPATH, the patched vLLM importable)

vLLM's `tests/v1/attention/test_sparse_mla_backends.py` (in the vLLM sdist of each release on
PyPI) is the conformance suite for a sparse-MLA backend: its tests take the backend class as the
parameter `backend_cls`. This plugin appends our backend to every such parametrisation, with the
id "TritonMLASparse", before pytest expands it; no test body, assertion or skip is changed.
"""

from __future__ import annotations

import pytest

BACKEND_PATH = "vllm.v1.attention.backends.mla.triton_mla_sparse"
BACKEND_ID = "TritonMLASparse"


def _ours():
    import importlib

    return importlib.import_module(BACKEND_PATH).TritonMLASparseBackend


def with_our_backend(mark: pytest.Mark, backend) -> pytest.Mark:
    """A `parametrize("backend_cls", [...], ids=[...])` mark with our backend appended."""
    argnames, values = mark.args[0], list(mark.args[1])
    kwargs = dict(mark.kwargs)
    if backend in values:
        return mark
    ids = kwargs.pop("ids", None)
    if ids is not None and not callable(ids):
        ids = [*ids, BACKEND_ID]
    return pytest.mark.parametrize(argnames, [*values, backend], ids=ids, **kwargs).mark


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_cls" not in metafunc.fixturenames:
        return
    markers = metafunc.definition.own_markers
    for i, mark in enumerate(markers):
        if mark.name == "parametrize" and mark.args and mark.args[0] == "backend_cls":
            markers[i] = with_our_backend(mark, _ours())
