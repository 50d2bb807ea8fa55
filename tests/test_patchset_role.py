"""The vllm_patch role and its module, run by ansible-playbook on this machine (connection local).

The install is a real virtual environment holding vLLM's own files for everything the patch
set touches (taken from the pinned wheels, with their METADATA: vLLM 0.20.2, or vLLM 0.32.0
with vllm-gguf-plugin 0.0.5), so the role's version probes, hash checks, backups, atomic
writes, byte-compilation and restore run for real, for both distributions of the 0.32.0 set. The proof in
vLLM's interpreter needs the whole of vLLM and runs in tests/test_patchset_vllm.py and in the
molecule scenario `roles` (its patch part); here it is off.
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

from patchset_support import build_patchset, pinned_wheels

VERSION = "0.20.2"
VERSION_032 = "0.32.0"
PLUGIN = "vllm-gguf-plugin"
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def wheel() -> Path:
    return pinned_wheels(VERSION)["vllm"]


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both patch sets built, as `make patchset` leaves build/patchset/."""
    root = tmp_path_factory.mktemp("built")
    for version in (VERSION, VERSION_032):
        build_patchset(version, root / version)
    return root


def make_install(venv: Path, version: str, build_dir: Path, with_plugin: bool = True) -> Path:
    """A venv holding the pinned wheels' own copies of every file the patch set reads, and the
    distributions' METADATA (what the version probes read)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    manifest = json.loads((build_dir / version / "manifest.json").read_text())
    wanted = {t["path"] for t in manifest["targets"]} | {"vllm/__init__.py", "vllm/third_party/__init__.py"}
    for distribution, path in pinned_wheels(version).items():
        if distribution != "vllm" and not with_plugin:
            continue
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name in wanted or name.endswith(".dist-info/METADATA"):
                    archive.extract(name, site)
    return venv


@pytest.fixture()
def install(tmp_path: Path, build_dir: Path) -> Path:
    return make_install(tmp_path / "venv", VERSION, build_dir)


@pytest.fixture()
def install_032(tmp_path: Path, build_dir: Path) -> Path:
    return make_install(tmp_path / "venv032", VERSION_032, build_dir)


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
           # the role calls the collection's module by name (mlafleet.fleet.mlafleet_vllm_patch)
           "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
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
    assert rc != 0 and "vLLM 0.19.1 has no patch set (supported: 0.20.2, 0.32.0)" in out
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


# --- the 0.32.0 set: two distributions in one install -----------------------------------------


def test_032_patches_and_restores_both_distributions(tmp_path: Path, install_032: Path, build_dir: Path) -> None:
    site = site_of(install_032)
    before = snapshot(site)
    manifest = json.loads((build_dir / VERSION_032 / "manifest.json").read_text())
    plugin_files = [t["path"] for t in manifest["targets"] + manifest["added"] if t.get("distribution") == PLUGIN]
    assert "vllm_gguf_plugin/weights_adapter/__init__.py" in plugin_files
    assert "vllm_gguf_plugin/weights_adapter/glm_dsa.py" in plugin_files

    rc, out, counts = play(tmp_path, install_032, build_dir)
    assert rc == 0 and counts["changed"] == 1, out[-3000:]
    backup = install_032 / "mlafleet-patch-backup" / VERSION_032
    for target in manifest["targets"]:
        assert hashlib.sha256((site / target["path"]).read_bytes()).hexdigest() == target["patched_sha256"]
        saved = backup / "originals" / target["path"]
        assert hashlib.sha256(saved.read_bytes()).hexdigest() == target["original_sha256"], target["path"]
    for added in manifest["added"]:
        assert hashlib.sha256((site / added["path"]).read_bytes()).hexdigest() == added["sha256"]
    assert json.loads((backup / "manifest.json").read_text()) == manifest

    rc, out, counts = play(tmp_path, install_032, build_dir)  # idempotence
    assert rc == 0 and counts["changed"] == 0, out[-3000:]
    rc, out, counts = play(tmp_path, install_032, build_dir, state="absent")
    assert rc == 0 and counts["changed"] == 1, out[-3000:]
    assert snapshot(site) == before  # both distributions' originals back, our files gone
    assert not (site / "vllm_gguf_plugin/gguf_glm_dsa.py").exists()


def test_032_tampered_plugin_file_is_refused_naming_the_distribution(tmp_path: Path, install_032: Path,
                                                                    build_dir: Path) -> None:
    site = site_of(install_032)
    target = site / "vllm_gguf_plugin/weights_adapter/__init__.py"
    target.write_bytes(target.read_bytes() + b"# local change\n")
    before = snapshot(site)
    rc, out, _ = play(tmp_path, install_032, build_dir)
    assert rc != 0 and "refusing to patch" in out and str(target) in out
    assert "expected vllm-gguf-plugin 0.0.5's original" in out
    assert snapshot(site) == before and not (install_032 / "mlafleet-patch-backup").exists()


@pytest.mark.parametrize("plugin", ["other version", "absent"])
def test_032_needs_the_plugin_version_it_was_built_from(tmp_path: Path, build_dir: Path, plugin: str) -> None:
    venv = make_install(tmp_path / "venv", VERSION_032, build_dir, with_plugin=plugin != "absent")
    site = site_of(venv)
    if plugin == "other version":
        metadata = next(site.glob("vllm_gguf_plugin-*.dist-info")) / "METADATA"
        metadata.write_text(re.sub(r"(?m)^Version: .*$", "Version: 0.0.4", metadata.read_text()))
        message = f"{venv}: vllm-gguf-plugin 0.0.4 is installed; the patch set for vLLM 0.32.0 is built from vllm-gguf-plugin 0.0.5"
    else:
        message = f"{venv}: the patch set for vLLM 0.32.0 patches vllm-gguf-plugin 0.0.5, which is not installed there"
    before = snapshot(site)
    rc, out, _ = play(tmp_path, venv, build_dir)
    assert rc != 0 and message in out and "nothing was changed on this host" in out
    assert snapshot(site) == before


def test_one_host_with_both_lines(tmp_path: Path, install: Path, install_032: Path, build_dir: Path) -> None:
    """Two installs of different lines on one host: each gets its own version's set."""
    rc, out, counts = play(tmp_path, install, build_dir, extra={"vllm_patch_extra_installs": [str(install_032)]})
    assert rc == 0 and counts["changed"] == 1, out[-3000:]
    assert (install / "mlafleet-patch-backup" / VERSION / "manifest.json").is_file()
    assert (install_032 / "mlafleet-patch-backup" / VERSION_032 / "manifest.json").is_file()
    assert (site_of(install_032) / "vllm_gguf_plugin/weights_adapter/glm_dsa.py").is_file()


