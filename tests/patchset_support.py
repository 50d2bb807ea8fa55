"""Building the real patch sets in tests: from the pinned wheels in the download cache (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pinned_wheels(version: str) -> dict[str, Path]:
    """A patch set's pinned wheels from the download cache, by distribution (tests never download)."""
    from mlafleet.patchset import builder as patchset

    wheels = patchset.cached_wheels(patchset.load_spec(version))
    missing = [str(w) for w in wheels.values() if not w.is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run `mlafleet patchset build --vllm {version}` once first")
    return wheels


def build_patchset(version: str, out: Path) -> Path:
    from mlafleet.patchset import builder as patchset

    wheels = pinned_wheels(version)
    patchset.build(version, out, wheel=wheels.pop("vllm"), other_wheels=wheels)
    return out
