"""sha256 of a file, the one implementation the collection's modules share.

weights_stage (shards, and the per-chunk sha256 of its spot check) and mlafleet_vllm_patch
(vLLM's files against the patch set's manifest) hash files with it on the hosts; on the
controller the mlafleet package imports it by the same name (`mlafleet weights manifest`, the
patch set builder, the wheelhouse). Standard library only: hosts carry nothing but their
distribution's python3.
"""

from __future__ import annotations

import hashlib
from typing import Callable

# Read size: 8 MiB pieces into one reused buffer (hashlib releases the GIL: threads hash in parallel).
PIECE = 8 << 20


def hash_file(path: str, chunk_size: int = 0, advance: Callable[[int], None] = lambda _n: None
              ) -> tuple[str, list[str]]:
    """One pass over a file: its sha256 and, with chunk_size, the sha256 of every chunk_size bytes.

    `advance` is told every piece's length (progress bars). A file of 0 bytes with chunk_size has
    one chunk, the sha256 of nothing.
    """
    digest = hashlib.sha256()
    chunks: list[str] = []
    part = hashlib.sha256()
    in_part = 0
    step = min(PIECE, chunk_size) if chunk_size else PIECE
    buffer = bytearray(step)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(view[: min(step, chunk_size - in_part)] if chunk_size else view)
            if not count:
                break
            digest.update(view[:count])
            advance(count)
            if chunk_size:
                part.update(view[:count])
                in_part += count
                if in_part == chunk_size:
                    chunks.append(part.hexdigest())
                    part, in_part = hashlib.sha256(), 0
    if chunk_size and (in_part or not chunks):
        chunks.append(part.hexdigest())
    return digest.hexdigest(), chunks


def sha256_file(path: str) -> str:
    """The sha256 of a file's bytes, as 64 lowercase hex digits."""
    return hash_file(path)[0]


def sha256_bytes(data: bytes) -> str:
    """The sha256 of bytes in memory, as 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()
