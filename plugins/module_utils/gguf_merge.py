"""Merging a model's verified GGUF shards into one GGUF file, streamed.

For vLLM versions that load a single GGUF file only. The merged file carries the first shard's
metadata without the split.* keys, every shard's tensor infos with offsets rebased onto one data
section, and the shards' data sections copied in order, chunk by chunk (never a whole file in
memory). Like weights_stage it runs on hosts (shipped with the module `mlafleet.fleet.gguf_weights_merge`)
and on the controller (`mlafleet weights merge`): standard library only.

GGUF layout used here (little-endian, version 2 or 3): magic "GGUF", u32 version, u64 tensor
count, u64 metadata count, the metadata key/values, the tensor infos (name, u32 n_dims, u64 dims,
u32 ggml type, u64 offset relative to the data section), zero padding to the alignment
(general.alignment, default 32), then the data section.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"GGUF"
CHUNK = 8 << 20
DEFAULT_ALIGNMENT = 32
STAMP_DIR = ".mlafleet-stamps"
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# GGUF metadata value types: id -> struct format of a scalar (8 = string, 9 = array).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING = 8
ARRAY = 9


class MergeError(Exception):
    """A merge problem, named."""


@dataclass
class TensorInfo:
    name: bytes
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class Header:
    path: str
    version: int
    metadata: list[tuple[str, bytes, object]]  # key, raw encoded key/value, scalar value or None
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    file_size: int


class _Reader:
    def __init__(self, handle: BinaryIO, path: str) -> None:
        self.handle, self.path = handle, path

    def read(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise MergeError(f"{self.path}: truncated GGUF header")
        return data

    def unpack(self, fmt: str) -> object:
        return struct.unpack("<" + fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        length = self.unpack("Q")
        if length > 1 << 30:
            raise MergeError(f"{self.path}: implausible string length {length} in the GGUF header")
        return self.read(length)

    def value(self, vtype: int) -> object:
        """Read one metadata value; returns scalars and strings, None for arrays (kept raw)."""
        if vtype in SCALARS:
            return self.unpack(SCALARS[vtype])
        if vtype == STRING:
            return self.string().decode("utf-8", "replace")
        if vtype == ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in SCALARS:
                self.read(struct.calcsize("<" + SCALARS[item_type]) * count)
            else:
                for dummy in range(count):
                    self.value(item_type)
            return None
        raise MergeError(f"{self.path}: unknown GGUF metadata type {vtype}")


def read_header(path: str) -> Header:
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        reader = _Reader(handle, path)
        if reader.read(4) != MAGIC:
            raise MergeError(f"{path}: not a GGUF file")
        version = reader.unpack("I")
        if version not in (2, 3):
            raise MergeError(f"{path}: GGUF version {version} is not supported (little-endian 2 or 3)")
        n_tensors, n_kv = reader.unpack("Q"), reader.unpack("Q")
        metadata = []
        for dummy in range(n_kv):
            start = handle.tell()
            key = reader.string().decode("utf-8")
            value = reader.value(reader.unpack("I"))
            end = handle.tell()
            handle.seek(start)
            metadata.append((key, handle.read(end - start), value))
        tensors = []
        for dummy in range(n_tensors):
            name = reader.string()
            n_dims = reader.unpack("I")
            dims = tuple(reader.unpack("Q") for dummy in range(n_dims))
            tensors.append(TensorInfo(name, dims, reader.unpack("I"), reader.unpack("Q")))
        alignment = next((v for k, dummy, v in metadata if k == "general.alignment"), DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise MergeError(f"{path}: general.alignment {alignment!r} is not a power of two")
        data_start = _align(handle.tell(), alignment)
    if data_start > size:
        raise MergeError(f"{path}: file ends inside its header")
    return Header(path, version, metadata, tensors, alignment, data_start, size)


def _align(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


def _encode_string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def merged_header(headers: list[Header]) -> tuple[bytes, list[int]]:
    """The merged file's header (padded) and the data-section base offset of each shard."""
    first = headers[0]
    alignment = first.alignment
    for header in headers[1:]:
        if header.alignment != alignment:
            raise MergeError(f"{header.path}: alignment {header.alignment} differs from the first shard's {alignment}")
    bases, base = [], 0
    for header in headers:
        bases.append(base)
        base = _align(base + header.file_size - header.data_start, alignment)
    metadata = [raw for key, raw, dummy in first.metadata if key not in SPLIT_KEYS]
    infos = bytearray()
    names: set[bytes] = set()
    count = 0
    for header, base in zip(headers, bases):
        for tensor in header.tensors:
            if tensor.name in names:
                raise MergeError(f"{header.path}: tensor {tensor.name.decode()!r} appears in two shards")
            names.add(tensor.name)
            infos += _encode_string(tensor.name) + struct.pack("<I", len(tensor.dims))
            infos += struct.pack(f"<{len(tensor.dims)}Q", *tensor.dims)
            infos += struct.pack("<IQ", tensor.ggml_type, base + tensor.offset)
            count += 1
    head = MAGIC + struct.pack("<IQQ", 3, count, len(metadata)) + b"".join(metadata) + bytes(infos)
    return head + bytes(-len(head) % alignment), bases


