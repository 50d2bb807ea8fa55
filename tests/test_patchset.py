"""The patch-set engine: format, anchors, determinism and the manifest (mlafleet/patchset/builder.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import yaml

from mlafleet.patchset import builder as patchset
from mlafleet.patchset.builder import Edit, PatchsetError

from patchset_support import build_patchset, pinned_wheels

VERSION = "0.20.2"
VERSIONS = ("0.20.2", "0.32.0")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="session")
def real_wheel() -> Path:
    """The pinned vLLM 0.20.2 wheel from the download cache (tests never download it)."""
    return pinned_wheels(VERSION)["vllm"]


@pytest.fixture(scope="session", params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def fresh_build(patchset_builds, version: str) -> Path:
    return patchset_builds(version)


# --- a small synthetic patch set, to prove the engine's rules on their own -------------------

ORIGINAL = "import os\n\n\ndef alpha():\n    return 1\n\n\ndef beta():\n    return 2\n"


def make_patchset(tmp_path: Path, edit_files: dict[str, dict], add: dict[str, str] | None = None,
                  ship: list[dict] | None = None) -> tuple[Path, Path]:
    """A patch-set directory for version 9.9.9 over a tiny vllm wheel holding pkg/mod.py."""
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/mod.py", ORIGINAL)
        archive.writestr("pkg/other.py", "X = 1\n")
        archive.writestr("vllm/__init__.py", "")
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
    (one_edit("^def beta", target="pkg/missing.py"), "pkg/missing.py, which is in none of the pinned wheels"),
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
    with pytest.raises(PatchsetError, match="vLLM 9.9.9 ships its own pkg/other.py, which this patch set adds: "
                                            "refusing to overwrite upstream's file"):
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


# --- the real patch sets (0.20.2; 0.32.0 with vllm-gguf-plugin 0.0.5) -----------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_is_deterministic(tmp_path: Path, version: str, fresh_build: Path) -> None:
    again = build_patchset(version, tmp_path / "again")
    first, second = _tree(fresh_build), _tree(again)
    assert first == second
    assert "manifest.json" in first and len(first) > 2


def test_committed_manifest_equals_a_fresh_build(repo_root: Path, version: str, fresh_build: Path) -> None:
    committed = repo_root / "files/vllm" / version / "manifest.json"
    assert committed.read_text() == (fresh_build / "manifest.json").read_text(), (
        f"files/vllm/{version}/manifest.json is stale: run "
        f"`mlafleet patchset build --vllm {version} --update-manifest` and commit it")


def test_manifest_matches_the_wheels_and_the_built_files(version: str, fresh_build: Path) -> None:
    wheels = pinned_wheels(version)
    manifest = json.loads((fresh_build / "manifest.json").read_text())
    assert manifest["vllm_version"] == version
    assert manifest["wheel"]["sha256"] == sha(wheels["vllm"].read_bytes())
    others = {d["distribution"]: d for d in manifest.get("other_distributions", [])}
    assert set(others) == set(wheels) - {"vllm"}
    for name, entry in others.items():
        assert entry["wheel"] == {"filename": wheels[name].name, "sha256": sha(wheels[name].read_bytes())}
    targets = {t["path"]: t for t in manifest["targets"]}
    assert {"vllm/platforms/cuda.py", "vllm/v1/attention/backends/registry.py"} <= set(targets)
    listed = {p.relative_to(fresh_build / "files").as_posix()
              for p in (fresh_build / "files").rglob("*") if p.is_file()}
    assert listed == set(targets) | {a["path"] for a in manifest["added"]}
    archives = {name: zipfile.ZipFile(path) for name, path in wheels.items()}
    for path, entry in targets.items():
        owner = entry.get("distribution", "vllm")
        original = archives[owner].read(path)  # from the wheel of the distribution it names
        patched = (fresh_build / "files" / path).read_bytes()
        assert sha(original) == entry["original_sha256"]
        assert sha(patched) == entry["patched_sha256"] != entry["original_sha256"]
        compile(patched, path, "exec")  # still Python
    for entry in manifest["added"]:
        data = (fresh_build / "files" / entry["path"]).read_bytes()
        assert sha(data) == entry["sha256"]
        owner = entry.get("distribution", "vllm")
        assert entry["path"].split("/")[0] in {n.split("/")[0] for n in archives[owner].namelist()}
        assert all(entry["path"] not in a.namelist() for a in archives.values())
        if entry["path"].endswith(".py"):
            compile(data, entry["path"], "exec")


def test_every_edit_says_why(version: str) -> None:
    spec = patchset.load_spec(version)
    edits = [e for f in patchset.load_edit_files(spec) for e in f.edits]
    assert edits and all(len(e.why) > 20 for e in edits)


def test_real_patch_contents(fresh_build: Path) -> None:
    files = fresh_build / "files/vllm"
    registry = (files / "v1/attention/backends/registry.py").read_text()
    assert registry.count("TRITON_MLA_SPARSE") == 1
    assert ('    TRITON_MLA_SPARSE = (\n'
            '        "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend"\n    )\n') in registry
    if fresh_build.name == "0.20.2":
        cuda = (files / "platforms/cuda.py").read_text()
        # exactly once: in the non-SM100 MLA list, right after FLASHMLA_SPARSE
        assert cuda.count("AttentionBackendEnum.TRITON_MLA_SPARSE,") == 1
        tail = cuda.split("AttentionBackendEnum.FLASHMLA_SPARSE,\n")[-1]
        assert "AttentionBackendEnum.TRITON_MLA_SPARSE,\n            ]" in tail
        return
    cuda = (files / "platforms/cuda.py").read_text()
    # the priorities go through mlafleet_selection once, in get_valid_backends, after upstream's list
    assert cuda.count("sparse_mla_priorities(") == 1
    valid = cuda[cuda.index("def get_valid_backends("):cuda.index("def get_attn_backend_cls(")]
    assert valid.index("_get_backend_priorities(") < valid.index("sparse_mla_priorities(") < valid.index(
        "for priority, backend in enumerate(backend_priorities)")
    mla = (files / "model_executor/layers/attention/mla_attention.py").read_text()
    assert 'if backend_name == "TRITON_MLA_SPARSE" and kv_cache_dtype in ("fp8", "fp8_e4m3"):' in mla
    adapters = (fresh_build / "files/vllm_gguf_plugin/weights_adapter/__init__.py").read_text()
    assert "    Gemma3GGUFAdapter,\n    GlmDsaGGUFAdapter,  # mlafleet\n]" in adapters
    indexer = (files / "model_executor/layers/sparse_attn_indexer.py").read_text()
    assert "mlafleet_indexer.top_k_per_row_prefill(" in indexer and "mlafleet_indexer.decode_topk(" in indexer


def test_shipped_modules_do_not_import_mlafleet(repo_root: Path, version: str) -> None:
    """A module copied into an install cannot import mlafleet there. Our kernels' package imports,
    at module level, only torch, triton, the standard library and its own modules (shipped into the
    same package), so that it imports without vLLM (the controller's tests); vLLM only inside
    functions, where the parts both lines' backend and indexer share call it in the install."""
    import ast
    import sys

    spec = patchset.load_spec(version)
    assert {dest.split("/")[-1] for _, dest in spec.ship} >= {
        "sparse_mla.py", "indexer.py", "sparse_mla_backend.py", "indexer_dispatch.py", "gguf_glm_dsa.py"}
    for src, dest in spec.ship:
        kernel = dest.startswith(patchset.KERNELS_PACKAGE + "/")
        tree = ast.parse((repo_root / src).read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                # only a sibling shipped into the same package (the kernels: sparse_mla_gluon.py)
                names = [node.module] if node.module else [alias.name for alias in node.names]
                for name in names:
                    sibling = f"{dest.rsplit('/', 1)[0]}/{name}.py"
                    assert node.level == 1 and sibling in {d for _, d in spec.ship}, (
                        f"{src}: relative import of {name} (line {node.lineno}), not shipped beside it")
                continue
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for root in roots:
                assert root != "mlafleet", f"{src} imports mlafleet (line {node.lineno})"
                if kernel:
                    allowed = ("torch", "triton") if id(node) in top_level else ("torch", "triton", "vllm")
                    assert root in allowed or root in sys.stdlib_module_names, (
                        f"{src} imports {root} (line {node.lineno}): the shipped kernels' package imports only "
                        "torch, triton and the standard library (vLLM only inside functions)")


def test_the_lines_added_modules_do_not_repeat_each_other(repo_root: Path) -> None:
    """What both lines' backend and indexer share is written once (mlafleet/kernels/sparse_mla_backend.py,
    indexer_dispatch.py): the two lines' added files share no run of 6 code lines (docstrings,
    comments, blank lines, imports and the functions' decorators and signatures, which each line's
    vLLM dictates, left out)."""
    import difflib

    def code_lines(path: Path) -> list[str]:
        import ast

        tree = ast.parse(path.read_text())
        skip = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                skip.update(range(node.lineno, node.end_lineno + 1))
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                skip.update(range(node.lineno, node.end_lineno + 1))  # docstrings
            elif isinstance(node, ast.FunctionDef):  # its decorators and signature
                skip.update(range(min([node.lineno, *(d.lineno for d in node.decorator_list)]), node.body[0].lineno))
        lines = path.read_text().splitlines()
        return [" ".join(line.split()) for n, line in enumerate(lines, start=1)
                if n not in skip and line.strip() and not line.strip().startswith("#")]

    for added in ("vllm/v1/attention/backends/mla/triton_mla_sparse.py", "vllm/v1/attention/ops/mlafleet_indexer.py"):
        old, new = (code_lines(repo_root / "files/vllm" / v / "add" / added) for v in ("0.20.2", "0.32.0"))
        match = difflib.SequenceMatcher(None, old, new, autojunk=False).find_longest_match(0, len(old), 0, len(new))
        assert match.size < 6, (added, old[match.a:match.a + match.size])


# --- several distributions in one patch set, and what upstream already ships ------------------


def add_plugin_wheel(tmp_path: Path, root: Path, files: dict[str, str], name: str = "plug-in") -> Path:
    """Pin a second distribution `name` 1.0 (a wheel holding `files`) in the synthetic patch set."""
    wheel = tmp_path / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    spec_file = root / "9.9.9" / "patchset.yml"
    spec = yaml.safe_load(spec_file.read_text())
    spec["other_wheels"] = [{"distribution": name, "version": "1.0", "filename": wheel.name,
                             "sha256": sha(wheel.read_bytes())}]
    spec_file.write_text(yaml.safe_dump(spec))
    return wheel


def test_a_target_of_another_distribution_is_tagged_with_it(tmp_path: Path) -> None:
    root, wheel = make_patchset(tmp_path, {"a.yml": one_edit(r"^def beta\("),
                                           "b.yml": one_edit(r"^Y = 1$", target="plug/x.py")},
                                add={"plug/new.py": "Z = 1\n", "pkg/new.py": "W = 1\n"})
    plugin = add_plugin_wheel(tmp_path, root, {"plug/x.py": "Y = 1\n"})
    outputs, manifest = patchset.compute("9.9.9", wheel, root, tmp_path, {"plug-in": plugin})
    targets = {t["path"]: t for t in manifest["targets"]}
    assert "distribution" not in targets["pkg/mod.py"]  # vLLM's: untagged, as in 0.20.2's manifest
    assert targets["plug/x.py"]["distribution"] == "plug-in"
    assert targets["plug/x.py"]["original_sha256"] == sha(b"Y = 1\n")
    added = {a["path"]: a for a in manifest["added"]}
    assert added["plug/new.py"]["distribution"] == "plug-in" and "distribution" not in added["pkg/new.py"]
    assert manifest["other_distributions"] == [{"distribution": "plug-in", "version": "1.0", "wheel": {
        "filename": plugin.name, "sha256": sha(plugin.read_bytes())}}]
    assert outputs["plug/x.py"] == b"Y = 1\n# ours\n"


def test_a_vllm_only_manifest_has_no_other_distributions(tmp_path: Path) -> None:
    root, wheel = make_patchset(tmp_path, {"a.yml": one_edit(r"^def beta\(")})
    _, manifest = patchset.compute("9.9.9", wheel, root, tmp_path)
    assert set(manifest) == {"format", "vllm_version", "wheel", "targets", "added"}


@pytest.mark.parametrize("plugin_files,edits,add,message", [
    ({"pkg/mod.py": ORIGINAL}, {"a.yml": one_edit(r"^def beta\(")}, {},
     "pkg/mod.py is in 2 pinned wheels .* ambiguous"),
    ({"plug/x.py": ""}, {}, {"elsewhere/new.py": "X = 1\n"},
     "added file elsewhere/new.py: its directory elsewhere/ belongs to none of the pinned wheels"),
    ({"plug/x.py": ""}, {}, {"plug/x.py": "X = 1\n"},
     "plug-in 1.0 ships its own plug/x.py, which this patch set adds: refusing to overwrite upstream's file"),
])
def test_ownership_across_distributions_is_checked(tmp_path: Path, plugin_files: dict, edits: dict, add: dict,
                                                   message: str) -> None:
    root, wheel = make_patchset(tmp_path, edits, add=add)
    plugin = add_plugin_wheel(tmp_path, root, plugin_files)
    with pytest.raises(PatchsetError, match=message):
        patchset.compute("9.9.9", wheel, root, tmp_path, {"plug-in": plugin})


def test_a_wheel_must_be_its_distribution_at_its_version(tmp_path: Path) -> None:
    root, _ = make_patchset(tmp_path, {})
    spec_file = root / "9.9.9" / "patchset.yml"
    spec = yaml.safe_load(spec_file.read_text())
    spec["other_wheels"] = [{"distribution": "plug-in", "version": "2.0", "filename": "plug_in-1.0-py3-none-any.whl",
                             "sha256": "0" * 64}]
    spec_file.write_text(yaml.safe_dump(spec))
    with pytest.raises(PatchsetError, match="plug_in-1.0-py3-none-any.whl is not a wheel of plug-in 2.0"):
        patchset.load_spec("9.9.9", root)


def test_an_edit_refuses_a_name_upstream_already_has(tmp_path: Path) -> None:
    adds_alpha2 = {"target": "pkg/mod.py", "edits": [{"why": "test", "anchor": r"^def beta\(",
                                                      "action": "insert_before", "text": "def alpha2():\n    pass\n",
                                                      "adds": ["alpha2"]}]}
    root, wheel = make_patchset(tmp_path, {"a.yml": adds_alpha2})
    outputs, _ = patchset.compute("9.9.9", wheel, root, tmp_path)  # upstream lacks it: fine
    assert b"def alpha2():" in outputs["pkg/mod.py"]
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    root2, wheel2 = make_patchset(upstream, {"a.yml": adds_alpha2})
    with zipfile.ZipFile(wheel2, "w") as archive:  # the next release ships its own alpha2
        archive.writestr("pkg/mod.py", ORIGINAL + "\n\ndef alpha2():\n    return 3\n")
    spec_file = root2 / "9.9.9" / "patchset.yml"
    spec = yaml.safe_load(spec_file.read_text())
    spec["wheel"]["sha256"] = sha(wheel2.read_bytes())
    spec_file.write_text(yaml.safe_dump(spec))
    with pytest.raises(PatchsetError, match="pkg/mod.py of vLLM 9.9.9 already has alpha2, which a.yml edit 1 adds: "
                                            "upstream now ships its own; refusing to patch over it"):
        patchset.compute("9.9.9", wheel2, root2, upstream)


@pytest.mark.parametrize("upstream_ships", ["the backend file", "the enum entry"])
def test_the_real_032_set_refuses_an_upstream_triton_mla_sparse(tmp_path: Path, repo_root: Path,
                                                                upstream_ships: str) -> None:
    """A vLLM that ships its own TRITON_MLA_SPARSE (upstream main does): the build refuses.

    The fake release: a wheel with 0.32.0's own copies of the files the set reads, plus
    upstream's backend file or enum entry; the real 0.32.0 patch set, pinned to that wheel."""
    wheels = pinned_wheels("0.32.0")
    spec = patchset.load_spec("0.32.0")
    targets = {f.target for f in patchset.load_edit_files(spec)}
    fake = tmp_path / spec.wheel_filename
    backend = "vllm/v1/attention/backends/mla/triton_mla_sparse.py"
    with zipfile.ZipFile(wheels["vllm"]) as real, zipfile.ZipFile(fake, "w") as archive:
        for name in sorted(targets & set(real.namelist())):
            text = real.read(name)
            if upstream_ships == "the enum entry" and name == "vllm/v1/attention/backends/registry.py":
                text = text.replace(b"    TRITON_MLA = ", b"    TRITON_MLA_SPARSE = \"vllm.upstream.Sparse\"\n"
                                                        b"    TRITON_MLA = ", 1)
            archive.writestr(name, text)
        archive.writestr("vllm/__init__.py", real.read("vllm/__init__.py"))
        if upstream_ships == "the backend file":
            archive.writestr(backend, "class TritonMLASparseBackend:  # upstream's own\n    pass\n")
    patchsets = tmp_path / "files"
    shutil.copytree(spec.directory, patchsets / "0.32.0")
    spec_file = patchsets / "0.32.0" / "patchset.yml"
    pinned = yaml.safe_load(spec_file.read_text())
    pinned["wheel"]["sha256"] = sha(fake.read_bytes())
    spec_file.write_text(yaml.safe_dump(pinned))
    out = tmp_path / "out"
    with pytest.raises(PatchsetError) as err:
        patchset.build("0.32.0", out, wheel=fake, patchsets_dir=patchsets, repo_root=repo_root,
                       other_wheels={"vllm-gguf-plugin": wheels["vllm-gguf-plugin"]})
    if upstream_ships == "the backend file":
        assert str(err.value) == (f"vLLM 0.32.0 ships its own {backend}, which this patch set adds: refusing to "
                                  "overwrite upstream's file (drop ours, or change upstream's with an edit)")
    else:
        assert ("vllm/v1/attention/backends/registry.py of vLLM 0.32.0 already has TRITON_MLA_SPARSE, which "
                "backend-registry.yml edit 1 adds: upstream now ships its own") in str(err.value)
    assert not out.exists()


def test_a_cached_wheel_is_hashed_once_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"a pinned wheel's bytes" * 1000
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    wheel.write_bytes(data)
    pinned = patchset.Wheel("demo", "1.0", wheel.name, hashlib.sha256(data).hexdigest())
    assert patchset.fetch_wheel(pinned, tmp_path) == wheel
    stamp = json.loads((tmp_path / (wheel.name + ".sha256")).read_text())
    assert stamp["sha256"] == pinned.sha256 and stamp["size"] == len(data)

    def never(_path: object) -> str:
        raise AssertionError("hashed again")

    monkeypatch.setattr(patchset, "sha256_file", never)
    assert patchset.fetch_wheel(pinned, tmp_path) == wheel  # unchanged: the stamp answers
    monkeypatch.undo()
    wheel.write_bytes(data[:-1] + b"X")  # same size, new bytes and mtime: hashed again, refused
    with pytest.raises(PatchsetError, match="differs from the pinned"):
        patchset.fetch_wheel(pinned, tmp_path)
