"""`mlafleet weights`: manifests of GGUF shards and safetensors snapshots, and staging on the controller.

- `manifest DIR` hashes the shards in parallel (with a progress bar), reads their GGUF headers
  with the `gguf` package and checks that split.no / split.count / split.tensors.count agree
  and that the shards belong to one model, then writes a JSON manifest. A DIR holding a
  safetensors snapshot (config.json and .safetensors files), or `--hub OWNER/NAME` without DIR,
  gives a safetensors manifest instead (mlafleet.weights.snapshot).
- `check DIR` runs the checks before serving on a safetensors snapshot (index, headers, FP8 scales).
- `stage`, `verify` and `merge` run the same host-side code that the weights role ships to
  hosts (the collection's module_utils weights_stage and gguf_merge, which its modules call), here on
  the controller or a shared filesystem, imported by their collection name.
- `serve DIR` runs a ranged HTTP mirror (mlafleet.weights.mirror).

The module imports only the standard library and those module_utils at import time (the CLI
builds every subparser).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from ansible_collections.mlafleet.fleet.plugins.module_utils import gguf_merge, safetensors_check, weights_stage
from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import hash_file

MANIFEST_FORMAT = "mlafleet-gguf-manifest/1"
SHARD_RE = re.compile(r"^(?P<model>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
CHUNK = 8 << 20
HUB_TOKEN_ENV = "MLAFLEET_HUB_TOKEN"


class WeightsError(Exception):
    """A manifest or staging problem, with a message that names it."""


# --- progress --------------------------------------------------------------------------------

class Progress:
    """A byte-count progress bar on a stream; thread-safe, redrawn at most 5 times a second."""

    def __init__(self, total: int, label: str, stream: IO[str] | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._lock = threading.Lock()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if self._tty and now - self._drawn >= 0.2:
                self._drawn = now
                self.stream.write("\r" + self.line())
                self.stream.flush()

    def note(self, text: str) -> None:
        with self._lock:
            prefix = "\r\033[K" if self._tty else ""
            self.stream.write(f"{prefix}{text}\n")
            self.stream.flush()

    def line(self) -> str:
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * self.width)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {fraction * 100:5.1f}% "
                f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB {self.done / elapsed / 2**20:.0f} MiB/s")

    def finish(self) -> None:
        with self._lock:
            self.stream.write(("\r" if self._tty else "") + self.line() + "\n")
            self.stream.flush()


def hash_files(paths: list[Path], jobs: int, progress: Progress | None = None,
                chunk_size: int = 0) -> dict[Path, tuple[str, list[str]]]:
    """sha256 of several files, `jobs` at a time, with the sha256 of every chunk_size bytes
    (the one-pass hash of the hosts' staging, so the manifest and the hosts' checks cannot differ)."""
    advance = progress.advance if progress else (lambda _n: None)

    def one(path: Path) -> tuple[Path, tuple[str, list[str]]]:
        digest, chunks = hash_file(str(path), chunk_size, advance)
        if progress:
            progress.note(f"{path.name}  {digest}")
        return path, (digest, chunks)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(pool.map(one, paths))


# --- GGUF split headers ----------------------------------------------------------------------

@dataclass(frozen=True)
class SplitHeader:
    """What one shard's GGUF header says about the split it belongs to."""

    path: Path
    split_no: int | None
    split_count: int | None
    tensors_count: int | None
    architecture: str | None
    tensor_names: tuple[str, ...]


def read_split_header(path: Path) -> SplitHeader:
    """Read a shard's split keys, architecture and tensor names with the `gguf` package."""
    from gguf import GGUFReader  # numpy-heavy: import only when a manifest is built

    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, struct errors, numpy errors...
        raise WeightsError(f"{path.name}: not a readable GGUF file ({err})") from None

    def value(key: str) -> int | str | None:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    return SplitHeader(path, value("split.no"), value("split.count"), value("split.tensors.count"),
                       value("general.architecture"), tuple(t.name for t in reader.tensors))


