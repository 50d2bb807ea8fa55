"""The optional streamed merge: one GGUF file whose tensors equal the shards'."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from weights_support import write_model

from ansible_collections.mlafleet.fleet.plugins.module_utils import gguf_merge as merger
from mlafleet.weights import shards as weights


def tensors_of(paths: list[Path]) -> dict[str, tuple[int, list[int], bytes]]:
    found = {}
    for path in paths:
        for tensor in GGUFReader(path).tensors:
            found[tensor.name] = (int(tensor.tensor_type), tensor.shape.tolist(), np.asarray(tensor.data).tobytes())
    return found


def test_merged_file_holds_the_shards_tensors_and_metadata(tmp_path: Path) -> None:
    paths = write_model(tmp_path / "m", shards=3, tensors_per_shard=3)
    output = tmp_path / "out" / "tiny-glm.gguf"
    result = merger.merge(str(tmp_path / "m"), [p.name for p in paths], str(output))
    assert result["changed"] and output.stat().st_size == result["size"]
    expected = tensors_of(paths)
    merged = tensors_of([output])
    assert len(merged) == 9 and merged.keys() == expected.keys()
    for name, (ggml_type, shape, data) in expected.items():
        assert merged[name] == (ggml_type, shape, data), name
    reader = GGUFReader(output)
    first = GGUFReader(paths[0])
    assert not any(key.startswith("split.") for key in reader.fields)
    for key in ("general.architecture", "general.name", "glm-dsa.block_count", "tokenizer.ggml.tokens"):
        assert reader.get_field(key).contents() == first.get_field(key).contents()
    stamp = json.loads((tmp_path / "out" / ".mlafleet-stamps" / "tiny-glm.gguf.json").read_text())
    import hashlib
    assert stamp["sha256"] == result["sha256"] == hashlib.sha256(output.read_bytes()).hexdigest()


def test_merge_is_skipped_when_current_and_redone_when_a_shard_changes(tmp_path: Path) -> None:
    paths = write_model(tmp_path / "m", shards=2)
    output = tmp_path / "merged.gguf"
    names = [p.name for p in paths]
    merger.merge(str(tmp_path / "m"), names, str(output))
    mtime = output.stat().st_mtime_ns
    assert merger.merge(str(tmp_path / "m"), names, str(output))["changed"] is False
    assert output.stat().st_mtime_ns == mtime
    assert merger.merge(str(tmp_path / "m"), names, str(output), check_mode=True)["changed"] is False
    os.utime(paths[1], ns=(0, 12345))
    assert merger.merge(str(tmp_path / "m"), names, str(output), check_mode=True)["changed"] is True
    assert output.stat().st_mtime_ns == mtime  # check mode wrote nothing
    assert merger.merge(str(tmp_path / "m"), names, str(output))["changed"] is True


def test_merge_streams_without_holding_the_file(tmp_path: Path) -> None:
    paths = write_model(tmp_path / "m", shards=4, tensors_per_shard=2, elements=3 << 20)  # about 48 MB in all
    total = sum(p.stat().st_size for p in paths)
    tracemalloc.start()
    try:
        merger.merge(str(tmp_path / "m"), [p.name for p in paths], str(tmp_path / "big.gguf"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total > 40 << 20
    assert peak < 12 << 20, f"merge held {peak} bytes at once for a {total}-byte model"


def test_merge_refuses_missing_shards_and_shard_like_names(tmp_path: Path) -> None:
    paths = write_model(tmp_path / "m", shards=2)
    with pytest.raises(merger.MergeError, match="must not be named like a shard"):
        merger.merge(str(tmp_path / "m"), [p.name for p in paths], str(tmp_path / "x-00001-of-00001.gguf"))
    paths[1].unlink()
    with pytest.raises(merger.MergeError, match="missing shards"):
        merger.merge(str(tmp_path / "m"), [p.name for p in paths], str(tmp_path / "x.gguf"))
    assert not (tmp_path / "x.gguf").exists()


def test_merge_refuses_a_non_gguf_shard(tmp_path: Path) -> None:
    paths = write_model(tmp_path / "m", shards=2)
    paths[0].write_bytes(b"GGML" + bytes(64))
    with pytest.raises(merger.MergeError, match="not a GGUF file"):
        merger.merge(str(tmp_path / "m"), [p.name for p in paths], str(tmp_path / "x.gguf"))


def test_cli_merge_requires_verified_shards(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_model(tmp_path / "origin", shards=2)
    (tmp_path / "manifest.json").write_text(json.dumps(weights.build_manifest(tmp_path / "origin")))
    args = ["weights", "merge", "--manifest", str(tmp_path / "manifest.json"), str(tmp_path / "dest"),
            str(tmp_path / "one.gguf")]
    assert weights.main(args) == 2
    assert "missing or corrupt" in capsys.readouterr().err
    assert weights.main(["weights", "stage", "--manifest", str(tmp_path / "manifest.json"), "--dest",
                         str(tmp_path / "dest"), "--from-path", str(tmp_path / "origin"), "--reserve-mb", "0"]) == 0
    assert weights.main(args) == 0
    assert len(GGUFReader(tmp_path / "one.gguf").tensors) == 4
