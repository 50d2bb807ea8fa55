"""A tiny safetensors snapshot written with the `safetensors` package, and a STAND-IN model hub.

write_snapshot() lays a snapshot out as the GLM-5 FP8 checkpoints are (notes/multi-host.md):
config.json with quantization_config {quant_method: fp8, weight_block_size: [128, 128]},
generation_config.json, tokenizer files, model-0000K-of-0000N.safetensors and
model.safetensors.index.json. Each FP8 e4m3 weight has a float32 `<name>_scale_inv` of shape
ceil(rows/128) x ceil(cols/128). numpy has no float8 dtype: the FP8 bytes are uint8 buffers handed
to the package's own serializer (`serialize_file` with TensorSpec dtype float8_e4m3fn), which
writes the header; the rest goes through safetensors.numpy.

StandInHub is NOT a model hub: a small HTTP server on 127.0.0.1 answering the few routes that
`huggingface_hub` calls for model_info(files_metadata=True) and hf_hub_download (HEAD/GET of
<repo>/resolve/<revision>/<file>), plus byte ranges on the resolve route (what the role's hub
source asks for). It names itself STAND-IN in its responses' Server header.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlsplit

import numpy as np
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file
from weights_support import serving

from mlafleet.weights.mirror import MirrorHandler, MirrorServer

COMMIT = "5f3e7a0c9d2b4e6f8a1c3e5d7b9f0a2c4e6d8b1a"
BLOCK = 128


def fp8_layer(rng: np.random.Generator, name: str, rows: int, cols: int) -> dict[str, tuple[str, np.ndarray]]:
    """An FP8 e4m3 weight (raw bytes) and its float32 block scale, as (dtype name, array)."""
    weight = rng.integers(0, 0x7E, size=(rows, cols), dtype=np.uint8)  # e4m3 bit patterns, no NaN
    scale = rng.random((-(-rows // BLOCK), -(-cols // BLOCK)), dtype=np.float32) + 0.5
    return {name: ("float8_e4m3fn", weight), name + "_scale_inv": ("float32", scale)}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """One file; plain numpy tensors through safetensors.numpy, FP8 through the package's serializer."""
    if all(dtype != "float8_e4m3fn" for dtype, _ in tensors.values()):
        save_file({k: v for k, (_, v) in tensors.items()}, str(path), metadata={"format": "pt"})
        return
    arrays = {k: np.ascontiguousarray(v) for k, (_, v) in tensors.items()}
    specs = {k: TensorSpec(dtype=tensors[k][0], shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
             for k, a in arrays.items()}
    serialize_file(specs, str(path), metadata={"format": "pt"})


def write_snapshot(directory: Path, shards: int = 2, rows: int = 300, cols: int = 200, seed: int = 0,
                   fp8: bool = True) -> dict[str, str]:
    """Write the snapshot; returns its weight_map (tensor -> file)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": cols,
              "num_hidden_layers": shards, "torch_dtype": "bfloat16"}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [BLOCK, BLOCK]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "do_sample": False}))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab":
                                                          {"<s>": 0, "</s>": 1, "hello": 2, "world": 3}}}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    weight_map: dict[str, str] = {}
    total = 0
    for number in range(1, shards + 1):
        name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        layer = f"model.layers.{number - 1}"
        tensors: dict[str, tuple[str, np.ndarray]] = {
            f"{layer}.input_layernorm.weight": ("float32", rng.standard_normal(cols, dtype=np.float32)),
        }
        if fp8:
            tensors.update(fp8_layer(rng, f"{layer}.mlp.down_proj.weight", rows, cols))
            tensors.update(fp8_layer(rng, f"{layer}.self_attn.o_proj.weight", cols, rows))
        else:
            tensors[f"{layer}.mlp.down_proj.weight"] = ("float32", rng.standard_normal((rows, cols), dtype=np.float32))
        if number == 1:
            tensors["model.embed_tokens.weight"] = ("float16", rng.standard_normal((4, cols)).astype(np.float16))
        write_safetensors(directory / name, tensors)
        total += (directory / name).stat().st_size
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return weight_map


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 (git's object id)


class StandInHubHandler(MirrorHandler):
    """STAND-IN hub routes: /api/models/<repo>/revision/<rev>, <repo>/resolve/<rev>/<file> (HEAD, GET, ranges)."""

    server: "StandInHub"
    server_version = "mlafleet-STAND-IN-hub"

    def _authorized(self) -> bool:
        self.server.seen.append((self.command, urlsplit(self.path).path, self.headers.get("Authorization")))
        if self.server.token and self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self.send_error(401, "STAND-IN hub: bad or missing token")
            return False
        return True

    def _revision_ok(self, revision: str) -> bool:
        return revision in (self.server.commit, "main")

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        path = unquote(urlsplit(self.path).path)
        api = re.fullmatch(rf"/api/models/{re.escape(self.server.repo)}/revision/([^/]+)", path)
        if api:
            if not self._revision_ok(api[1]):
                self.send_error(404, "STAND-IN hub: revision not found")
                return
            body = json.dumps(self.server.model_info()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        if self._authorized():
            self._serve(body=False)

    def _resolve(self) -> str | None:
        match = re.fullmatch(rf"/{re.escape(self.server.repo)}/resolve/([^/]+)/([^/]+)", unquote(urlsplit(self.path).path))
        if not match or not self._revision_ok(match[1]) or match[2].startswith("."):
            return None
        path = os.path.join(self.server.root, match[2])
        return path if os.path.isfile(path) else None

    def end_headers(self) -> None:
        path = self._resolve() if "/resolve/" in self.path else None
        if path:  # what hf_hub_download reads from its HEAD
            self.send_header("X-Repo-Commit", self.server.commit)
            self.send_header("ETag", f'"{git_blob_id(Path(path).read_bytes())}"')
        super().end_headers()


class StandInHub(MirrorServer):
    """A STAND-IN hub serving one repository (`repo`) at one commit from the snapshot in `root`."""

    def __init__(self, root: str, repo: str, commit: str = COMMIT, token: str = "", lfs: tuple[str, ...] = (
            ".safetensors",)) -> None:
        super().__init__(root, ("127.0.0.1", 0), handler=StandInHubHandler)
        self.repo, self.commit, self.token, self.lfs = repo, commit, token, lfs
        self.seen: list[tuple[str, str, str | None]] = []

    def model_info(self) -> dict:
        siblings = []
        for path in sorted(Path(self.root).iterdir()):
            data = path.read_bytes()
            entry = {"rfilename": path.name, "size": len(data), "blobId": git_blob_id(data)}
            if path.name.endswith(self.lfs):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        return {"id": self.repo, "modelId": self.repo, "sha": self.commit, "private": False, "siblings": siblings}


@contextlib.contextmanager
def stand_in_hub(root: Path, repo: str, token: str = "") -> Iterator[StandInHub]:
    with serving(StandInHub(str(root), repo, token=token)) as server:
        yield server