def check_split_headers(headers: list[SplitHeader]) -> dict:
    """Check that the shards (sorted by file name) form one complete split of one model.

    Returns {architecture, tensor_count}; raises WeightsError naming the first disagreement.
    """
    count = len(headers)
    for index, header in enumerate(headers):
        name = header.path.name
        if count == 1 and header.split_count is None:
            continue
        if header.split_count != count:
            raise WeightsError(f"{name}: split.count is {header.split_count}, the files say {count} shards")
        if header.split_no != index:
            raise WeightsError(f"{name}: split.no is {header.split_no}, expected {index} for shard {index + 1}")
    first = headers[0]
    if not first.architecture:
        raise WeightsError(f"{first.path.name}: no general.architecture in the first shard")
    for header in headers[1:]:
        if header.architecture not in (None, first.architecture):
            raise WeightsError(f"{header.path.name}: architecture {header.architecture!r} differs from the "
                               f"first shard's {first.architecture!r}: not one model")
    total = sum(len(h.tensor_names) for h in headers)
    declared = {h.tensors_count for h in headers if h.tensors_count is not None}
    if declared and declared != {total}:
        raise WeightsError(f"split.tensors.count says {sorted(declared)}, the shards hold {total} tensors: "
                           "the shards do not belong to one model")
    seen: dict[str, str] = {}
    for header in headers:
        for tensor in header.tensor_names:
            if tensor in seen:
                raise WeightsError(f"tensor {tensor!r} is in both {seen[tensor]} and {header.path.name}: "
                                   "the shards do not belong to one model")
            seen[tensor] = header.path.name
    return {"architecture": first.architecture, "tensor_count": total}


def find_shards(directory: Path, model: str | None = None) -> list[Path]:
    """The shard files of one model in `directory`, all N of N, sorted."""
    if not directory.is_dir():
        raise WeightsError(f"{directory} is not a directory")
    groups: dict[tuple[str, int], list[Path]] = {}
    for path in directory.iterdir():
        match = SHARD_RE.match(path.name)
        if match and path.is_file() and (model is None or match["model"] == model):
            groups.setdefault((match["model"], int(match["count"])), []).append(path)
    if not groups:
        raise WeightsError(f"no <model>-0000K-of-0000N.gguf shards{f' of {model}' if model else ''} in {directory}")
    if len(groups) > 1:
        names = sorted(f"{m} ({n} shards)" for m, n in groups)
        raise WeightsError(f"{directory} holds shards of several models or splits: {names}; pick one with --model")
    (name, count), paths = next(iter(groups.items()))
    numbers = {int(SHARD_RE.match(p.name)["no"]) for p in paths}
    missing = sorted(set(range(1, count + 1)) - numbers)
    if missing:
        raise WeightsError(f"{name}: {len(missing)} of {count} shards are missing in {directory}: "
                           + ", ".join(f"{name}-{n:05d}-of-{count:05d}.gguf" for n in missing[:8]))
    return sorted(paths)


def build_manifest(directory: Path, model: str | None = None, jobs: int = 4,
                   progress_stream: IO[str] | None = None, chunk_size: int | None = None) -> dict:
    """The manifest of one model's shards in `directory`: headers checked, sha256 in parallel,
    with the sha256 of every chunk_size bytes (default 64 MiB) for the hosts' spot checks."""
    chunk_size = weights_stage.MANIFEST_CHUNK if chunk_size is None else chunk_size
    paths = find_shards(directory, model)
    headers = [read_split_header(p) for p in paths]
    summary = check_split_headers(headers)
    sizes = {p: p.stat().st_size for p in paths}
    progress = Progress(sum(sizes.values()), "hashing", progress_stream) if progress_stream else None
    digests = hash_files(paths, jobs, progress, chunk_size)
    if progress:
        progress.finish()
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": SHARD_RE.match(paths[0].name)["model"],
        "architecture": summary["architecture"],
        "split_count": len(paths),
        "tensor_count": summary["tensor_count"],
        "total_size": sum(sizes.values()),
        "shards": [{"name": p.name, "size": sizes[p], "sha256": digests[p][0], "tensors": len(h.tensor_names),
                    "chunk_size": chunk_size, "chunks": digests[p][1]}
                   for p, h in zip(paths, headers)],
    }
    try:  # what the role and the host module will check: a name they refuse is refused here already
        weights_stage.check_manifest(manifest)
    except weights_stage.StageError as err:
        raise WeightsError(f"{directory}: {err}") from None
    return manifest


