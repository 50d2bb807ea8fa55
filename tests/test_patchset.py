"""The patch-set engine: format, anchors, determinism and the manifest (mlafleet/patchset.py)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from mlafleet import patchset
from mlafleet.patchset import Edit, PatchsetError

VERSION = "0.20.2"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="session")
def real_wheel() -> Path:
    """The pinned vLLM 0.20.2 wheel from the download cache (tests never download it)."""
    spec = patchset.load_spec(VERSION)
    wheel = patchset.default_cache_dir() / spec.wheel_filename
    if not wheel.is_file():
        pytest.fail(f"{wheel} is missing: run `mlafleet patchset build --vllm {VERSION}` once "
                    "(it downloads the pinned wheel into the cache) before the tests")
    return wheel


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory: pytest.TempPathFactory, real_wheel: Path) -> Path:
    out = tmp_path_factory.mktemp("build") / VERSION
    patchset.build(VERSION, out, wheel=real_wheel)
    return out


# --- a small synthetic patch set, to prove the engine's rules on their own -------------------

ORIGINAL = "import os\n\n\ndef alpha():\n    return 1\n\n\ndef beta():\n    return 2\n"


def make_patchset(tmp_path: Path, edit_files: dict[str, dict], add: dict[str, str] | None = None,
                  ship: list[dict] | None = None) -> tuple[Path, Path]:
    """A patch-set directory for version 9.9.9 over a tiny wheel holding pkg/mod.py."""
    wheel = tmp_path / "pkg-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/mod.py", ORIGINAL)
        archive.writestr("pkg/other.py", "X = 1\n")
    root = tmp_path / "files"
    directory = root / "9.9.9"
    (directory / "edits").mkdir(parents=True)
    (directory / "patchset.yml").write_text(yaml.safe_dump({
        "vllm_version": "9.9.9",
        "wheel": {"filename": wheel.name, "sha256": sha(wheel.read_bytes())},
        "ship": ship or [],
    }))
    for name, content in edit_files.items():
        (directory / "edits" / name).write_text(yaml.safe_dump(content))
    for path, text in (add or {}).items():
        dest = directory / "add" / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return root, wheel


def one_edit(anchor: str, action: str = "insert_after", text: str = "# ours\n",
             target: str = "pkg/mod.py") -> dict:
    return {"target": target, "edits": [{"why": "test", "anchor": anchor, "action": action, "text": text}]}


def edit(anchor: str, action: str, text: str) -> Edit:
    return Edit(source="t.yml", index=1, why="test", anchor=anchor, action=action, text=text)


def test_insert_after_goes_after_the_line_the_match_ends_on() -> None:
    out = patchset.apply_edit(ORIGINAL, edit(r"^def alpha\(", "insert_after", "    # after\n"), "m.py")
    assert out == ORIGINAL.replace("def alpha():\n", "def alpha():\n    # after\n")


def test_insert_after_a_match_ending_in_newline_goes_right_after_it() -> None:
    out = patchset.apply_edit(ORIGINAL, edit(r"^def alpha\(\):\n", "insert_after", "X\n"), "m.py")
    assert out == ORIGINAL.replace("def alpha():\n", "def alpha():\nX\n")


def test_insert_after_adds_a_missing_final_newline() -> None:
    out = patchset.apply_edit("a\nb", edit("^b", "insert_after", "c"), "m.py")
    assert out == "a\nb\nc\n"


def test_insert_before_goes_before_the_line_the_match_starts_on() -> None:
    out = patchset.apply_edit(ORIGINAL, edit(r"alpha\(\)", "insert_before", "@deco\n"), "m.py")
    assert out == ORIGINAL.replace("def alpha():\n", "@deco\ndef alpha():\n")


def test_replace_replaces_exactly_the_span() -> None:
    out = patchset.apply_edit(ORIGINAL, edit(r"return 2", "replace", "return 3"), "m.py")
    assert out == ORIGINAL.replace("return 2", "return 3")


@pytest.mark.parametrize("anchor,count", [(r"^def gamma\(", 0), (r"^def ", 2)])
def test_anchor_must_match_exactly_once(anchor: str, count: int) -> None:
    with pytest.raises(PatchsetError) as err:
        patchset.apply_edit(ORIGINAL, edit(anchor, "insert_after", "x\n"), "pkg/mod.py")
    message = str(err.value)
    assert f"matches {count} times" in message
    assert "t.yml" in message and anchor in message and "pkg/mod.py" in message


@pytest.mark.parametrize("anchor,count", [(r"^def gamma\(", 0), (r"^def ", 2)])
def test_build_fails_on_bad_anchor_and_leaves_output_alone(tmp_path: Path, anchor: str, count: int) -> None:
    root, wheel = make_patchset(tmp_path, {"a.yml": one_edit(anchor)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("previous build")
    with pytest.raises(PatchsetError, match=f"a.yml edit 1: anchor .* matches {count} times in pkg/mod.py"):
        patchset.build("9.9.9", out, wheel=wheel, patchsets_dir=root, repo_root=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["keep"]
    assert (out / "keep").read_text() == "previous build"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_edit_files_apply_in_sorted_order_on_the_current_text(tmp_path: Path) -> None:
    # b.yml's anchor only exists once a.yml has run: proof of order and of matching current text.
    root, wheel = make_patchset(tmp_path, {
        "b.yml": one_edit(r"^# from a$", text="# from b\n"),
        "a.yml": one_edit(r"^def beta\(", text="# from a\n"),
    })
    outputs, manifest = patchset.compute("9.9.9", wheel, root, tmp_path)
    assert outputs["pkg/mod.py"].decode().endswith("def beta():\n# from a\n# from b\n    return 2\n")
    assert manifest["targets"][0]["edits"] == ["a.yml", "b.yml"]


def test_synthetic_manifest_and_files(tmp_path: Path) -> None:
    kernel = tmp_path / "mlafleet" / "kernels" / "k.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("def k():\n    return 0\n")
    root, wheel = make_patchset(
        tmp_path, {"a.yml": one_edit(r"^def beta\(")}, add={"pkg/new.py": "NEW = 1\n"},
        ship=[{"src": "mlafleet/kernels/k.py", "dest": "vllm/third_party/mlafleet_kernels/k.py"}])
    out = tmp_path / "out"
    manifest_path = patchset.build("9.9.9", out, wheel=wheel, patchsets_dir=root, repo_root=tmp_path)
    manifest = json.loads(manifest_path.read_text())
    patched = (out / "files/pkg/mod.py").read_bytes()
    assert manifest["targets"] == [{"path": "pkg/mod.py", "original_sha256": sha(ORIGINAL.encode()),
                                    "patched_sha256": sha(patched), "edits": ["a.yml"]}]
    added = {entry["path"]: entry["sha256"] for entry in manifest["added"]}
    assert set(added) == {"pkg/new.py", "vllm/third_party/mlafleet_kernels/__init__.py",
                          "vllm/third_party/mlafleet_kernels/k.py"}
    for path, digest in added.items():
        assert sha((out / "files" / path).read_bytes()) == digest
    assert (out / "files/vllm/third_party/mlafleet_kernels/k.py").read_bytes() == kernel.read_bytes()
    assert not (out / "files/pkg/other.py").exists()  # untouched files are not part of the set


@pytest.mark.parametrize("content,message", [
    (one_edit("^x", action="append"), "action 'append' is not one of"),
    ({"target": "pkg/mod.py", "edits": [{"anchor": "^x", "action": "replace", "text": ""}]}, "exactly the keys"),
    (one_edit("^def beta(", action="replace"), "not a valid regex"),
    (one_edit("^def beta", target="/abs/mod.py"), "must be a relative path"),
    (one_edit("^def beta", target="pkg/../mod.py"), "must be a relative path"),
    (one_edit("^def beta", target="pkg/missing.py"), "pkg/missing.py is not in"),
    ({"target": "pkg/mod.py", "edits": []}, "non-empty list"),
    (one_edit("^def beta", action="replace", text="def beta"), "leave it unchanged"),
])
def test_bad_edit_files_fail_clearly(tmp_path: Path, content: dict, message: str) -> None:
    root, wheel = make_patchset(tmp_path, {"bad.yml": content})
    with pytest.raises(PatchsetError, match=message) as err:
        patchset.compute("9.9.9", wheel, root, tmp_path)
    assert "bad.yml" in str(err.value) or "pkg/" in str(err.value)


def test_added_file_must_not_overwrite_a_vllm_file(tmp_path: Path) -> None:
    root, wheel = make_patchset(tmp_path, {}, add={"pkg/other.py": "X = 2\n"})
    with pytest.raises(PatchsetError, match="pkg/other.py already exists"):
        patchset.compute("9.9.9", wheel, root, tmp_path)


def test_wrong_wheel_is_refused(tmp_path: Path) -> None:
    root, _ = make_patchset(tmp_path, {"a.yml": one_edit(r"^def beta\(")})
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("pkg/mod.py", ORIGINAL + "# changed\n")
    with pytest.raises(PatchsetError, match="is not the pinned wheel"):
        patchset.compute("9.9.9", other, root, tmp_path)


def test_unknown_version_names_the_supported_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert patchset.main(["build", "--vllm", "0.0.1", "--out", "/nonexistent/x"]) == 1
    err = capsys.readouterr().err
    assert "no patch set for vLLM 0.0.1" in err and VERSION in err


# --- the real 0.20.2 patch set --------------------------------------------------------------


def test_build_is_deterministic(tmp_path: Path, real_wheel: Path, fresh_build: Path) -> None:
    again = tmp_path / "again"
    patchset.build(VERSION, again, wheel=real_wheel)

    def tree(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    first, second = tree(fresh_build), tree(again)
    assert first == second
    assert "manifest.json" in first and len(first) > 2


def test_committed_manifest_equals_a_fresh_build(repo_root: Path, fresh_build: Path) -> None:
    committed = repo_root / "files/vllm" / VERSION / "manifest.json"
    assert committed.read_text() == (fresh_build / "manifest.json").read_text(), (
        "files/vllm/0.20.2/manifest.json is stale: run "
        "`mlafleet patchset build --vllm 0.20.2 --update-manifest` and commit it")


def test_manifest_matches_the_wheel_and_the_built_files(real_wheel: Path, fresh_build: Path) -> None:
    manifest = json.loads((fresh_build / "manifest.json").read_text())
    assert manifest["vllm_version"] == VERSION
    assert manifest["wheel"]["sha256"] == hashlib.sha256(real_wheel.read_bytes()).hexdigest()
    targets = {t["path"]: t for t in manifest["targets"]}
    assert {"vllm/platforms/cuda.py", "vllm/v1/attention/backends/registry.py"} <= set(targets)
    listed = {p.relative_to(fresh_build / "files").as_posix()
              for p in (fresh_build / "files").rglob("*") if p.is_file()}
    assert listed == set(targets) | {a["path"] for a in manifest["added"]}
    with zipfile.ZipFile(real_wheel) as archive:
        for path, entry in targets.items():
            original = archive.read(path)
            patched = (fresh_build / "files" / path).read_bytes()
            assert sha(original) == entry["original_sha256"]
            assert sha(patched) == entry["patched_sha256"] != entry["original_sha256"]
            compile(patched, path, "exec")  # still Python
    for entry in manifest["added"]:
        data = (fresh_build / "files" / entry["path"]).read_bytes()
        assert sha(data) == entry["sha256"]
        if entry["path"].endswith(".py"):
            compile(data, entry["path"], "exec")


def test_real_patch_contents(fresh_build: Path) -> None:
    files = fresh_build / "files/vllm"
    registry = (files / "v1/attention/backends/registry.py").read_text()
    assert ('    TRITON_MLA_SPARSE = (\n'
            '        "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend"\n    )\n') in registry
    cuda = (files / "platforms/cuda.py").read_text()
    # exactly once: in the non-SM100 MLA list, right after FLASHMLA_SPARSE
    assert cuda.count("AttentionBackendEnum.TRITON_MLA_SPARSE,") == 1
    tail = cuda.split("AttentionBackendEnum.FLASHMLA_SPARSE,\n")[-1]
    assert "AttentionBackendEnum.TRITON_MLA_SPARSE,\n            ]" in tail


def test_shipped_kernel_modules_import_only_torch_and_triton(repo_root: Path) -> None:
    """A module copied into vllm/third_party/mlafleet_kernels/ cannot import mlafleet there."""
    import ast
    import sys

    spec = patchset.load_spec(VERSION)
    assert spec.ship, "the 0.20.2 patch set ships the sparse MLA kernels"
    for src, _ in spec.ship:
        tree = ast.parse((repo_root / src).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{src}: relative import (line {node.lineno})"
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in ("torch", "triton") or root in sys.stdlib_module_names, (
                    f"{src} imports {root} (line {node.lineno}): shipped kernels import only "
                    "torch, triton and the standard library")