def test_a_rerun_that_changes_nothing_proves_only_what_no_stamp_covers(tmp_path: Path, install: Path,
                                                                       build_dir: Path) -> None:
    """The proof imports vLLM in the install (seconds): a re-run that changes nothing skips it where a
    passed proof of this very manifest is stamped, and runs it where the stamp is missing or stale.
    This install holds only the files the patch set reads, so the proof, when it runs, fails: a
    passing re-run shows it was skipped."""
    rc, out, _ = play(tmp_path, install, build_dir)
    assert rc == 0, out[-3000:]
    kept = install / "mlafleet-patch-backup" / VERSION
    stamp = kept / "proven"
    stamp.write_text(hashlib.sha256((kept / "manifest.json").read_bytes()).hexdigest() + "\n")
    rc, out, counts = play(tmp_path, install, build_dir, extra={"vllm_patch_prove": True})
    assert rc == 0 and counts["changed"] == 0, out[-3000:]
    assert "patch set unchanged and proven before in " + str(install) in out
    stamp.write_text("0" * 64 + "\n")  # a proof of another manifest
    rc, out, _ = play(tmp_path, install, build_dir, extra={"vllm_patch_prove": True})
    assert rc != 0 and "the patch set is not in effect" in out, out[-3000:]
    stamp.unlink()
    rc, out, _ = play(tmp_path, install, build_dir, extra={"vllm_patch_prove": True})
    assert rc != 0 and "the patch set is not in effect" in out, out[-3000:]
