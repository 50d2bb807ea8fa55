"""Staging a model's files (GGUF shards or a safetensors snapshot) into a directory, verified against a manifest.

This file is the one place where staging happens. It runs on a host, shipped by Ansible with the
collection's module `mlafleet.fleet.weights_stage` (which the weights role calls), and
on the controller, where the filter `weights_manifest_problem` checks manifests with it and
`mlafleet weights` (manifest, stage, verify, merge) imports it by the same name, so it uses the
standard library and the collection's module_utils only: hosts carry nothing but Debian's python3.

For every shard of the manifest:
  - a verified shard with a matching stamp (size, mtime_ns, sha256) costs one stat, plus a spot
    check: where the manifest carries per-chunk sha256 (`chunk_size`, `chunks`), a few chunks
    picked at random are read and hashed on every run (a flipped byte with its mtime kept is
    found once its chunk is picked; verify=full re-hashes everything);
  - otherwise the bytes land in `<name>.partial`, resumed from wherever a previous run
    stopped, are checked against the manifest's sha256, then renamed atomically;
  - the free space for every byte still to come is checked before the first byte is written;
  - at the end, all N of N shards must be present and verified, or the run fails.

Two manifest formats share this code (check_manifest): GGUF shards (`shards`, names
<model>-0000K-of-0000N.gguf) and safetensors snapshots (`files`: config.json, tokenizer files,
model-0000K-of-0000N.safetensors, model.safetensors.index.json; plain names, with the hub commit
they were read at). A file whose manifest entry has no per-chunk sha256 (a manifest read from the
hub, which gives each file's LFS sha256 but not its chunks) gets them on its first staging: they
are computed from the same bytes whose whole sha256 matched the manifest, on the way in, and kept
in its stamp, which the spot check then reads. The safetensors checks before serving (index,
headers, FP8 block scales) are module_utils safetensors_check.

Sources are tried in order for each shard: `http` (a mirror, ranged requests), `hub` (a model
hub with a bearer token that never appears in output), `path` (a local or shared directory),
`peer` (rsync over SSH from a host that already holds verified shards).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import hash_file, sha256_file

CHUNK = 8 << 20
# the manifest's per-chunk sha256 (what the spot check reads), mlafleet weights manifest's default
MANIFEST_CHUNK = 64 << 20
STAMP_DIR = ".mlafleet-stamps"
MANIFEST_FORMAT = "mlafleet-gguf-manifest/1"
SAFETENSORS_FORMAT = "mlafleet-safetensors-manifest/1"
# A model name becomes a directory and every shard name a file in it: letters, digits, '.', '_',
# '-', starting with a letter or digit, and never '..' (no separators, no way up or out).
NAME_RE = r"[A-Za-z0-9][A-Za-z0-9._-]*"
MODEL_RE = re.compile(rf"^{NAME_RE}$")
SHARD_RE = re.compile(rf"^(?P<model>{NAME_RE})-(?P<no>\d{{5}})-of-(?P<count>\d{{5}})\.gguf$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
FILE_RE = re.compile(rf"^{NAME_RE}$")
SAFETENSORS_SHARD_RE = re.compile(r"^model-(?P<no>\d{5})-of-(?P<count>\d{5})\.safetensors$")
# A hub revision at staging time: a commit (40 hex digits), never a branch or tag that can move.
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

Log = Callable[[str], None]


class StageError(Exception):
    """A staging failure with a message that names the problem (never a secret)."""


@dataclass(frozen=True)
class Shard:
    name: str
    size: int
    sha256: str
    chunk_size: int = 0             # with `chunks`: the sha256 of each chunk_size bytes, in order
    chunks: tuple[str, ...] = ()


def parse_shards(entries: list[dict]) -> list[Shard]:
    """Validate the manifest's shard list: one model, shards 1..N of N exactly once each."""
    if not entries:
        raise StageError("manifest lists no shards")
    shards: list[Shard] = []
    models: set[str] = set()
    counts: set[int] = set()
    numbers: list[int] = []
    for entry in entries:
        shard = _parse_entry(entry, lambda n: bool(SHARD_RE.match(n)), "shard",
                             "is not of the form <model>-0000K-of-0000N.gguf (letters, digits, '.', '_', '-'; "
                             "no separators, no '..')")
        match = SHARD_RE.match(shard.name)
        models.add(match["model"])
        counts.add(int(match["count"]))
        numbers.append(int(match["no"]))
        shards.append(shard)
    if len(models) != 1 or len(counts) != 1:
        raise StageError(f"manifest mixes models or shard counts: {sorted(s.name for s in shards)}")
    count = counts.pop()
    expected = list(range(1, count + 1))
    if sorted(numbers) != expected:
        missing = sorted(set(expected) - set(numbers))
        extra = sorted(n for n in set(numbers) if numbers.count(n) > 1 or not 1 <= n <= count)
        raise StageError(f"manifest does not list shards 1..{count} of {count} exactly once "
                         f"(missing {missing}, duplicate or out of range {extra})")
    return sorted(shards, key=lambda s: s.name)


