"""Build the vLLM patch set: pristine files from the pinned wheel + our edits -> patched files and a manifest.

Everything for one vLLM release lives in `files/vllm/<version>/`:

- `patchset.yml`: `vllm_version`, the pinned `wheel` ({filename, sha256}) and `ship`, a list of
  `{src: mlafleet/kernels/<mod>.py, dest: vllm/third_party/mlafleet_kernels/<mod>.py}`;
- `edits/<name>.yml`: `target` (a path inside site-packages) and `edits`, each with `why`,
  `anchor` (a Python regex, re.MULTILINE, that must match the current text exactly once),
  `action` (insert_after | insert_before | replace) and `text`. Files are applied in sorted
  file-name order; several may target the same file;
- `add/<path inside site-packages>`: new files shipped whole;
- `manifest.json`: a copy of the manifest of a fresh build (a test keeps them equal);
  refresh it with `mlafleet patchset build --vllm <version> --update-manifest`.

Indented code in `text`: a plain `|` block drops the common indentation, so give YAML an
indentation indicator, e.g. `text: |2` under `  - why:` (the item's keys sit at column 4, the
text's lines at column 6 plus the code's own indentation), as edits/backend-registry.yml does.

`build(version, out_dir)` writes `<out_dir>/files/<path>` for every patched and added file and
`<out_dir>/manifest.json`. The same inputs give byte-identical outputs; nothing in `out_dir`
changes unless the whole build succeeds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHSETS_DIR = REPO_ROOT / "files" / "vllm"
DEFAULT_BUILD_DIR = REPO_ROOT / "build" / "patchset"
ACTIONS = ("insert_after", "insert_before", "replace")
KERNELS_PACKAGE = "vllm/third_party/mlafleet_kernels"
KERNELS_INIT = (
    '"""mlafleet\'s Triton kernels, shipped into the vLLM tree by the mlafleet patch set.\n\n'
    "Source of truth: the mlafleet repository, mlafleet/kernels/.\n"
    '"""\n'
)
MANIFEST_FORMAT = 1


class PatchsetError(Exception):
    """A patch set that cannot be built: the message names the file and the problem."""


@dataclass(frozen=True)
class Edit:
    source: str  # the edits/<name>.yml file it comes from
    index: int  # its position in that file, from 1
    why: str
    anchor: str
    action: str
    text: str


@dataclass(frozen=True)
class EditFile:
    name: str
    target: str
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Spec:
    version: str
    directory: Path
    wheel_filename: str
    wheel_sha256: str
    ship: tuple[tuple[str, str], ...]  # (src in this repo, dest inside site-packages)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def supported_versions(patchsets_dir: Path = PATCHSETS_DIR) -> list[str]:
    if not patchsets_dir.is_dir():
        return []
    return sorted(p.name for p in patchsets_dir.iterdir() if (p / "patchset.yml").is_file())


def _site_path(value: Any, where: str) -> str:
    """A relative POSIX path inside site-packages, without '..' or empty parts."""
    if not isinstance(value, str) or not value:
        raise PatchsetError(f"{where}: expected a path inside site-packages, got {value!r}")
    path = PurePosixPath(value)
    if path.is_absolute() or any(part in ("", ".", "..") for part in value.split("/")):
        raise PatchsetError(f"{where}: {value!r} must be a relative path inside site-packages "
                            "(no leading '/', no '.' or '..' parts)")
    return value


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PatchsetError(f"{path}: not valid YAML: {exc}") from None


