"""The stand-in CUDA apt repository (mlafleet.lab.standin_repo) and the gpu-stack roles' specs."""

from __future__ import annotations

import gzip
import hashlib
import subprocess
from pathlib import Path

import pytest
import yaml

from mlafleet.lab import standin_repo

KERNEL = "6.1.0-99-standin"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return standin_repo.build_repository(tmp_path_factory.mktemp("repo") / "out", KERNEL)


def _paragraphs(index: str) -> list[dict[str, str]]:
    result = []
    for block in index.strip().split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if not line.startswith(" "):
                key, _, value = line.partition(": ")
                fields[key] = value
        result.append(fields)
    return result


def test_layout_is_nvidias_flat_repository(repo: Path) -> None:
    assert repo.parts[-2:] == ("debian12", "x86_64")
    for name in ("Packages", "Packages.gz", "Release", "InRelease", "Release.gpg", standin_repo.KEY_NAME):
        assert (repo / name).is_file(), name


def test_packages_carry_real_names_versions_and_standin_descriptions(repo: Path) -> None:
    index = (repo / "Packages").read_text()
    assert gzip.decompress((repo / "Packages.gz").read_bytes()).decode() == index
    paragraphs = _paragraphs(index)
    versions = {(p["Package"], p["Version"]) for p in paragraphs}
    for driver in standin_repo.DRIVER_VERSIONS:
        for name in ("nvidia-open", "cuda-drivers", "nvidia-kernel-open-dkms", "nvidia-kernel-dkms",
                     "nvidia-driver-cuda", "nvidia-persistenced"):
            assert (name, f"{driver}-1") in versions
    assert ("cuda-toolkit-13-0", "13.0.2-1") in versions
    assert (f"linux-headers-{KERNEL}", "1+standin1") in versions
    for paragraph in paragraphs:
        assert paragraph["Description"].startswith("STAND-IN"), paragraph["Package"]
        deb = repo / paragraph["Filename"]
        data = deb.read_bytes()
        assert paragraph["SHA256"] == hashlib.sha256(data).hexdigest()
        assert int(paragraph["Size"]) == len(data)
        control = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Description"],
                                 check=True, capture_output=True, text=True).stdout
        assert f"Package: {paragraph['Package']}\nVersion: {paragraph['Version']}\n" in control
        assert "STAND-IN" in control


def test_open_and_proprietary_modules_conflict_and_differ_in_license(repo: Path, tmp_path: Path) -> None:
    paragraphs = {(p["Package"], p["Version"]): p for p in _paragraphs((repo / "Packages").read_text())}
    opened = paragraphs[("nvidia-kernel-open-dkms", "580.95.05-1")]
    closed = paragraphs[("nvidia-kernel-dkms", "580.95.05-1")]
    assert "nvidia-kernel-dkms" in opened["Conflicts"] and "nvidia-kernel-open-dkms" in closed["Conflicts"]
    assert paragraphs[("nvidia-open", "580.95.05-1")]["Depends"].startswith("nvidia-kernel-open-dkms (= 580.95.05-1)")
    for paragraph, license_ in ((opened, "Dual MIT/GPL"), (closed, "NVIDIA")):
        root = tmp_path / paragraph["Package"]
        subprocess.run(["dpkg-deb", "-x", str(repo / paragraph["Filename"]), str(root)], check=True)
        info = (root / "usr/src/nvidia-580.95.05/dkms-standin.modinfo").read_text().splitlines()
        assert f"license={license_}" in info and "version=580.95.05" in info


def test_release_hashes_and_signature_verify(repo: Path, tmp_path: Path) -> None:
    release = (repo / "Release").read_text()
    for name in ("Packages", "Packages.gz"):
        digest = hashlib.sha256((repo / name).read_bytes()).hexdigest()
        assert f" {digest} " in release
    keyring = tmp_path / "standin.gpg"
    subprocess.run(["gpg", "--batch", "--yes", "--dearmor", "-o", str(keyring), str(repo / standin_repo.KEY_NAME)],
                   check=True, capture_output=True)
    good = subprocess.run(["gpgv", "--keyring", str(keyring), str(repo / "InRelease")], capture_output=True)
    assert good.returncode == 0, good.stderr
    tampered = tmp_path / "InRelease"
    tampered.write_text((repo / "InRelease").read_text().replace("Packages.gz", "Packages.xz"))
    bad = subprocess.run(["gpgv", "--keyring", str(keyring), str(tampered)], capture_output=True)
    assert bad.returncode != 0


def test_bad_inputs_are_refused_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="kernel release"):
        standin_repo.build_repository(tmp_path / "a", "6.1 0")
    with pytest.raises(ValueError, match="debian12"):
        standin_repo.build_repository(tmp_path / "b", KERNEL, distro="ubuntu2404")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "stale").write_text("x")
    assert standin_repo.main(["--out", str(tmp_path / "c"), "--kernel-release", KERNEL]) == 2
    assert "not empty" in capsys.readouterr().err
    assert not (tmp_path / "c" / "debian12").exists()


@pytest.mark.parametrize("role", ["nvidia_driver", "cuda_toolkit"])
def test_argument_specs_document_every_default(repo_root: Path, role: str) -> None:
    defaults = yaml.safe_load((repo_root / "roles" / role / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((repo_root / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    for name, value in defaults.items():
        if "{{" not in str(value):
            assert options[name].get("default") == value, name
