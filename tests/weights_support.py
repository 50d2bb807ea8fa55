"""Helpers for the weights tests: real multi-shard GGUF files and a real HTTP mirror.

Shards are written with the `gguf` package's own split writer, which lays out the split keys as
llama.cpp's gguf-split does: every shard carries split.no (u16, 0-based), split.count (u16) and
split.tensors.count (i32); only the first carries the model's metadata.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from mlafleet.weights.mirror import MirrorHandler, MirrorServer


def write_model(directory: Path, name: str = "tiny-glm", shards: int = 3, tensors_per_shard: int = 2,
                elements: int = 4096, seed: int = 0, arch: str = "glm-dsa") -> list[Path]:
    """Write `name`-0000K-of-0000N.gguf into `directory`: random float32 and float16 tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(directory / f"{name}.gguf", arch, split_max_tensors=tensors_per_shard)
    writer.add_name(name)
    writer.add_uint32(f"{arch}.block_count", 2)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "world"])
    for index in range(shards * tensors_per_shard):
        if index % 2:
            writer.add_tensor(f"blk.{index}.attn_k_b.weight", rng.standard_normal((elements // 64, 64),
                                                                                 dtype=np.float32))
        else:
            data = rng.standard_normal(elements + 16 * index).astype(np.float16)
            writer.add_tensor(f"blk.{index}.ffn_up.weight", data, raw_dtype=GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    paths = sorted(directory.glob(f"{name}-*-of-*.gguf"))
    assert len(paths) == shards, paths
    return paths


def write_shard(path: Path, arch: str, split_no: int, split_count: int, tensors_count: int,
                tensors: dict[str, np.ndarray], keep_architecture: bool = False) -> None:
    """One shard written by hand with split keys laid out as gguf-split writes them (for bad sets)."""
    writer = GGUFWriter(path, arch)
    if not keep_architecture:
        writer.kv_data[0].pop("general.architecture")
    writer.add_uint16("split.no", split_no)
    writer.add_uint16("split.count", split_count)
    writer.add_int32("split.tensors.count", tensors_count)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class CountingServer(MirrorServer):
    """The mirror, remembering requests as (path, Range header) pairs for assertions."""

    def ranges(self, name: str) -> list[str]:
        return [line.rsplit("range=", 1)[1] for line in self.requests if f" /{name} " in line and "range=" in line]


@contextlib.contextmanager
def serving(server: HTTPServer) -> Iterator[HTTPServer]:
    """Serve `server` from a thread for the `with` block, then shut it down and close it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def mirror(root: Path, rate: float = 0.0, handler: type[MirrorHandler] = MirrorHandler,
           log_path: str = "") -> Iterator[CountingServer]:
    """A real HTTP server on 127.0.0.1 (an ephemeral port), serving `root`, for the `with` block."""
    with serving(CountingServer(str(root), ("127.0.0.1", 0), rate=rate, log_path=log_path,
                                handler=handler)) as server:
        yield server


TOKEN = "hf_SeCrEtToKeN0123456789"


class HubHandler(BaseHTTPRequestHandler):
    """A hub: checks the bearer token, then redirects to a CDN on another host:port (`server.cdn`)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_error(401, "bad token")
            return
        name = self.path.rsplit("/", 1)[1]
        self.send_response(302)
        self.send_header("Location", f"{self.server.cdn}/{name}")
        self.send_header("Content-Length", "0")
        self.end_headers()


@contextlib.contextmanager
def hub(cdn_url: str) -> Iterator[MirrorServer]:
    """A fake model hub on 127.0.0.1 that wants TOKEN and redirects downloads to `cdn_url`."""
    server = MirrorServer(".", ("127.0.0.1", 0), handler=HubHandler)
    server.seen, server.cdn = [], cdn_url
    with serving(server):
        yield server


def stage_killed_once(manifest: Path, dest: Path, url: str, partial: Path, past: int) -> int:
    """`mlafleet weights stage` from `url`, SIGKILLed once `partial` holds more than `past` bytes
    (a download killed half-way); returns the bytes the .partial kept."""
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlafleet.weights", "weights", "stage", "--manifest", str(manifest),
         "--dest", str(dest), "--from-url", url, "--reserve-mb", "0"],
        cwd=repo, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "collections")])},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (partial.exists() and partial.stat().st_size > past) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return partial.stat().st_size
