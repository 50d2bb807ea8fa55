"""The vllm_patch role and its module, run by ansible-playbook on this machine (connection local).

The install is a real virtual environment holding vLLM 0.20.2's own files for everything the
patch set touches (taken from the pinned wheel, with its METADATA), so the role's version probe,
hash checks, backups, atomic writes, byte-compilation and restore run for real. The proof in
vLLM's interpreter needs the whole of vLLM and runs in tests/test_patchset_vllm.py and in the
molecule scenario `patch`; here it is off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlafleet import patchset

VERSION = "0.20.2"
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def wheel() -> Path:
    spec = patchset.load_spec(VERSION)
    path = patchset.default_cache_dir() / spec.wheel_filename
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `mlafleet patchset build --vllm {VERSION}` once first")
    return path


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("built")
    patchset.build(VERSION, root / VERSION, wheel=wheel)
    return root


@pytest.fixture()
def install(tmp_path: Path, wheel: Path, build_dir: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    manifest = json.loads((build_dir / VERSION / "manifest.json").read_text())
    wanted = {t["path"] for t in manifest["targets"]} | {"vllm/__init__.py", "vllm/third_party/__init__.py"}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name in wanted or name == f"vllm-{VERSION}.dist-info/METADATA":
                archive.extract(name, site)
    return venv


def site_of(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def play(tmp_path: Path, venv: Path, build_dir: Path, state: str = "present", check: bool = False,
         extra: dict | None = None) -> tuple[int, str, dict[str, int]]:
    playbook = tmp_path / "play.yml"
    variables = {"vllm_patch_state": state, "vllm_patch_installs": [str(venv)],
                 "vllm_patch_build_dir": str(build_dir), "vllm_patch_prove": False, **(extra or {})}
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False,
                                     "roles": [{"role": "vllm_patch", "vars": variables}]}]))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
           "-e", f"ansible_python_interpreter={sys.executable}", str(playbook)]
    if check:
        cmd.append("--check")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    output = result.stdout + result.stderr
    recap = re.search(r"localhost\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output)
    assert recap, output[-3000:]
    counts = dict(zip(("ok", "changed", "unreachable", "failed"), map(int, recap.groups())))
    return result.returncode, output, counts


def test_patch_idempotence_and_unpatch(tmp_path: Path, install: Path, build_dir: Path, wheel: Path) -> None:
    site = site_of(install)
    before = snapshot(site)
    manifest = json.loads((build_dir / VERSION / "manifest.json").read_text())

    rc, out, counts = play(tmp_path, install, build_dir, check=True)  # check mode: reports, changes nothing
    assert rc == 0 and counts["changed"] == 1, out[-3000:]
    assert snapshot(site) == before

    rc, out, counts = play(tmp_path, install, build_dir)
    assert rc == 0 and counts["changed"] == 1, out[-3000:]
    for target in manifest["targets"]:
        assert hashlib.sha256((site / target["path"]).read_bytes()).hexdigest() == target["patched_sha256"]
        backup = install / "mlafleet-patch-backup" / VERSION / "originals" / target["path"]
        assert hashlib.sha256(backup.read_bytes()).hexdigest() == target["original_sha256"]
        pycache = list((site / target["path"]).parent.glob(f"__pycache__/{Path(target['path']).stem}.*.pyc"))
        assert pycache, f"{target['path']} was not byte-compiled"
    for added in manifest["added"]:
        assert hashlib.sha256((site / added["path"]).read_bytes()).hexdigest() == added["sha256"]
    saved = json.loads((install / "mlafleet-patch-backup" / VERSION / "manifest.json").read_text())
    assert saved == manifest

    rc, out, counts = play(tmp_path, install, build_dir)  # idempotence
    assert rc == 0 and counts["changed"] == 0, out[-3000:]

    rc, out, counts = play(tmp_path, install, build_dir, state="absent")
    assert rc == 0 and counts["changed"] == 1, out[-3000:]
    assert snapshot(site) == before  # originals byte for byte, added files gone
    with zipfile.ZipFile(wheel) as archive:
        for target in manifest["targets"]:
            assert (site / target["path"]).read_bytes() == archive.read(target["path"])
    assert not (site / "vllm/third_party/mlafleet_kernels").exists()
    assert not (install / "mlafleet-patch-backup").exists()

    rc, out, counts = play(tmp_path, install, build_dir, state="absent")  # unpatch is idempotent too
    assert rc == 0 and counts["changed"] == 0, out[-3000:]


def test_tampered_target_is_refused_and_nothing_changes(tmp_path: Path, install: Path, build_dir: Path) -> None:
    site = site_of(install)
    target = site / "vllm/platforms/cuda.py"
    target.write_bytes(target.read_bytes() + b"# local change\n")
    tampered = hashlib.sha256(target.read_bytes()).hexdigest()
    before = snapshot(site)
    rc, out, counts = play(tmp_path, install, build_dir)
    assert rc != 0 and counts["failed"] == 1
    assert "refusing to patch" in out and str(target) in out and tampered in out
    assert "nothing was changed on this host" in out
    assert snapshot(site) == before
    assert not (install / "mlafleet-patch-backup").exists()


def test_tampered_patched_file_blocks_unpatch(tmp_path: Path, install: Path, build_dir: Path) -> None:
    site = site_of(install)
    assert play(tmp_path, install, build_dir)[0] == 0
    registry = site / "vllm/v1/attention/backends/registry.py"
    registry.write_bytes(registry.read_bytes().replace(b"TRITON_MLA_SPARSE", b"TRITON_MLA_SPARSX", 1))
    before = snapshot(site)
    rc, out, counts = play(tmp_path, install, build_dir, state="absent")
    assert rc != 0 and "refusing to unpatch" in out and str(registry) in out
    assert snapshot(site) == before


def test_unsupported_version_names_the_supported_ones(tmp_path: Path, install: Path, build_dir: Path) -> None:
    site = site_of(install)
    metadata = site / f"vllm-{VERSION}.dist-info/METADATA"
    metadata.write_text(re.sub(r"(?m)^Version: .*$", "Version: 0.19.1", metadata.read_text()))
    before = snapshot(site)
    rc, out, _ = play(tmp_path, install, build_dir)
    assert rc != 0 and "vLLM 0.19.1 has no patch set (supported: 0.20.2)" in out
    assert snapshot(site) == before


@pytest.mark.parametrize("exists", [True, False])
def test_missing_build_fails_clearly(tmp_path: Path, install: Path, exists: bool) -> None:
    empty = tmp_path / "nothing-built"
    if exists:
        empty.mkdir()
    before = snapshot(site_of(install))
    rc, out, _ = play(tmp_path, install, empty)
    assert rc != 0 and f"No built patch set in {empty}" in out and "mlafleet patchset build --vllm" in out
    assert snapshot(site_of(install)) == before


def test_missing_install_fails_and_changes_nothing_anywhere(tmp_path: Path, install: Path, build_dir: Path) -> None:
    site = site_of(install)
    before = snapshot(site)
    rc, out, _ = play(tmp_path, install, build_dir, extra={"vllm_patch_extra_installs": [str(tmp_path / "nope")]})
    assert rc != 0 and f"{tmp_path / 'nope'}: no such directory" in out
    assert snapshot(site) == before
