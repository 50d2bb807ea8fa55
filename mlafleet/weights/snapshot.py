"""Manifests of safetensors snapshots: from a local directory, or from a model hub without downloading.

- From a directory (a download, a hub cache's snapshots/<commit>/, a shared filesystem): the
  snapshot's top-level files are checked before serving would check them (index, headers, FP8
  block scales: module_utils safetensors_check) and hashed in parallel with per-chunk sha256.
- From a hub (`--hub OWNER/NAME`, through `huggingface_hub`: revision, token, endpoint or
  HF_ENDPOINT for an internal mirror): the revision is resolved to its commit once, here, and
  pinned in the manifest; each LFS file's size and sha256 come from the hub's file metadata
  (model_info with files_metadata) without downloading it; the small non-LFS files (config,
  tokenizer, index), for which the hub gives only a git blob id, are downloaded and hashed. The
  LFS files' entries carry no chunk sha256: each host computes them on first staging from the
  bytes whose sha256 matched and keeps them in its stamp (module_utils weights_stage).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import IO

from ansible_collections.mlafleet.fleet.plugins.module_utils import safetensors_check, weights_stage
from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import hash_file

FORMAT = weights_stage.SAFETENSORS_FORMAT
CHUNKS_NOTE = ("files without chunk_size/chunks: the hub gave their sha256 only; each host computes their "
               "chunk sha256 on first staging, from the verified bytes, and keeps them in its stamp")


class SnapshotError(Exception):
    """A snapshot that cannot get a manifest, with a message naming the problem."""


def is_snapshot(directory: Path) -> bool:
    """A directory that looks like a safetensors snapshot (config.json and .safetensors files)."""
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def snapshot_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The files a manifest lists (top-level, plain names) and what it leaves out (hidden, folders)."""
    if not directory.is_dir():
        raise SnapshotError(f"{directory} is not a directory")
    files, left = [], []
    for path in sorted(directory.iterdir()):
        if path.is_file() and weights_stage.FILE_RE.match(path.name) and not path.name.endswith(".partial"):
            files.append(path)
        elif not path.name.startswith("."):
            left.append(path.name + ("/" if path.is_dir() else ""))
    return files, left


def _model_and_revision(directory: Path) -> tuple[str, str | None]:
    """A hub cache's layout (models--OWNER--NAME/snapshots/<commit>) names the model and its commit."""
    resolved = directory.resolve()
    if re.fullmatch(r"[0-9a-f]{40}", resolved.name) and resolved.parent.name == "snapshots":
        repo_dir = resolved.parent.parent.name
        return repo_dir.split("--")[-1], resolved.name
    return resolved.name, None


def build_from_directory(directory: Path, model: str | None = None, revision: str | None = None,
                         repo: str | None = None, jobs: int = 4, progress_stream: IO[str] | None = None,
                         chunk_size: int | None = None) -> dict:
    """The manifest of the snapshot in `directory`, checked (index, headers, FP8 scales) and hashed."""
    from mlafleet.weights.shards import Progress, hash_files

    chunk_size = weights_stage.MANIFEST_CHUNK if chunk_size is None else chunk_size
    files, left = snapshot_files(directory)
    found_model, found_revision = _model_and_revision(directory)
    revision = revision or found_revision
    try:
        if revision is not None:
            weights_stage.check_revision(revision, "--revision")
        checked = safetensors_check.check_snapshot(str(directory), [p.name for p in files])
    except (weights_stage.StageError, safetensors_check.CheckError) as err:
        raise SnapshotError(f"{directory}: {err}") from None
    sizes = {p: p.stat().st_size for p in files}
    progress = Progress(sum(sizes.values()), "hashing", progress_stream) if progress_stream else None
    digests = hash_files(files, jobs, progress, chunk_size)
    if progress:
        progress.finish()
    entries = [{"name": p.name, "size": sizes[p], "sha256": digests[p][0], "chunk_size": chunk_size,
                "chunks": digests[p][1]} for p in files]
    return _manifest(model or found_model, repo, revision, entries, checked, left)


def _manifest(model: str, repo: str | None, revision: str | None, entries: list[dict], checked: dict | None,
              left: list[str]) -> dict:
    manifest = {
        "format": FORMAT,
        "model": model,
        "repo": repo,
        "revision": revision,
        "file_count": len(entries),
        "safetensors_count": sum(1 for e in entries if e["name"].endswith(".safetensors")),
        "total_size": sum(e["size"] for e in entries),
        "files": entries,
    }
    if checked:
        manifest.update(tensor_count=checked["tensors"], fp8_weights=checked["fp8_weights"],
                        weight_block_size=checked["weight_block_size"])
    if any("chunks" not in e for e in entries):
        manifest["chunk_sha256"] = CHUNKS_NOTE
    if left:
        manifest["not_staged"] = left
    try:  # what the role and the host module will check
        weights_stage.check_manifest(manifest)
    except weights_stage.StageError as err:
        raise SnapshotError(str(err)) from None
    return manifest


def build_from_hub(repo: str, revision: str = "main", endpoint: str | None = None, token: str | None = None,
                   model: str | None = None, chunk_size: int | None = None) -> dict:
    """The manifest of a hub repository at `revision` (resolved to its commit and pinned), without
    downloading its LFS files: their sha256 and size are the hub's file metadata."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    chunk_size = weights_stage.MANIFEST_CHUNK if chunk_size is None else chunk_size
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        info = HfApi(endpoint=endpoint, token=token or False).model_info(repo, revision=revision,
                                                                         files_metadata=True)
    except HfHubHTTPError as err:
        raise SnapshotError(f"{endpoint} {repo}@{revision}: {str(err).splitlines()[0]}") from None
    commit = info.sha or ""
    try:
        weights_stage.check_revision(commit, f"the hub's commit for {repo}@{revision}")
    except weights_stage.StageError as err:
        raise SnapshotError(str(err)) from None
    entries: list[dict] = []
    left: list[str] = []
    small: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="mlafleet-hub-") as tmp:
        for sibling in sorted(info.siblings or [], key=lambda s: s.rfilename):
            name = sibling.rfilename
            if "/" in name or not weights_stage.FILE_RE.match(name) or name.endswith(".partial"):
                if not name.startswith("."):
                    left.append(name)
                continue
            if sibling.lfs is not None:
                entries.append({"name": name, "size": sibling.lfs.size, "sha256": sibling.lfs.sha256})
                continue
            try:
                local = Path(hf_hub_download(repo, name, revision=commit, endpoint=endpoint, token=token or False,
                                             cache_dir=tmp))
            except HfHubHTTPError as err:
                raise SnapshotError(f"{endpoint} {repo}@{commit} {name}: {str(err).splitlines()[0]}") from None
            digest, chunks = hash_file(str(local), chunk_size)
            if sibling.size is not None and local.stat().st_size != sibling.size:
                raise SnapshotError(f"{name}: the hub lists {sibling.size} bytes, the download has {local.stat().st_size}")
            entries.append({"name": name, "size": local.stat().st_size, "sha256": digest, "chunk_size": chunk_size,
                            "chunks": chunks})
            small[name] = local
        names = [e["name"] for e in entries]
        try:
            if safetensors_check.INDEX in small:
                safetensors_check.check_index(json.loads(small[safetensors_check.INDEX].read_text(encoding="utf-8")),
                                              names)
        except (safetensors_check.CheckError, ValueError) as err:
            raise SnapshotError(f"{repo}@{commit}: {err}") from None
    return _manifest(model or repo.split("/")[-1], repo, commit, entries, None, left)
