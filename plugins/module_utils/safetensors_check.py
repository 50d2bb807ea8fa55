"""Checks of a staged safetensors snapshot before it is served: index, headers, FP8 block scales.

Runs on hosts (module `mlafleet.fleet.weights_stage`, state verified, after all N of N files are
proven) and on the controller (`mlafleet weights manifest DIR` refuses a broken snapshot,
`mlafleet weights check DIR`), so it uses the standard library only: a safetensors file starts
with an 8-byte little-endian length N and N bytes of JSON (tensor name -> dtype, shape,
data_offsets, plus an optional "__metadata__"); only that header is read, never the tensors.
The tests cross-check this reader against the `safetensors` package.

What is checked:
  - every tensor of model.safetensors.index.json maps to a file the manifest lists;
  - each file's header holds exactly the tensors the index assigns to it (a tensor the index does
    not list, or one the header lacks, is named with its file); offsets lie inside the file;
  - for a block-FP8 checkpoint (config.json quantization_config: quant_method fp8 with
    weight_block_size [R, C]) every FP8 weight (F8_E4M3 or F8_E5M2, 2-D, rows x cols) has its scale
    `<name>_scale_inv` (the DeepSeek-V3 / GLM FP8 naming) of shape ceil(rows/R) x ceil(cols/C).
"""

from __future__ import annotations

import json
import math
import os
import struct

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HEADER_LIMIT = 100 << 20  # the safetensors format's own bound on the header's size
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_SUFFIX = "_scale_inv"
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
SHOWN = 8


class CheckError(Exception):
    """A snapshot that must not be served, with a message naming each problem's file and tensor."""


def read_header(path: str) -> dict[str, dict]:
    """tensor name -> {dtype, shape, data_offsets} from a safetensors file's header (header only)."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckError(f"{name}: {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(HEADER_LIMIT, size - 8):
            raise CheckError(f"{name}: header length {length} does not fit the file ({size} bytes): not safetensors")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckError(f"{name}: the header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckError(f"{name}: the header is not a JSON object")
    data = size - 8 - length
    tensors: dict[str, dict] = {}
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2)
        if not ok:
            raise CheckError(f"{name}: tensor {tensor!r} has no dtype, shape and data_offsets")
        begin, end = info["data_offsets"]
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data):
            raise CheckError(f"{name}: tensor {tensor!r} data_offsets {info['data_offsets']} lie outside the "
                             f"file's {data} data bytes")
        width = DTYPE_BYTES.get(info["dtype"])
        if width is not None and math.prod(info["shape"]) * width != end - begin:
            raise CheckError(f"{name}: tensor {tensor!r} {info['dtype']} {info['shape']} needs "
                             f"{math.prod(info['shape']) * width} bytes, data_offsets give {end - begin}")
        tensors[tensor] = {"dtype": info["dtype"], "shape": list(info["shape"])}
    return tensors


def _load_json(directory: str, name: str) -> dict:
    try:
        with open(os.path.join(directory, name), encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError) as err:
        raise CheckError(f"{name}: not readable JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckError(f"{name}: not a JSON object")
    return value


def _refuse(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise CheckError(f"{what}: " + "; ".join(problems[:SHOWN]) + more)


def block_size(config: dict) -> list[int] | None:
    """[R, C] of a block-FP8 checkpoint's quantization_config, else None."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "fp8":
        return None
    block = quant.get("weight_block_size")
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return block
    return None


def check_index(index: dict, names: list[str]) -> dict[str, set[str]]:
    """file -> the tensors model.safetensors.index.json assigns to it, for every .safetensors file
    of `names`; CheckError naming each file the index maps tensors to that `names` lacks."""
    listed = set(names)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckError(f"{INDEX}: no weight_map of tensor name -> file")
    unknown: dict[str, list[str]] = {}
    for tensor, file in weight_map.items():
        if file not in listed or not file.endswith(".safetensors"):
            unknown.setdefault(file, []).append(tensor)
    _refuse([f"{INDEX} maps {len(t)} tensors (first {t[0]!r}) to {f}, which the manifest does not list"
             for f, t in sorted(unknown.items())], "the index and the manifest disagree")
    assigned: dict[str, set[str]] = {n: set() for n in names if n.endswith(".safetensors")}
    for tensor, file in weight_map.items():
        assigned[file].add(tensor)
    return assigned


def check_snapshot(directory: str, names: list[str]) -> dict:
    """Check the snapshot in `directory` whose manifest lists `names`; CheckError names what is wrong.

    Returns {safetensors_files, tensors, fp8_weights, weight_block_size, summary}.
    """
    listed = set(names)
    files = sorted(n for n in listed if n.endswith(".safetensors"))
    if INDEX in listed:
        assigned = check_index(_load_json(directory, INDEX), names)
    elif files == [SINGLE]:
        assigned = None
    else:
        raise CheckError(f"no {INDEX} and not exactly one {SINGLE} among {files[:SHOWN]}")

    problems: list[str] = []
    tensors: dict[str, dict] = {}
    for file in files:
        header = read_header(os.path.join(directory, file))
        if assigned is not None:
            want = assigned[file]
            if not want:
                problems.append(f"{file}: the index assigns it no tensor")
            problems += [f"{file}: the index assigns tensor {t!r} to it, its header does not hold it"
                         for t in sorted(want - header.keys())]
            problems += [f"{file}: its header holds tensor {t!r}, which the index does not list"
                         for t in sorted(header.keys() - want)]
        for tensor, info in header.items():
            tensors[tensor] = {**info, "file": file}
    _refuse(problems, "the safetensors headers and the index disagree")

    block = block_size(_load_json(directory, "config.json"))
    fp8 = sorted(t for t, info in tensors.items() if info["dtype"] in FP8_DTYPES)
    if block:
        for tensor in fp8:
            info = tensors[tensor]
            scale = tensor + SCALE_SUFFIX
            if len(info["shape"]) != 2:
                problems.append(f"{info['file']}: FP8 tensor {tensor!r} has shape {info['shape']}, not rows x cols")
                continue
            want = [math.ceil(info["shape"][0] / block[0]), math.ceil(info["shape"][1] / block[1])]
            if scale not in tensors:
                problems.append(f"{info['file']}: FP8 weight {tensor!r} {info['shape']} has no scale {scale!r}")
            elif tensors[scale]["shape"] != want:
                problems.append(f"{tensors[scale]['file']}: scale {scale!r} has shape {tensors[scale]['shape']}, "
                                f"FP8 weight {tensor!r} {info['shape']} in blocks of {block[0]}x{block[1]} "
                                f"needs {want}")
        _refuse(problems, f"block-FP8 checkpoint (weight_block_size {block})")
    summary = (f"{len(files)} of {len(files)} safetensors headers match the index ({len(tensors)} tensors)"
               if assigned is not None else f"{SINGLE}: {len(tensors)} tensors (no index)")
    if block:
        summary += f"; {len(fp8)} FP8 weights each with its {block[0]}x{block[1]} block scale"
    elif fp8:
        summary += f"; {len(fp8)} FP8 tensors, no weight_block_size in config.json (block scales not checked)"
    return {"safetensors_files": len(files), "tensors": len(tensors), "fp8_weights": len(fp8),
            "weight_block_size": block, "summary": summary}