def _stamp_path(output: str) -> str:
    return os.path.join(os.path.dirname(output), STAMP_DIR, os.path.basename(output) + ".json")


def _inputs(dest: str, shards: list[str]) -> list[dict]:
    return [{"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            for name in shards for st in [os.stat(os.path.join(dest, name))]]


def is_current(dest: str, shards: list[str], output: str) -> bool:
    """The output exists as stamped, and was merged from the shards as they are now."""
    try:
        with open(_stamp_path(output), encoding="utf-8") as handle:
            stamp = json.load(handle)
        st = os.stat(output)
    except (OSError, ValueError):
        return False
    return (stamp.get("size") == st.st_size and stamp.get("mtime_ns") == st.st_mtime_ns
            and stamp.get("inputs") == _inputs(dest, shards))


def merge(dest: str, shards: list[str], output: str, check_mode: bool = False) -> dict:
    """Stream `shards` (in order, in `dest`) into `output`, via `output.partial` and a rename."""
    if not shards:
        raise MergeError("no shards to merge")
    if SHARD_RE.search(os.path.basename(output)):
        raise MergeError(f"{output}: a merged file must not be named like a shard (vLLM would look for siblings)")
    paths = [os.path.join(dest, name) for name in shards]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing and check_mode:
        return {"changed": True, "output": output, "missing": missing}  # staging would bring them
    if missing:
        raise MergeError(f"cannot merge: missing shards {missing[:8]}")
    headers = [read_header(p) for p in paths]
    head, bases = merged_header(headers)
    total = len(head) + bases[-1] + headers[-1].file_size - headers[-1].data_start
    result = {"changed": False, "output": output, "size": total,
              "tensors": sum(len(h.tensors) for h in headers)}
    if is_current(dest, shards, output):
        return result
    result["changed"] = True
    if check_mode:
        return result
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    st = os.statvfs(out_dir)
    if total > st.f_bavail * st.f_frsize:
        raise MergeError(f"not enough free space in {out_dir} for the merged {total} bytes; nothing was written")
    digest = hashlib.sha256()
    partial = output + ".partial"
    with open(partial, "wb") as out:
        def write(data: bytes | memoryview) -> None:
            out.write(data)
            digest.update(data)

        write(head)
        buffer = bytearray(CHUNK)  # the one buffer every byte of data passes through
        view = memoryview(buffer)
        for header, base in zip(headers, bases):
            write(bytes(len(head) + base - out.tell()))
            with open(header.path, "rb", buffering=0) as inp:
                inp.seek(header.data_start)
                while count := inp.readinto(buffer):
                    write(view[:count])
        out.flush()
        os.fsync(out.fileno())
        if out.tell() != total:
            raise MergeError(f"{partial}: wrote {out.tell()} bytes, expected {total}")
    os.replace(partial, output)
    os.makedirs(os.path.dirname(_stamp_path(output)), exist_ok=True)
    st_out = os.stat(output)
    with open(_stamp_path(output), "w", encoding="utf-8") as handle:
        json.dump({"size": st_out.st_size, "mtime_ns": st_out.st_mtime_ns, "sha256": digest.hexdigest(),
                   "inputs": _inputs(dest, shards)}, handle, sort_keys=True)
    result["sha256"] = digest.hexdigest()
    return result