def load_manifest(path: Path) -> dict:
    """Read a manifest and check every name in it (model, shards 1..N of N, sizes, sha256)."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise WeightsError(f"cannot read manifest {path}: {err}") from None
    try:
        weights_stage.check_manifest(manifest)
    except weights_stage.StageError as err:
        raise WeightsError(f"{path}: {err}") from None
    return manifest


# --- CLI -------------------------------------------------------------------------------------

def _source_specs(args: argparse.Namespace, manifest_revision: str = "") -> list[dict]:
    specs: list[dict] = []
    if args.from_path:
        specs.append({"type": "path", "path": args.from_path})
    if args.from_peer:
        host, _, path = args.from_peer.partition(":")
        user, _, host = host.rpartition("@")
        specs.append({"type": "peer", "host": host, "user": user or "root", "path": path})
    if args.from_url:
        specs.append({"type": "http", "url": args.from_url})
    if args.from_hub:
        token = os.environ.get(HUB_TOKEN_ENV, "")
        if args.token_file:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        specs.append({"type": "hub", "repo": args.from_hub, "revision": args.revision or manifest_revision,
                      "endpoint": args.hub_endpoint, "token": token})
    return specs


def hub_token(args: argparse.Namespace) -> str:
    if getattr(args, "token_file", None):
        return Path(args.token_file).read_text(encoding="utf-8").strip()
    return os.environ.get(HUB_TOKEN_ENV, "") or os.environ.get("HF_TOKEN", "")


def cmd_manifest(args: argparse.Namespace) -> int:
    from mlafleet.weights import snapshot

    if args.chunk_mib < 1:
        raise WeightsError(f"--chunk-mib must be at least 1, not {args.chunk_mib}")
    if bool(args.hub) == bool(args.directory):
        raise WeightsError("give a DIRECTORY or --hub OWNER/NAME (one of them)")
    try:
        if args.hub:
            token = hub_token(args)
            try:
                manifest = snapshot.build_from_hub(args.hub, args.revision or "main", args.hub_endpoint, token,
                                                   args.model, args.chunk_mib << 20)
            except snapshot.SnapshotError as err:
                raise WeightsError(weights_stage.redact(str(err), [token])) from None
        elif snapshot.is_snapshot(Path(args.directory)):
            manifest = snapshot.build_from_directory(Path(args.directory), args.model, args.revision or None,
                                                     args.repo, args.jobs, None if args.quiet else sys.stderr,
                                                     args.chunk_mib << 20)
        else:
            manifest = build_manifest(Path(args.directory), args.model, args.jobs,
                                      None if args.quiet else sys.stderr, args.chunk_mib << 20)
    except snapshot.SnapshotError as err:
        raise WeightsError(str(err)) from None
    text = json.dumps(manifest, indent=2) + "\n"
    if args.output:
        tmp = Path(args.output + ".partial")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, args.output)
        if manifest["format"] == snapshot.FORMAT:
            print(f"{args.output}: {manifest['file_count']} files ({manifest['safetensors_count']} safetensors), "
                  f"{manifest['total_size']} bytes, revision {manifest['revision'] or 'none (not from a hub)'}",
                  file=sys.stderr)
        else:
            print(f"{args.output}: {manifest['split_count']} shards, {manifest['total_size']} bytes, "
                  f"{manifest['tensor_count']} tensors ({manifest['architecture']})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.manifest))
    specs = _source_specs(args, manifest.get("revision") or "")
    secrets = [s.get("token", "") for s in specs]

    def log(message: str) -> None:
        print(weights_stage.redact(message, secrets), file=sys.stderr, flush=True)

    try:
        shards = weights_stage.check_manifest(manifest)
        sources = [weights_stage.make_source(spec, args.timeout) for spec in specs]
        result = weights_stage.stage(args.dest, shards, sources, verify=args.verify, retries=args.retries,
                                  reserve=args.reserve_mb << 20, check_mode=args.check, log=log,
                                  spot_chunks=args.spot_chunks)
    except weights_stage.StageError as err:
        raise WeightsError(weights_stage.redact(str(err), secrets)) from None
    verb = "would fetch" if args.check else "fetched"
    print(f"{args.dest}: {result['present']} of {result['expected']} files verified; {verb} "
          f"{len(result['fetched'])}, re-stamped {len(result['restamped'])}", file=sys.stderr)
    return 0 if args.check else cmd_verify(args)


def cmd_verify(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.manifest))
    files = weights_stage.check_manifest(manifest)
    try:
        result = weights_stage.prove_present(args.dest, files, args.verify, args.spot_chunks)
        checked = (safetensors_check.check_snapshot(args.dest, [f.name for f in files])
                   if weights_stage.manifest_format(manifest) == "safetensors" else None)
    except (weights_stage.StageError, safetensors_check.CheckError) as err:
        raise WeightsError(str(err)) from None
    print(f"{args.dest}: all {result['present']} of {result['expected']} files present and verified; "
          f"{result['spot_check']['summary']}" + (f"; {checked['summary']}" if checked else ""), file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from mlafleet.weights import snapshot

    try:
        if args.manifest:
            names = [f.name for f in weights_stage.check_manifest(load_manifest(Path(args.manifest)))]
        else:
            names = [p.name for p in snapshot.snapshot_files(Path(args.directory))[0]]
        checked = safetensors_check.check_snapshot(args.directory, names)
    except (weights_stage.StageError, safetensors_check.CheckError, snapshot.SnapshotError) as err:
        raise WeightsError(f"{args.directory}: {err}") from None
    print(f"{args.directory}: {checked['summary']}", file=sys.stderr)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.manifest))
    try:
        shards = weights_stage.parse_shards(manifest.get("shards") or [])
        weights_stage.prove_present(args.dest, shards)
        result = gguf_merge.merge(args.dest, [s.name for s in shards], args.output)
    except (weights_stage.StageError, gguf_merge.MergeError) as err:
        raise WeightsError(str(err)) from None
    state = "written" if result["changed"] else "up to date"
    print(f"{args.output}: {result['tensors']} tensors, {result['size']} bytes, {state}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mlafleet.weights import mirror as weights_mirror

    return weights_mirror.run(args)


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except WeightsError as err:
            print(f"mlafleet weights: error: {err}", file=sys.stderr)
            return 2
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("weights", help="GGUF and safetensors manifests, staging and checks",
                                   description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="weights_command", required=True, metavar="ACTION")

    manifest = commands.add_parser("manifest", help="build a manifest of GGUF shards or a safetensors snapshot "
                                                    "in DIR, or of a hub repository (--hub) without downloading it")
    manifest.add_argument("directory", nargs="?")
    manifest.add_argument("--hub", metavar="OWNER/NAME", help="a hub repository (safetensors); its LFS files are not "
                          f"downloaded; the token comes from ${HUB_TOKEN_ENV}, $HF_TOKEN or --token-file")
    manifest.add_argument("--revision", default="",
                          help="with --hub: branch, tag or commit, pinned as its commit (default main); with DIR: "
                               "the commit the snapshot is of (40 hex digits; read from a hub cache's snapshots/<commit>)")
    manifest.add_argument("--repo", help="with DIR: the hub repository the snapshot is of (recorded)")
    manifest.add_argument("--hub-endpoint", default=None, help="hub URL (default $HF_ENDPOINT or https://huggingface.co)")
    manifest.add_argument("--token-file", help="file holding the hub token (never printed)")
    manifest.add_argument("-o", "--output", help="write the manifest here (default: stdout)")
    manifest.add_argument("--model", help="GGUF: the shard name prefix, when DIR holds several models; "
                                          "safetensors: the model (directory) name")
    manifest.add_argument("-j", "--jobs", type=int, default=min(8, os.cpu_count() or 1),
                          help="shards hashed in parallel")
    manifest.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    manifest.add_argument("--chunk-mib", type=int, default=64,
                          help="record the sha256 of every CHUNK_MIB MiB of each shard (the hosts' spot checks)")
    manifest.set_defaults(func=_guarded(cmd_manifest))

    stage = commands.add_parser("stage", help="fetch, verify and stamp shards into DEST")
    stage.add_argument("--manifest", required=True)
    stage.add_argument("--dest", required=True)
    stage.add_argument("--from-path", help="a local or shared directory holding the shards")
    stage.add_argument("--from-peer", help="[USER@]HOST:DIR, read with rsync over SSH")
    stage.add_argument("--from-url", help="an HTTP(S) mirror serving URL/<shard name>")
    stage.add_argument("--from-hub", metavar="OWNER/NAME",
                       help=f"a model hub repository; the token comes from ${HUB_TOKEN_ENV} or --token-file")
    stage.add_argument("--revision", default="",
                       help="the hub commit (40 hex digits; default: the manifest's revision); branch names are refused")
    stage.add_argument("--hub-endpoint", default=os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    stage.add_argument("--token-file", help="file holding the hub token (never printed)")
    stage.add_argument("--verify", choices=["stamp", "full"], default="stamp")
    stage.add_argument("--spot-chunks", type=int, default=2,
                     help="chunks per stamped shard re-hashed at random on every run (0: none)")
    stage.add_argument("--retries", type=int, default=2)
    stage.add_argument("--reserve-mb", type=int, default=1024)
    stage.add_argument("--timeout", type=int, default=60)
    stage.add_argument("--check", action="store_true", help="report what would be fetched; change nothing")
    stage.set_defaults(func=_guarded(cmd_stage))

    verify = commands.add_parser("verify", help="prove that all N of N shards are present and verified")
    verify.add_argument("--manifest", required=True)
    verify.add_argument("dest")
    verify.add_argument("--verify", choices=["stamp", "full"], default="stamp")
    verify.add_argument("--spot-chunks", type=int, default=2,
                     help="chunks per stamped shard re-hashed at random on every run (0: none)")
    verify.set_defaults(func=_guarded(cmd_verify))

    check = commands.add_parser("check", help="check a safetensors snapshot before serving (index, headers, "
                                              "FP8 block scales)")
    check.add_argument("directory")
    check.add_argument("--manifest", help="check the files this manifest lists (default: DIR's files)")
    check.set_defaults(func=_guarded(cmd_check))

    merge = commands.add_parser("merge", help="stream the shards into one GGUF file")
    merge.add_argument("--manifest", required=True)
    merge.add_argument("dest", help="the directory holding the verified shards")
    merge.add_argument("output", help="the merged .gguf file")
    merge.set_defaults(func=_guarded(cmd_merge))

    serve = commands.add_parser("serve", help="serve DIR over HTTP with byte ranges (a mirror)")
    from mlafleet.weights import mirror as weights_mirror

    weights_mirror.add_arguments(serve)
    serve.set_defaults(func=_guarded(cmd_serve))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlafleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
