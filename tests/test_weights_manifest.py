"""Manifests: parallel sha256, GGUF split header checks, refusing incomplete or mixed shard sets."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from weights_support import write_model, write_shard

from mlafleet import cli
from mlafleet.weights import shards as weights


def test_manifest_lists_every_shard_with_size_sha256_and_header_facts(tmp_path: Path) -> None:
    paths = write_model(tmp_path, shards=3, tensors_per_shard=2)
    manifest = weights.build_manifest(tmp_path, jobs=3)
    assert manifest["format"] == weights.MANIFEST_FORMAT
    assert manifest["model"] == "tiny-glm"
    assert manifest["architecture"] == "glm-dsa"
    assert manifest["split_count"] == 3 and manifest["tensor_count"] == 6
    assert [s["name"] for s in manifest["shards"]] == [p.name for p in paths]
    for shard, path in zip(manifest["shards"], paths):
        assert shard["size"] == path.stat().st_size
        assert shard["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert shard["tensors"] == 2
    assert manifest["total_size"] == sum(p.stat().st_size for p in paths)


def test_parallel_hashing_matches_hashlib_and_reports_progress(tmp_path: Path) -> None:
    files = []
    for index in range(4):
        path = tmp_path / f"f{index}"
        path.write_bytes(bytes(range(256)) * (40_000 + 1_000 * index))  # > one 8 MiB chunk for none, 10 MB total
        files.append(path)
    stream = io.StringIO()
    progress = weights.Progress(sum(p.stat().st_size for p in files), "hashing", stream)
    hashed = weights.hash_files(files, jobs=4, progress=progress)
    progress.finish()
    digests = {p: sha for p, (sha, _chunks) in hashed.items()}
    assert digests == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert progress.done == sum(p.stat().st_size for p in files)
    out = stream.getvalue()
    assert all(f"{p.name}  {digests[p]}" in out for p in files)
    assert "100.0%" in out.splitlines()[-1]


def test_missing_shard_is_refused_by_name(tmp_path: Path) -> None:
    paths = write_model(tmp_path, shards=3)
    paths[1].unlink()
    with pytest.raises(weights.WeightsError, match="1 of 3 shards are missing.*tiny-glm-00002-of-00003.gguf"):
        weights.build_manifest(tmp_path)


def test_shards_in_the_wrong_order_are_refused(tmp_path: Path) -> None:
    paths = write_model(tmp_path, shards=3)
    swap = tmp_path / "swap"
    paths[0].rename(swap)
    paths[1].rename(paths[0])
    swap.rename(paths[1])
    with pytest.raises(weights.WeightsError, match="tiny-glm-00001-of-00003.gguf: split.no is 1, expected 0"):
        weights.build_manifest(tmp_path)


def test_split_count_disagreeing_with_the_file_names_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path / "four", shards=4)
    write_model(tmp_path / "three", name="other", shards=3)
    for index in range(1, 4):  # a 4-way split's first three files, named as a 3-way split
        shutil.copy(tmp_path / "four" / f"tiny-glm-0000{index}-of-00004.gguf",
                    tmp_path / "three" / f"other-0000{index}-of-00003.gguf")
    with pytest.raises(weights.WeightsError, match="split.count is 4, the files say 3 shards"):
        weights.build_manifest(tmp_path / "three")


def test_a_shard_from_another_model_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path / "a", shards=3, tensors_per_shard=2)
    write_model(tmp_path / "b", shards=3, tensors_per_shard=3, seed=1)
    shutil.copy(tmp_path / "b" / "tiny-glm-00002-of-00003.gguf", tmp_path / "a" / "tiny-glm-00002-of-00003.gguf")
    with pytest.raises(weights.WeightsError, match="do not belong to one model"):
        weights.build_manifest(tmp_path / "a")


def test_a_shard_repeating_another_shards_tensors_is_refused(tmp_path: Path) -> None:
    paths = write_model(tmp_path, shards=3, tensors_per_shard=2)
    # split keys all agree (no 1 of 3, 6 tensors in all), but it holds shard 1's tensor names
    write_shard(paths[1], "glm-dsa", split_no=1, split_count=3, tensors_count=6,
                tensors={"blk.0.ffn_up.weight": np.zeros(8, np.float32), "blk.9.extra": np.ones(8, np.float32)})
    with pytest.raises(weights.WeightsError, match="'blk.0.ffn_up.weight' is in both tiny-glm-00001-of-00003.gguf "
                                                   "and tiny-glm-00002-of-00003.gguf"):
        weights.build_manifest(tmp_path)


def test_a_later_shard_with_another_architecture_is_refused(tmp_path: Path) -> None:
    paths = write_model(tmp_path, shards=2, tensors_per_shard=2)
    write_shard(paths[1], "llama", split_no=1, split_count=2, tensors_count=4, keep_architecture=True,
                tensors={"blk.2.x": np.zeros(8, np.float32), "blk.3.x": np.ones(8, np.float32)})
    with pytest.raises(weights.WeightsError, match="architecture 'llama' differs from the first shard's 'glm-dsa'"):
        weights.build_manifest(tmp_path)


def test_not_a_gguf_file_is_named(tmp_path: Path) -> None:
    paths = write_model(tmp_path, shards=2)
    paths[1].write_bytes(b"this is not gguf" * 10)
    with pytest.raises(weights.WeightsError, match="tiny-glm-00002-of-00002.gguf: not a readable GGUF file"):
        weights.build_manifest(tmp_path)


def test_two_models_in_one_directory_need_model(tmp_path: Path) -> None:
    write_model(tmp_path, name="alpha", shards=2)
    write_model(tmp_path, name="beta", shards=2)
    with pytest.raises(weights.WeightsError, match="several models"):
        weights.build_manifest(tmp_path)
    assert weights.build_manifest(tmp_path, model="beta")["model"] == "beta"


def test_cli_writes_manifest_that_load_manifest_accepts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_model(tmp_path / "m", shards=2)
    out = tmp_path / "m.json"
    assert weights.main(["weights", "manifest", str(tmp_path / "m"), "-o", str(out), "-j", "2"]) == 0
    manifest = weights.load_manifest(out)
    assert manifest == weights.build_manifest(tmp_path / "m")
    assert "2 shards" in capsys.readouterr().err
    (tmp_path / "m" / "tiny-glm-00002-of-00002.gguf").unlink()
    assert weights.main(["weights", "manifest", str(tmp_path / "m"), "-q"]) == 2
    assert "missing" in capsys.readouterr().err


def test_load_manifest_refuses_an_incomplete_shard_list(tmp_path: Path) -> None:
    write_model(tmp_path / "m", shards=3)
    manifest = weights.build_manifest(tmp_path / "m")
    del manifest["shards"][2]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(manifest))
    with pytest.raises(weights.WeightsError, match=r"does not list shards 1..3 of 3 exactly once \(missing \[3\]"):
        weights.load_manifest(path)
    path.write_text("{}")
    with pytest.raises(weights.WeightsError, match="not an mlafleet weights manifest"):
        weights.load_manifest(path)


def test_registered_with_the_cli() -> None:
    assert cli.COMMANDS["weights"] == "mlafleet.weights.shards"
    args = cli.build_parser().parse_args(["weights", "verify", "--manifest", "m.json", "/models/x"])
    assert args.func.__name__ == "cmd_verify" and args.dest == "/models/x"