def load_spec(version: str, patchsets_dir: Path = PATCHSETS_DIR) -> Spec:
    directory = patchsets_dir / version
    spec_file = directory / "patchset.yml"
    if not spec_file.is_file():
        supported = ", ".join(supported_versions(patchsets_dir)) or "none"
        raise PatchsetError(f"no patch set for vLLM {version} (supported: {supported})")
    data = _load_yaml(spec_file)
    if not isinstance(data, dict):
        raise PatchsetError(f"{spec_file}: expected a mapping")
    unknown = set(data) - {"vllm_version", "wheel", "ship"}
    if unknown:
        raise PatchsetError(f"{spec_file}: unknown keys {sorted(unknown)}")
    if str(data.get("vllm_version")) != version:
        raise PatchsetError(f"{spec_file}: vllm_version is {data.get('vllm_version')!r}, "
                            f"expected {version!r} (the directory name)")
    wheel = data.get("wheel")
    if (not isinstance(wheel, dict) or not isinstance(wheel.get("filename"), str)
            or not re.fullmatch(r"[0-9a-f]{64}", str(wheel.get("sha256", "")))):
        raise PatchsetError(f"{spec_file}: wheel must be {{filename: <name>.whl, sha256: <64 hex>}}")
    if not wheel["filename"].endswith(".whl") or "/" in wheel["filename"]:
        raise PatchsetError(f"{spec_file}: wheel.filename {wheel['filename']!r} is not a wheel file name")
    ship: list[tuple[str, str]] = []
    for n, entry in enumerate(data.get("ship") or [], start=1):
        where = f"{spec_file}: ship[{n}]"
        if not isinstance(entry, dict) or set(entry) != {"src", "dest"}:
            raise PatchsetError(f"{where}: expected {{src: ..., dest: ...}}, got {entry!r}")
        src = _site_path(entry["src"], f"{where}.src")
        dest = _site_path(entry["dest"], f"{where}.dest")
        if not dest.startswith(KERNELS_PACKAGE + "/") or not dest.endswith(".py"):
            raise PatchsetError(f"{where}.dest: {dest!r} must be a module under {KERNELS_PACKAGE}/")
        ship.append((src, dest))
    return Spec(version=version, directory=directory, wheel_filename=wheel["filename"],
                wheel_sha256=wheel["sha256"], ship=tuple(ship))


def load_edit_file(path: Path) -> EditFile:
    data = _load_yaml(path)
    if not isinstance(data, dict) or set(data) != {"target", "edits"}:
        raise PatchsetError(f"{path}: expected exactly the keys 'target' and 'edits'")
    target = _site_path(data["target"], f"{path}: target")
    raw_edits = data["edits"]
    if not isinstance(raw_edits, list) or not raw_edits:
        raise PatchsetError(f"{path}: 'edits' must be a non-empty list")
    edits = []
    for index, raw in enumerate(raw_edits, start=1):
        where = f"{path}: edit {index}"
        if not isinstance(raw, dict) or set(raw) != {"why", "anchor", "action", "text"}:
            keys = sorted(raw) if isinstance(raw, dict) else raw
            raise PatchsetError(f"{where}: expected exactly the keys why, anchor, action, text; got {keys}")
        for key in ("why", "anchor", "action", "text"):
            if not isinstance(raw[key], str):
                raise PatchsetError(f"{where}: '{key}' must be a string")
        if not raw["why"].strip():
            raise PatchsetError(f"{where}: 'why' must say what the edit changes and why")
        if raw["action"] not in ACTIONS:
            raise PatchsetError(f"{where}: action {raw['action']!r} is not one of {', '.join(ACTIONS)}")
        try:
            re.compile(raw["anchor"], re.MULTILINE)
        except re.error as exc:
            raise PatchsetError(f"{where}: anchor {raw['anchor']!r} is not a valid regex: {exc}") from None
        edits.append(Edit(source=path.name, index=index, why=raw["why"].strip(),
                          anchor=raw["anchor"], action=raw["action"], text=raw["text"]))
    return EditFile(name=path.name, target=target, edits=tuple(edits))


def load_edit_files(spec: Spec) -> list[EditFile]:
    edits_dir = spec.directory / "edits"
    if not edits_dir.is_dir():
        return []
    others = sorted(p.name for p in edits_dir.iterdir() if p.suffix != ".yml")
    if others:
        raise PatchsetError(f"{edits_dir}: only <name>.yml files belong here, found {others}")
    return [load_edit_file(p) for p in sorted(edits_dir.glob("*.yml"))]