def parse_chunks(name: str, size: int, chunk_size: object, chunks: object) -> tuple[int, tuple[str, ...]]:
    """A shard's optional per-chunk sha256: both or neither, one 64-hex digest per chunk."""
    if chunk_size is None and chunks is None:
        return 0, ()
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise StageError(f"manifest shard {name}: chunk_size {chunk_size!r} is not a positive integer")
    if not isinstance(chunks, list):
        raise StageError(f"manifest shard {name}: chunks is not a list of sha256")
    want = max(1, -(-size // chunk_size))
    if len(chunks) != want:
        raise StageError(f"manifest shard {name}: {len(chunks)} chunk sha256 for {size} bytes in chunks of "
                         f"{chunk_size}, expected {want}")
    digests = tuple(str(c).lower() for c in chunks)
    bad = [c for c in digests if not SHA256_RE.match(c)]
    if bad:
        raise StageError(f"manifest shard {name}: chunk sha256 {bad[0]!r} is not 64 hex digits")
    return chunk_size, digests


def _parse_entry(entry: object, name_ok: Callable[[str], bool], what: str,
                 rule: str = "is not a plain file name (letters, digits, '.', '_', '-', starting with a letter "
                             "or digit; no separators, no '..', no .partial)") -> Shard:
    """One manifest entry (a GGUF shard or a snapshot's file): its name, size, sha256 and chunks."""
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name_ok(name) or ".." in name or name.endswith(".partial"):
        raise StageError(f"manifest {what} name {name!r} {rule}")
    size, sha = entry.get("size"), str(entry.get("sha256", "")).lower()
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise StageError(f"manifest {what} {name}: size {size!r} is not a non-negative integer")
    if not SHA256_RE.match(sha):
        raise StageError(f"manifest {what} {name}: sha256 {entry.get('sha256')!r} is not 64 hex digits")
    chunk_size, chunks = parse_chunks(name, size, entry.get("chunk_size"), entry.get("chunks"))
    return Shard(name, size, sha, chunk_size, chunks)


def parse_files(entries: list[dict]) -> list[Shard]:
    """Validate a safetensors snapshot's file list: plain names, each once, model shards 1..N of N."""
    if not entries:
        raise StageError("manifest lists no files")
    files = [_parse_entry(e, lambda n: bool(FILE_RE.match(n)), "file") for e in entries]
    names = [f.name for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise StageError(f"manifest lists files more than once: {twice}")
    if "config.json" not in names:
        raise StageError("manifest lists no config.json: not a model snapshot")
    shards = [SAFETENSORS_SHARD_RE.match(n) for n in names]
    shards = [m for m in shards if m]
    if shards:
        count = int(shards[0]["count"])
        numbers = sorted(int(m["no"]) for m in shards)
        if {int(m["count"]) for m in shards} != {count} or numbers != list(range(1, count + 1)):
            missing = sorted(set(range(1, count + 1)) - set(numbers))
            raise StageError(f"manifest does not list model-0000K-of-{count:05d}.safetensors 1..{count} of {count} "
                             f"exactly once (missing {[f'model-{n:05d}-of-{count:05d}.safetensors' for n in missing[:8]]})")
        if "model.safetensors.index.json" not in names:
            raise StageError(f"manifest lists {count} safetensors shards but no model.safetensors.index.json")
    elif "model.safetensors" not in names:
        raise StageError("manifest lists neither model.safetensors nor model-0000K-of-0000N.safetensors with "
                         "model.safetensors.index.json")
    return sorted(files, key=lambda f: f.name)


def check_revision(revision: object, where: str = "manifest revision") -> str:
    """A pinned hub revision: 40 hex digits. A branch or tag name (which can move) is refused."""
    if not isinstance(revision, str) or not COMMIT_RE.match(revision):
        raise StageError(f"{where} {revision!r} is not a commit (40 hex digits): a branch or tag name can move "
                         "between hosts and runs; pin the commit (`mlafleet weights manifest --hub` records it)")
    return revision


def manifest_format(manifest: object) -> str:
    """'gguf' or 'safetensors', from the manifest's format field; StageError for anything else."""
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt == MANIFEST_FORMAT:
        return "gguf"
    if fmt == SAFETENSORS_FORMAT:
        return "safetensors"
    raise StageError(f"not an mlafleet weights manifest (format {MANIFEST_FORMAT} or {SAFETENSORS_FORMAT})")


def check_manifest(manifest: object) -> list[Shard]:
    """Every name a manifest holds, checked before anything is created from it.

    A safetensors manifest: the model name, the revision (a commit, or null for a snapshot that
    did not come from a hub), and its files (parse_files). A GGUF manifest:

    the format, the model name (a directory: no separators, no '..'), split_count, and the shard
    list (parse_shards: the shard pattern, 1..N of N exactly once) with every shard of that model
    and of split_count shards. Returns the files; raises StageError naming the first problem.
    """
    fmt = manifest_format(manifest)
    model = manifest.get("model")
    if not isinstance(model, str) or not MODEL_RE.match(model) or ".." in model:
        raise StageError(f"manifest model {model!r} is not a plain name (letters, digits, '.', '_', '-', "
                         "starting with a letter or digit; no separators, no '..')")
    if fmt == "safetensors":
        if manifest.get("revision") is not None:
            check_revision(manifest.get("revision"))
        if not isinstance(manifest.get("files"), list):
            raise StageError("manifest files is not a list")
        return parse_files(manifest["files"])
    count = manifest.get("split_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise StageError(f"manifest split_count {count!r} is not a positive integer")
    entries = manifest.get("shards")
    if not isinstance(entries, list):
        raise StageError("manifest shards is not a list")
    shards = parse_shards(entries)
    first = SHARD_RE.match(shards[0].name)
    if first["model"] != model:
        raise StageError(f"manifest shards are of model {first['model']!r}, the manifest says {model!r}")
    if int(first["count"]) != count or len(shards) != count:
        raise StageError(f"manifest lists {len(shards)} shards of {int(first['count'])}, split_count says {count}: "
                         "the shard list is incomplete or inconsistent")
    return shards


@dataclass
class SpotCheck:
    """What the spot check read on this run (its cost) and what it found."""
    shards: int = 0
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    unchecked: list[str] = field(default_factory=list)   # stamped shards without chunk hashes
    corrupt: list[dict] = field(default_factory=list)     # {shard, chunk, of}: a chunk that does not match

    def summary(self, fate: str = "fetched again") -> str:
        """One line for people: what was read, what matched, which chunk did not and what happens to its shard."""
        good = self.chunks - len(self.corrupt)
        text = (f"spot check: {self.chunks} chunks ({self.bytes / 2**20:.0f} MiB) of {self.shards} stamped "
                f"shards read in {self.seconds:.2f} s: {good} verified")
        if self.corrupt:
            text += f", {len(self.corrupt)} corrupt: " + "; ".join(
                f"{c['shard']} chunk {c['chunk']} (of {c['of']}), {fate}" for c in self.corrupt)
        if self.unchecked:
            text += (f"; {len(self.unchecked)} shards have no chunk sha256 in the manifest or their stamp "
                     "(not spot-checked)")
        return text


def spot_check(path: str, shard: Shard, count: int, report: SpotCheck, rng: random.Random,
               stamp: dict | None = None) -> bool:
    """Read `count` random chunks of a stamped shard (all when it has fewer) against the manifest,
    or, where the manifest has no chunk sha256, against those its first staging kept in its stamp."""
    if count <= 0:
        return True
    if not shard.chunks:
        shard = with_stamp_chunks(shard, stamp)
    if not shard.chunks:
        report.unchecked.append(shard.name)
        return True
    picks = sorted(rng.sample(range(len(shard.chunks)), min(count, len(shard.chunks))))
    started = time.monotonic()
    report.shards += 1
    ok = True
    with open(path, "rb") as handle:
        for index in picks:
            handle.seek(index * shard.chunk_size)
            digest = hashlib.sha256()
            left = min(shard.chunk_size, shard.size - index * shard.chunk_size)
            while left > 0 and (piece := handle.read(min(CHUNK, left))):
                digest.update(piece)
                left -= len(piece)
                report.bytes += len(piece)
            report.chunks += 1
            if digest.hexdigest() != shard.chunks[index]:
                report.corrupt.append({"shard": shard.name, "chunk": index, "of": len(shard.chunks)})
                ok = False
                break
    report.seconds += time.monotonic() - started
    return ok


# --- stamps: what makes a re-run cost a stat -------------------------------------------------

def stamp_path(dest: str, name: str) -> str:
    return os.path.join(dest, STAMP_DIR, name + ".json")


def read_stamp(dest: str, name: str) -> dict | None:
    try:
        with open(stamp_path(dest, name), encoding="utf-8") as handle:
            stamp = json.load(handle)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def stamp_matches(dest: str, shard: Shard) -> bool:
    """True when the shard's file is exactly what was verified (same size, mtime_ns, sha256)."""
    stamp = read_stamp(dest, shard.name)
    try:
        st = os.stat(os.path.join(dest, shard.name))
    except FileNotFoundError:
        return False
    return (stamp is not None and stamp.get("sha256") == shard.sha256 and stamp.get("size") == st.st_size
            == shard.size and stamp.get("mtime_ns") == st.st_mtime_ns)


def with_stamp_chunks(shard: Shard, stamp: dict | None) -> Shard:
    """The shard with the chunk sha256 its stamp holds (kept when it was staged), if they fit its size."""
    if not stamp or not isinstance(stamp.get("chunks"), list):
        return shard
    try:
        chunk_size, chunks = parse_chunks(shard.name, shard.size, stamp.get("chunk_size"), stamp["chunks"])
    except StageError:
        return shard
    return Shard(shard.name, shard.size, shard.sha256, chunk_size, chunks)


def fill_chunk_size(shard: Shard) -> int:
    """The chunk size to hash a file in on its way in: 0 when the manifest has its chunks already."""
    return 0 if shard.chunks else MANIFEST_CHUNK


def write_stamp(dest: str, shard: Shard, source: str, chunks: list[str] | tuple[str, ...] = ()) -> None:
    """Stamp a verified file; `chunks` (the sha256 of every MANIFEST_CHUNK bytes of those verified
    bytes) are kept for the spot check where the manifest has none."""
    st = os.stat(os.path.join(dest, shard.name))
    stamp = {"name": shard.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": shard.sha256,
             "source": source}
    if chunks and not shard.chunks:
        stamp.update(chunk_size=MANIFEST_CHUNK, chunks=list(chunks))
    path = stamp_path(dest, shard.name)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(stamp, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# --- sources ---------------------------------------------------------------------------------

class Source(Protocol):
    label: str

    def fetch(self, shard: Shard, partial: str) -> StreamHash | None:
        """Make `partial` hold the shard's `size` bytes, resuming from its current length.

        Returns the hash of the bytes (with chunks of fill_chunk_size(shard)) when it was computed
        on the way in, else None.
        """


def redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "********")
    return text


class _SameOriginAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never carry the Authorization header to another host (hub CDNs)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            for key in [k for k in new.headers if k.lower() == "authorization"]:
                del new.headers[key]
            new.unredirected_hdrs.pop("Authorization", None)
        return new


class StreamHash:
    """The sha256 of bytes as they arrive and, with chunk_size, of every chunk_size bytes."""

    def __init__(self, chunk_size: int = 0) -> None:
        self.whole = hashlib.sha256()
        self.chunk_size = chunk_size
        self.part = hashlib.sha256()
        self.in_part = 0
        self.chunks: list[str] = []

    def update(self, data: bytes) -> None:
        self.whole.update(data)
        if not self.chunk_size:
            return
        view = memoryview(data)
        while len(view):
            take = min(len(view), self.chunk_size - self.in_part)
            self.part.update(view[:take])
            self.in_part += take
            view = view[take:]
            if self.in_part == self.chunk_size:
                self.chunks.append(self.part.hexdigest())
                self.part, self.in_part = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        return self.whole.hexdigest()

    def chunk_digests(self) -> list[str]:
        """The chunks' sha256, the last one short (one chunk, the sha256 of nothing, for 0 bytes)."""
        if not self.chunk_size:
            return []
        return self.chunks + ([self.part.hexdigest()] if self.in_part or not self.chunks else [])


def hash_prefix(path: str, length: int, chunk_size: int = 0) -> StreamHash:
    """A StreamHash fed with the first `length` bytes of `path` (what a resumed download keeps)."""
    digest = StreamHash(chunk_size)
    if length:
        with open(path, "rb") as handle:
            while length and (chunk := handle.read(min(CHUNK, length))):
                digest.update(chunk)
                length -= len(chunk)
    return digest


def _truncate(path: str, size: int) -> None:
    with open(path, "ab") as handle:
        handle.truncate(size)


@dataclass
class HttpSource:
    """An HTTP(S) mirror serving `<base_url>/<shard name>`; a broken download resumes with Range."""

    base_url: str
    timeout: float = 60.0
    headers: dict[str, str] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if urllib.parse.urlsplit(self.base_url).scheme not in ("http", "https"):
            raise StageError(f"http source URL {self.base_url!r} is not http:// or https://")
        self.label = self.label or f"http:{self.base_url}"

    def url(self, name: str) -> str:
        return self.base_url.rstrip("/") + "/" + urllib.parse.quote(name)

    def request(self, name: str, offset: int) -> urllib.request.Request:
        headers = dict(self.headers)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        return urllib.request.Request(self.url(name), headers=headers)

    def fetch(self, shard: Shard, partial: str) -> StreamHash | None:
        have = os.path.getsize(partial) if os.path.exists(partial) else 0
        if have > shard.size:
            _truncate(partial, 0)
            have = 0
        if have == shard.size:
            return None
        opener = urllib.request.build_opener(_SameOriginAuthRedirect())
        request = self.request(shard.name, have)
        try:
            response = opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            hint = ": the shard is missing at the source" if err.code == 404 else ""
            raise StageError(f"{self.url(shard.name)}: HTTP {err.code} {err.reason}{hint}") from None
        except (urllib.error.URLError, OSError) as err:
            raise StageError(f"{self.url(shard.name)}: {getattr(err, 'reason', err)}") from None
        with response:
            if have and response.status == 206:
                content_range = response.headers.get("Content-Range", "")
                if not content_range.startswith(f"bytes {have}-"):
                    raise StageError(f"{self.url(shard.name)}: asked for bytes {have}-, got Content-Range "
                                     f"{content_range!r}")
            elif response.status == 200:
                have = 0  # the server ignored the range: start over
            else:
                raise StageError(f"{self.url(shard.name)}: unexpected HTTP {response.status}")
            digest = hash_prefix(partial, have, fill_chunk_size(shard))  # on the way in: no second read
            with open(partial, "r+b" if os.path.exists(partial) else "wb") as out:
                out.truncate(have)
                out.seek(have)
                while chunk := response.read1(CHUNK):  # what has arrived: a kill loses little
                    have += len(chunk)
                    if have > shard.size:
                        raise StageError(f"{self.url(shard.name)}: more than the manifest's {shard.size} bytes")
                    out.write(chunk)
                    digest.update(chunk)
        if have != shard.size:
            raise StageError(f"{self.url(shard.name)}: connection ended at byte {have} of {shard.size}")
        return digest


def hub_source(endpoint: str, repo: str, revision: str, token: str, timeout: float = 60.0) -> HttpSource:
    """A model hub laid out as `<endpoint>/<repo>/resolve/<revision>/<file>`, with a bearer token."""
    if not re.match(r"^[\w.-]+/[\w.-]+$", repo or ""):
        raise StageError(f"hub repo {repo!r} is not of the form <owner>/<name>")
    check_revision(revision, "hub revision")
    base = f"{endpoint.rstrip('/')}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return HttpSource(base, timeout=timeout, headers=headers, label=f"hub:{repo}@{revision}")


@dataclass
class PathSource:
    """A directory on this machine or on a shared filesystem holding the shards."""

    root: str
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or f"path:{self.root}"

    def fetch(self, shard: Shard, partial: str) -> StreamHash | None:
        src = os.path.join(self.root, shard.name)
        try:
            size = os.path.getsize(src)
        except OSError:
            raise StageError(f"{src}: the shard is missing at the source") from None
        if size != shard.size:
            raise StageError(f"{src}: {size} bytes, the manifest says {shard.size}")
        have = os.path.getsize(partial) if os.path.exists(partial) else 0
        if have > size:
            have = 0
        digest = hash_prefix(partial, have, fill_chunk_size(shard))
        with open(src, "rb") as inp, open(partial, "r+b" if os.path.exists(partial) else "wb") as out:
            out.truncate(have)
            inp.seek(have)
            out.seek(have)
            while chunk := inp.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
        return digest


@dataclass
class PeerSource:
    """A host that already holds verified shards, read with rsync over SSH.

    `path` is the shard directory on the peer; it is empty when the peer's key restricts the
    login to that directory (rrsync), where names are relative to it.
    """

    host: str
    path: str = ""
    user: str = "root"
    port: int = 22
    ssh_key: str = ""
    known_hosts: str = ""
    rsh: str = ""
    timeout: int = 60
    label: str = ""

    def __post_init__(self) -> None:
        if not self.host:
            raise StageError("peer source has no host")
        self.label = self.label or f"peer:{self.host}"

    def remote_shell(self) -> str:
        if self.rsh:
            return self.rsh
        args = ["ssh", "-p", str(self.port), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.timeout}"]
        if self.ssh_key:
            args += ["-i", self.ssh_key, "-o", "IdentitiesOnly=yes"]
        if self.known_hosts:
            args += ["-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes"]
        return shlex.join(args)

    def command(self, shard: Shard, partial: str) -> list[str]:
        remote = f"{self.path.rstrip('/')}/{shard.name}" if self.path else shard.name
        return ["rsync", "--append", f"--timeout={self.timeout}", "-e", self.remote_shell(),
                f"{self.user}@{self.host}:{remote}", partial]

    def fetch(self, shard: Shard, partial: str) -> StreamHash | None:
        if os.path.exists(partial) and os.path.getsize(partial) > shard.size:
            _truncate(partial, 0)
        try:
            done = subprocess.run(self.command(shard, partial), capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise StageError("rsync is not installed on this host (needed for peer sources)") from None
        if done.returncode != 0:
            raise StageError(f"rsync from {self.host} failed ({done.returncode}): "
                             f"{done.stderr.strip()[-400:]}")
        return None  # rsync wrote the bytes: the caller hashes the file


def make_source(spec: dict, timeout: float = 60.0) -> Source:
    """Build a source from its dict form (the module's `sources` entries, the CLI's options)."""
    kind = spec.get("type")
    if kind == "http":
        return HttpSource(spec.get("url") or "", timeout=timeout)
    if kind == "hub":
        return hub_source(spec.get("endpoint") or "https://huggingface.co", spec.get("repo") or "",
                          spec.get("revision") or "", spec.get("token") or "", timeout)
    if kind == "path":
        if not spec.get("path"):
            raise StageError("path source has no path")
        return PathSource(spec["path"])
    if kind == "peer":
        return PeerSource(spec.get("host") or "", path=spec.get("path") or "", user=spec.get("user") or "root",
                          port=int(spec.get("port") or 22), ssh_key=spec.get("ssh_key") or "",
                          known_hosts=spec.get("known_hosts") or "", rsh=spec.get("rsh") or "",
                          timeout=int(timeout))
    raise StageError(f"unknown source type {kind!r} (expected http, hub, path or peer)")


# --- staging ---------------------------------------------------------------------------------

@dataclass
class Plan:
    ready: list[Shard] = field(default_factory=list)        # stamped, nothing to do
    restamp: list[Shard] = field(default_factory=list)      # intact on disk, stamp missing or stale
    restamp_chunks: dict[str, list[str]] = field(default_factory=dict)  # their chunks, where the manifest has none
    fetch: list[Shard] = field(default_factory=list)        # missing or corrupt: bytes must come
    corrupt: list[str] = field(default_factory=list)        # on disk but wrong: will be replaced
    remaining_bytes: int = 0
    spot: SpotCheck = field(default_factory=SpotCheck)
    spot_failed: list[str] = field(default_factory=list)    # stamped, but a picked chunk is wrong


def make_plan(dest: str, shards: list[Shard], verify: str = "stamp", spot_chunks: int = 0,
              rng: random.Random | None = None) -> Plan:
    """Decide per shard: ready (a stat and the spot check), restamp (hash matched), or fetch
    (counting bytes to come). A stamped shard whose spot-checked chunk is wrong is corrupt."""
    plan = Plan()
    rng = rng or random.SystemRandom()
    for shard in shards:
        final = os.path.join(dest, shard.name)
        if os.path.exists(final):
            stamped = stamp_matches(dest, shard)
            if stamped and verify == "stamp":
                if spot_check(final, shard, spot_chunks, plan.spot, rng, read_stamp(dest, shard.name)):
                    plan.ready.append(shard)
                    continue
                plan.spot_failed.append(shard.name)
                plan.corrupt.append(shard.name)
                partial = final + ".partial"
                have = os.path.getsize(partial) if os.path.exists(partial) else 0
                plan.fetch.append(shard)
                plan.remaining_bytes += shard.size - have if have <= shard.size else shard.size
                continue
            if os.path.getsize(final) == shard.size:
                if shard.chunks:
                    digest, chunks = sha256_file(final), []
                else:  # one read gives the chunk sha256 the stamp keeps for the spot check
                    digest, chunks = hash_file(final, MANIFEST_CHUNK)
                if digest == shard.sha256:
                    if stamped and (shard.chunks or with_stamp_chunks(shard, read_stamp(dest, shard.name)).chunks):
                        plan.ready.append(shard)
                    else:
                        plan.restamp.append(shard)
                        plan.restamp_chunks[shard.name] = chunks
                    continue
            plan.corrupt.append(shard.name)
        partial = final + ".partial"
        have = os.path.getsize(partial) if os.path.exists(partial) else 0
        plan.fetch.append(shard)
        plan.remaining_bytes += shard.size - have if have <= shard.size else shard.size
    return plan


def free_bytes(path: str) -> int:
    """Bytes available to unprivileged writers on the filesystem that holds (or will hold) `path`."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def check_free_space(dest: str, needed: int, reserve: int) -> None:
    available = free_bytes(dest)
    if needed and needed + reserve > available:
        raise StageError(f"not enough free space for {dest}: {needed} bytes still to fetch plus a reserve of "
                         f"{reserve}, only {available} available; nothing was written")


@contextlib.contextmanager
def locked(dest: str) -> Iterator[None]:
    """One stager per directory at a time (the role and a hand-run `mlafleet weights stage`)."""
    os.makedirs(os.path.join(dest, STAMP_DIR), exist_ok=True)
    with open(os.path.join(dest, STAMP_DIR, ".lock"), "w", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StageError(f"{dest} is being staged by another process") from None
        yield


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fetch_shard(dest: str, shard: Shard, sources: list[Source], retries: int, log: Log) -> tuple[str, int]:
    """Fetch one shard into .partial, verify it, rename it atomically and stamp it.

    Returns the label of the source that delivered it and how many corrupt downloads were thrown away.
    """
    final = os.path.join(dest, shard.name)
    partial = final + ".partial"
    errors: list[str] = []
    corrupt = 0
    for source in sources:
        for attempt in range(retries + 1):
            try:
                streamed = source.fetch(shard, partial)
            except StageError as err:
                errors.append(f"{source.label} (attempt {attempt + 1}): {err}")
                log(f"{shard.name}: {err}")
                continue
            size = os.path.getsize(partial)
            digest, chunks = "", []
            if size == shard.size and streamed is not None:
                digest, chunks = streamed.hexdigest(), streamed.chunk_digests()
            elif size == shard.size:  # rsync wrote the bytes: one read
                digest, chunks = hash_file(partial, fill_chunk_size(shard))
            if digest != shard.sha256:
                corrupt += 1
                errors.append(f"{source.label} (attempt {attempt + 1}): got {size} bytes with sha256 "
                              f"{digest or '-'}, the manifest says {shard.size} bytes, {shard.sha256}")
                log(f"{shard.name}: corrupt download from {source.label}, fetching again")
                os.unlink(partial)
                continue
            with open(partial, "rb+") as handle:
                os.fsync(handle.fileno())
            os.chmod(partial, 0o644)
            os.replace(partial, final)
            _fsync_dir(dest)
            write_stamp(dest, shard, source.label, chunks)
            log(f"{shard.name}: verified from {source.label}")
            return source.label, corrupt
    raise StageError(f"{shard.name}: no source delivered a verified copy: " + "; ".join(errors[-6:]))


def count_present(dest: str, shards: list[Shard]) -> int:
    return sum(1 for shard in shards if stamp_matches(dest, shard))


def _spot_result(plan: Plan, log: Log, fate: str = "fetched again") -> dict:
    summary = plan.spot.summary(fate)
    if plan.spot.shards or plan.spot.unchecked:
        log(summary)
    for bad in plan.spot.corrupt:
        log(f"{bad['shard']}: spot-checked chunk {bad['chunk']} does not match the manifest although its stamp "
            f"does: corrupt, {fate}")
    return {"spot_check": {"shards": plan.spot.shards, "chunks": plan.spot.chunks, "bytes": plan.spot.bytes,
                           "seconds": round(plan.spot.seconds, 3), "unchecked": plan.spot.unchecked,
                           "failed": plan.spot_failed,
                           "corrupt": [{"shard": c["shard"], "chunk": c["chunk"]} for c in plan.spot.corrupt],
                           "summary": summary}}


def stage(dest: str, shards: list[Shard], sources: list[Source], *, verify: str = "stamp", retries: int = 2,
          reserve: int = 0, check_mode: bool = False, log: Log = lambda _msg: None, spot_chunks: int = 0,
          rng: random.Random | None = None) -> dict:
    """Bring `dest` to: every shard present, verified and stamped. Returns what was done."""
    if verify not in ("stamp", "full"):
        raise StageError(f"verify must be 'stamp' or 'full', not {verify!r}")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise StageError(f"{dest} exists and is not a directory")
    plan = (make_plan(dest, shards, verify, spot_chunks, rng) if os.path.isdir(dest)
            else make_plan_empty(shards))
    if plan.fetch and not sources:
        raise StageError(f"{len(plan.fetch)} of {len(shards)} shards are missing or corrupt in {dest} "
                         f"and no source is given: {[s.name for s in plan.fetch][:8]}")
    check_free_space(dest, plan.remaining_bytes, reserve)
    result = {"changed": bool(plan.fetch or plan.restamp), "fetched": [s.name for s in plan.fetch],
              "restamped": [s.name for s in plan.restamp], "corrupt": list(plan.corrupt),
              "ready": [s.name for s in plan.ready], "bytes_to_fetch": plan.remaining_bytes,
              "sources_used": {}, "expected": len(shards),
              **_spot_result(plan, log, "to be fetched again" if check_mode else "fetched again")}
    if check_mode:
        result["present"] = len(plan.ready) + len(plan.restamp)
        return result
    os.makedirs(dest, exist_ok=True)
    with locked(dest):
        for shard in plan.restamp:
            write_stamp(dest, shard, (read_stamp(dest, shard.name) or {}).get("source", "on disk"),
                        plan.restamp_chunks.get(shard.name, ()))
        for name in plan.corrupt:
            os.unlink(os.path.join(dest, name))
        discarded = 0
        for shard in plan.fetch:
            label, corrupt = fetch_shard(dest, shard, sources, retries, log)
            result["sources_used"][shard.name] = label
            discarded += corrupt
        result["corrupt_downloads"] = discarded
        result["present"] = count_present(dest, shards)
    if result["present"] != len(shards):
        raise StageError(f"only {result['present']} of {len(shards)} shards are present and verified in {dest}")
    return result


def make_plan_empty(shards: list[Shard]) -> Plan:
    return Plan(fetch=list(shards), remaining_bytes=sum(s.size for s in shards))


def prove_present(dest: str, shards: list[Shard], verify: str = "stamp", spot_chunks: int = 0,
                  rng: random.Random | None = None) -> dict:
    """All N of N present and verified, or a StageError naming the ones that are not."""
    plan = (make_plan(dest, shards, verify, spot_chunks, rng) if os.path.isdir(dest)
            else make_plan_empty(shards))
    if plan.fetch:
        failed = (" (spot check failed: " + ", ".join(f"{c['shard']} chunk {c['chunk']} does not match the manifest"
                                                    for c in plan.spot.corrupt[:8]) + ")") if plan.spot.corrupt else ""
        raise StageError(f"{len(plan.fetch)} of {len(shards)} shards are missing or corrupt in {dest}: "
                         f"{[s.name for s in plan.fetch][:8]}{failed}")
    return {"changed": False, "present": len(shards), "expected": len(shards),
            "unstamped": [s.name for s in plan.restamp], **_spot_result(plan, lambda _m: None)}