def apply_edit(text: str, edit: Edit, target: str) -> str:
    """Apply one edit to `text` (the current content of `target`)."""
    matches = list(re.finditer(edit.anchor, text, re.MULTILINE))
    if len(matches) != 1:
        raise PatchsetError(f"{edit.source} edit {edit.index}: anchor '{edit.anchor}' matches "
                            f"{len(matches)} times in {target} (it must match exactly once)")
    match = matches[0]
    if edit.action == "replace":
        return text[:match.start()] + edit.text + text[match.end():]
    insertion = edit.text if edit.text.endswith("\n") else edit.text + "\n"
    if edit.action == "insert_before":
        at = text.rfind("\n", 0, match.start()) + 1
        return text[:at] + insertion + text[at:]
    # insert_after: after the end of the line the match ends on (a match that ends with a
    # newline ends on the line before that newline).
    if match.end() > match.start() and text[match.end() - 1] == "\n":
        at = match.end()
    else:
        newline = text.find("\n", match.end())
        if newline == -1:
            return text + "\n" + insertion
        at = newline + 1
    return text[:at] + insertion + text[at:]


def default_cache_dir() -> Path:
    from mlafleet.wheelhouse import cache_dir

    return cache_dir() / "dl"


def fetch_wheel(spec: Spec, cache_dir: Path | None = None) -> Path:
    """The pinned wheel from the cache, downloaded with pip once if absent; verified by sha256."""
    cache_dir = cache_dir or default_cache_dir()
    wheel = cache_dir / spec.wheel_filename
    if not wheel.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
            platform = spec.wheel_filename[:-len(".whl")].split("-")[-1]  # the pinned wheel's platform tag
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--platform", platform, "--dest", tmp, f"vllm=={spec.version}"]
            print(f"downloading {spec.wheel_filename} (once, into {cache_dir})", file=sys.stderr)
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            fetched = Path(tmp) / spec.wheel_filename
            if result.returncode != 0 or not fetched.is_file():
                raise PatchsetError(f"could not download {spec.wheel_filename} with pip: "
                                    f"{(result.stderr or result.stdout).strip()[-500:]}")
            if sha256_file(fetched) != spec.wheel_sha256:
                raise PatchsetError(f"downloaded {spec.wheel_filename} has sha256 {sha256_file(fetched)}, "
                                    f"patchset.yml pins {spec.wheel_sha256}")
            os.replace(fetched, wheel)
    actual = sha256_file(wheel)
    if actual != spec.wheel_sha256:
        raise PatchsetError(f"{wheel}: sha256 {actual} differs from the pinned {spec.wheel_sha256}; "
                            "remove it to download it again")
    return wheel


def _read_member(wheel: zipfile.ZipFile, path: str, wheel_path: Path) -> bytes:
    try:
        return wheel.read(path)
    except KeyError:
        raise PatchsetError(f"{path} is not in {wheel_path.name}: no such file in vLLM") from None


def _added_files(spec: Spec, repo_root: Path) -> dict[str, bytes]:
    """Files we ship whole: add/**, the shipped kernel modules and their package __init__."""
    added: dict[str, bytes] = {}
    add_dir = spec.directory / "add"
    if add_dir.is_dir():
        for path in sorted(add_dir.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                added[path.relative_to(add_dir).as_posix()] = path.read_bytes()
    if spec.ship:
        added[f"{KERNELS_PACKAGE}/__init__.py"] = KERNELS_INIT.encode()
    for src, dest in spec.ship:
        source = repo_root / src
        if not source.is_file():
            raise PatchsetError(f"patchset.yml ships {src}, which does not exist in this repository")
        if dest in added:
            raise PatchsetError(f"patchset.yml ships {src} to {dest}, which another added file already uses")
        added[dest] = source.read_bytes()
    return added


def compute(version: str, wheel: Path | None = None, patchsets_dir: Path = PATCHSETS_DIR,
            repo_root: Path = REPO_ROOT) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The patched and added files (path inside site-packages -> bytes) and the manifest."""
    spec = load_spec(version, patchsets_dir)
    edit_files = load_edit_files(spec)
    wheel = wheel or fetch_wheel(spec)
    if sha256_file(wheel) != spec.wheel_sha256:
        raise PatchsetError(f"{wheel} is not the pinned wheel {spec.wheel_filename} ({spec.wheel_sha256})")
    by_target: dict[str, list[EditFile]] = {}
    for edit_file in edit_files:
        by_target.setdefault(edit_file.target, []).append(edit_file)

    outputs: dict[str, bytes] = {}
    targets = []
    with zipfile.ZipFile(wheel) as archive:
        for target in sorted(by_target):
            original = _read_member(archive, target, wheel)
            try:
                text = original.decode("utf-8")
            except UnicodeDecodeError:
                raise PatchsetError(f"{target} is not UTF-8 text: only text files can be edited") from None
            for edit_file in by_target[target]:
                for edit in edit_file.edits:
                    text = apply_edit(text, edit, target)
            patched = text.encode("utf-8")
            if patched == original:
                raise PatchsetError(f"the edits to {target} leave it unchanged")
            outputs[target] = patched
            targets.append({"path": target, "original_sha256": sha256_bytes(original),
                            "patched_sha256": sha256_bytes(patched),
                            "edits": [f.name for f in by_target[target]]})
        added = _added_files(spec, repo_root)
        names = set(archive.namelist())
        for path in sorted(added):
            if path in names:
                raise PatchsetError(f"added file {path} already exists in vLLM {version}: "
                                    "change it with an edit instead")
            if path in outputs:
                raise PatchsetError(f"{path} is both edited and added")
    outputs.update(added)
    manifest = {
        "format": MANIFEST_FORMAT,
        "vllm_version": version,
        "wheel": {"filename": spec.wheel_filename, "sha256": spec.wheel_sha256},
        "targets": targets,
        "added": [{"path": p, "sha256": sha256_bytes(added[p])} for p in sorted(added)],
    }
    return outputs, manifest


def manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def build(version: str, out_dir: Path, wheel: Path | None = None, patchsets_dir: Path = PATCHSETS_DIR,
          repo_root: Path = REPO_ROOT) -> Path:
    """Build the patch set into out_dir (replaced whole, only on success); returns the manifest path."""
    outputs, manifest = compute(version, wheel, patchsets_dir, repo_root)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        for path, data in sorted(outputs.items()):
            dest = staging / "files" / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            dest.chmod(0o644)
        (staging / "manifest.json").write_text(manifest_text(manifest), encoding="utf-8")
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}-old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(staging, out_dir)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir / "manifest.json"


def _cmd_build(args: argparse.Namespace) -> int:
    out_dir = Path(args.out) if args.out else DEFAULT_BUILD_DIR / args.vllm
    try:
        manifest_path = build(args.vllm, out_dir, Path(args.wheel) if args.wheel else None)
    except PatchsetError as exc:
        print(f"mlafleet patchset build: {exc}", file=sys.stderr)
        return 1
    committed = PATCHSETS_DIR / args.vllm / "manifest.json"
    fresh = manifest_path.read_text(encoding="utf-8")
    if args.update_manifest:
        committed.write_text(fresh, encoding="utf-8")
        print(f"updated {committed}")
    elif not committed.is_file() or committed.read_text(encoding="utf-8") != fresh:
        print(f"note: {committed} differs from this build; run with --update-manifest and commit it",
              file=sys.stderr)
    manifest = json.loads(fresh)
    print(f"built vLLM {args.vllm} patch set in {out_dir}: {len(manifest['targets'])} patched, "
          f"{len(manifest['added'])} added files")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("patchset", help="build the vLLM patch set")
    commands = parser.add_subparsers(dest="patchset_command", required=True, metavar="ACTION")
    build_parser = commands.add_parser("build", help="patched files + manifest from the pinned wheel")
    build_parser.add_argument("--vllm", required=True, metavar="VERSION", help="vLLM version, e.g. 0.20.2")
    build_parser.add_argument("--out", help="output directory (default: build/patchset/<version>)")
    build_parser.add_argument("--wheel", help="use this wheel file instead of the cached download "
                                              "(must be the pinned one)")
    build_parser.add_argument("--update-manifest", action="store_true",
                              help="also write files/vllm/<version>/manifest.json (commit it)")
    build_parser.set_defaults(func=_cmd_build)


def main(argv: list[str] | None = None) -> int:
    """`python -m mlafleet.patchset build ...`: the same as `mlafleet patchset build ...`."""
    parser = argparse.ArgumentParser(prog="python -m mlafleet.patchset")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["patchset", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
