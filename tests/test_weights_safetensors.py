"""Safetensors snapshots through the weights code: manifests (from a directory and from a STAND-IN
hub), the checks before serving, staging with resume and corruption, and the role on the controller.

The snapshot is written with the `safetensors` package (safetensors_support.write_snapshot), with
FP8 e4m3 weights and their 128x128 block scales as GLM-5's FP8 checkpoints have them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors_support import COMMIT, stand_in_hub, write_safetensors, write_snapshot
from test_weights_role import run_role
from weights_support import TOKEN, mirror, stage_killed_once

from ansible_collections.mlafleet.fleet.plugins.module_utils import safetensors_check as check
from ansible_collections.mlafleet.fleet.plugins.module_utils import weights_stage as host
from mlafleet.weights import shards as weights
from mlafleet.weights import snapshot

REPO = Path(__file__).resolve().parent.parent
REPO_ID = "zai-org/GLM-5-FP8"


@pytest.fixture()
def snap(tmp_path: Path) -> Path:
    origin = tmp_path / "GLM-5-FP8"
    write_snapshot(origin)
    return origin


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_header_reader_agrees_with_the_safetensors_package(snap: Path) -> None:
    """The hosts' standard-library header reader against the package's own safe_open, FP8 included."""
    seen_fp8 = 0
    for path in sorted(snap.glob("*.safetensors")):
        ours = check.read_header(str(path))
        with safe_open(str(path), framework="numpy") as handle:
            assert sorted(ours) == sorted(handle.keys())
            for name in handle.keys():
                piece = handle.get_slice(name)
                assert ours[name] == {"dtype": piece.get_dtype(), "shape": list(piece.get_shape())}, name
                seen_fp8 += piece.get_dtype() == "F8_E4M3"
            assert handle.metadata() == {"format": "pt"}
    assert seen_fp8 == 4
    result = check.check_snapshot(str(snap), names(snap))
    assert result["fp8_weights"] == 4 and result["weight_block_size"] == [128, 128] and result["tensors"] == 11
    assert "2 of 2 safetensors headers match the index (11 tensors); 4 FP8 weights each with its 128x128" \
        in result["summary"]


def test_manifest_from_the_directory_and_from_the_stand_in_hub_agree(snap: Path, tmp_path: Path) -> None:
    local = snapshot.build_from_directory(snap, revision=COMMIT, repo=REPO_ID)
    with stand_in_hub(snap, REPO_ID, token=TOKEN) as hub:
        out = tmp_path / "hub.json"
        code = weights.main(["weights", "manifest", "--hub", REPO_ID, "--revision", "main", "--hub-endpoint", hub.url,
                             "-o", str(out)])
        assert code == 0  # the token from the environment (below), never on the command line
        remote = json.loads(out.read_text())
    # the hub's LFS files were not downloaded: only the small ones were fetched
    fetched = {path.rsplit("/", 1)[1] for verb, path, _ in hub.seen if verb == "GET" and "/resolve/" in path}
    assert fetched == {n for n in names(snap) if not n.endswith(".safetensors")}
    assert all(auth == f"Bearer {TOKEN}" for *_, auth in hub.seen)
    assert remote["revision"] == local["revision"] == COMMIT  # "main" pinned as its commit
    assert remote["model"] == local["model"] == "GLM-5-FP8" and remote["repo"] == REPO_ID
    pick = ("name", "size", "sha256")
    assert [{k: e[k] for k in pick} for e in remote["files"]] == [{k: e[k] for k in pick} for e in local["files"]]
    for entry, mine in zip(remote["files"], local["files"]):
        if entry["name"].endswith(".safetensors"):  # the hub gives no chunk sha256: filled on first staging
            assert "chunks" not in entry and "chunk_size" not in entry
        else:
            assert entry["chunks"] == mine["chunks"]
    assert "first staging" in remote["chunk_sha256"]
    assert host.check_manifest(remote) and host.check_manifest(local)


@pytest.fixture(autouse=True)
def _hub_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weights.HUB_TOKEN_ENV, TOKEN)


def test_a_branch_name_is_refused_at_staging_time(snap: Path) -> None:
    manifest = snapshot.build_from_directory(snap, revision=COMMIT)
    for branch in ("main", "v1.0", COMMIT[:7]):
        with pytest.raises(host.StageError, match=f"manifest revision '{branch}' is not a commit"):
            host.check_manifest({**manifest, "revision": branch})
    with pytest.raises(snapshot.SnapshotError, match="--revision 'main' is not a commit"):
        snapshot.build_from_directory(snap, revision="main")


def test_a_tensor_missing_from_the_index_is_refused_with_its_name(snap: Path, capsys: pytest.CaptureFixture) -> None:
    index = json.loads((snap / check.INDEX).read_text())
    del index["weight_map"]["model.layers.1.input_layernorm.weight"]
    (snap / check.INDEX).write_text(json.dumps(index))
    with pytest.raises(check.CheckError, match="model-00002-of-00002.safetensors: its header holds tensor "
                                               "'model.layers.1.input_layernorm.weight', which the index does not list"):
        check.check_snapshot(str(snap), names(snap))
    assert weights.main(["weights", "manifest", str(snap)]) == 2  # no manifest of a broken snapshot
    assert "model.layers.1.input_layernorm.weight" in capsys.readouterr().err

    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00003-of-00002.safetensors"
    (snap / check.INDEX).write_text(json.dumps(index))
    with pytest.raises(check.CheckError, match="maps 1 tensors \\(first 'model.layers.9.mlp.up_proj.weight'\\) to "
                                               "model-00003-of-00002.safetensors, which the manifest does not list"):
        check.check_snapshot(str(snap), names(snap))


def _rewrite_shard(snap: Path, drop: str = "", reshape: str = "") -> None:
    """Rewrite model-00001-of-00002 without tensor `drop` or with `reshape` one row too short, index to match."""
    path = snap / "model-00001-of-00002.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    raw = json.loads(data[8:8 + length])
    tensors = {}
    with safe_open(str(path), framework="numpy") as handle:
        for name in handle.keys():
            if name == drop:
                continue
            if handle.get_slice(name).get_dtype() == "F8_E4M3":  # numpy cannot read F8: copy the raw bytes
                begin, end = raw[name]["data_offsets"]
                tensors[name] = ("float8_e4m3fn", np.frombuffer(data[8 + length + begin:8 + length + end],
                                                                dtype=np.uint8).reshape(raw[name]["shape"]))
            else:
                value = handle.get_tensor(name)
                tensors[name] = (value.dtype.name, value[:-1] if name == reshape else value)
    write_safetensors(path, tensors)
    index = json.loads((snap / check.INDEX).read_text())
    index["weight_map"].pop(drop, None)
    (snap / check.INDEX).write_text(json.dumps(index))


def test_an_fp8_weight_without_its_scale_is_refused(snap: Path) -> None:
    _rewrite_shard(snap, drop="model.layers.0.mlp.down_proj.weight_scale_inv")
    with pytest.raises(check.CheckError, match="model-00001-of-00002.safetensors: FP8 weight "
                                               "'model.layers.0.mlp.down_proj.weight' \\[300, 200\\] has no scale "
                                               "'model.layers.0.mlp.down_proj.weight_scale_inv'"):
        check.check_snapshot(str(snap), names(snap))


def test_a_scale_of_the_wrong_shape_is_refused(snap: Path) -> None:
    _rewrite_shard(snap, reshape="model.layers.0.self_attn.o_proj.weight_scale_inv")
    with pytest.raises(check.CheckError, match="scale 'model.layers.0.self_attn.o_proj.weight_scale_inv' has shape "
                                               "\\[1, 3\\], FP8 weight .* \\[200, 300\\] in blocks of 128x128 needs \\[2, 3\\]"):
        check.check_snapshot(str(snap), names(snap))


def test_a_download_killed_half_way_resumes_and_a_flipped_byte_is_fetched_again(tmp_path: Path) -> None:
    """The CLI stages from a slow mirror, is killed inside the first safetensors file (its .partial
    stays), resumes with a range request; then a byte flipped on disk (size and mtime kept) is found
    by the spot check, named corrupt and fetched again."""
    origin = tmp_path / "snap"
    write_snapshot(origin, rows=1024, cols=1024)  # 1 MiB FP8 weights
    manifest = snapshot.build_from_directory(origin, revision=COMMIT)
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    dest = tmp_path / "dest"
    first = dest / "model-00001-of-00002.safetensors.partial"
    size = (origin / "model-00001-of-00002.safetensors").stat().st_size
    with mirror(origin, rate=800_000) as server:
        kept = stage_killed_once(tmp_path / "m.json", dest, server.url, first, 300_000)
        assert 300_000 < kept < size and not (dest / "model-00001-of-00002.safetensors").exists()
        server.rate = 0
        files = host.check_manifest(manifest)
        result = host.stage(str(dest), files, [host.HttpSource(server.url)])
        assert server.ranges("model-00001-of-00002.safetensors")[-1] == f"bytes={kept}-"
    assert result["present"] == result["expected"] == 7 and not list(dest.glob("*.partial"))
    assert check.check_snapshot(str(dest), [f.name for f in files])["tensors"] == 11

    target = dest / "model-00002-of-00002.safetensors"
    st = target.stat()
    with open(target, "r+b") as handle:
        handle.seek(st.st_size // 2)
        byte = handle.read(1)
        handle.seek(st.st_size // 2)
        handle.write(bytes([byte[0] ^ 0x10]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    done = subprocess.run([sys.executable, "-m", "mlafleet.weights", "weights", "stage", "--manifest",
                           str(tmp_path / "m.json"), "--dest", str(dest), "--from-path", str(origin),
                           "--reserve-mb", "0", "--spot-chunks", "4"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "collections")])},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "model-00002-of-00002.safetensors chunk 0 (of 1), fetched again" in done.stderr and "corrupt" in done.stderr
    assert "all 7 of 7 files present and verified" in done.stderr
    assert "2 of 2 safetensors headers match the index" in done.stderr
    assert target.read_bytes() == (origin / target.name).read_bytes()


def test_role_stages_from_the_stand_in_hub_fills_chunks_and_refetches_a_flipped_byte(snap: Path,
                                                                                   tmp_path: Path) -> None:
    """The role with a hub manifest (no chunk sha256 for the LFS files) and the hub source: all 7 of 7
    files and the checks before serving in its output, the token never; the stamps get the chunk sha256,
    so a byte flipped later (size and mtime kept) is named corrupt at the default verbosity and fetched again."""
    with stand_in_hub(snap, REPO_ID, token=TOKEN) as hub:
        manifest = snapshot.build_from_hub(REPO_ID, "main", hub.url, TOKEN)
        (tmp_path / "m.json").write_text(json.dumps(manifest))
        extra = {"weights_manifest": str(tmp_path / "m.json"), "weights_source": "hub",
                 "weights_hub_endpoint": hub.url, "weights_hub_repo": REPO_ID, "weights_hub_token": TOKEN,
                 "weights_root": str(tmp_path / "models"), "weights_reserve_mb": 0, "weights_spot_chunks": 4}
        done, stats = run_role(tmp_path, extra, "-vvv")
        assert done.returncode == 0, done.stdout[-3000:]
        assert TOKEN not in done.stdout + done.stderr
        assert "all 7 of 7 files verified in" in done.stdout
        assert "2 of 2 safetensors headers match the index (11 tensors); 4 FP8 weights each with its 128x128" \
            in done.stdout
        staged = tmp_path / "models" / "GLM-5-FP8"
        stamp = json.loads((staged / ".mlafleet-stamps" / "model-00001-of-00002.safetensors.json").read_text())
        assert stamp["chunks"] and stamp["source"] == f"hub:{REPO_ID}@{COMMIT}"
        assert {p for v, p, _ in hub.seen if v == "GET" and "/resolve/" in p} >= {
            f"/{REPO_ID}/resolve/{COMMIT}/model-00001-of-00002.safetensors"}

        target = staged / "model-00001-of-00002.safetensors"
        st = target.stat()
        with open(target, "r+b") as handle:
            handle.seek(st.st_size - 10)
            handle.write(b"\xff")
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        done, _ = run_role(tmp_path, extra, stdout_callback="default")
    assert done.returncode == 0, done.stdout[-3000:]
    text = " ".join(done.stdout.split())
    assert "1 corrupt: model-00001-of-00002.safetensors chunk 0 (of 1), fetched again" in text, text[-3000:]
    assert target.read_bytes() == (snap / target.name).read_bytes()


def test_role_refuses_a_branch_and_on_the_host_a_header_the_index_does_not_cover(snap: Path, tmp_path: Path) -> None:
    """A hub manifest cannot see the headers (no download): the host's check after staging refuses a
    tensor the index misses, naming it; a branch as the hub revision is refused before anything."""
    index = json.loads((snap / check.INDEX).read_text())
    del index["weight_map"]["model.embed_tokens.weight"]
    (snap / check.INDEX).write_text(json.dumps(index))
    with stand_in_hub(snap, REPO_ID, token=TOKEN) as hub:
        manifest = snapshot.build_from_hub(REPO_ID, "main", hub.url, TOKEN)
        (tmp_path / "m.json").write_text(json.dumps(manifest))
        extra = {"weights_manifest": str(tmp_path / "m.json"), "weights_source": "hub",
                 "weights_hub_endpoint": hub.url, "weights_hub_repo": REPO_ID, "weights_hub_token": TOKEN,
                 "weights_root": str(tmp_path / "models"), "weights_reserve_mb": 0}
        done, stats = run_role(tmp_path, {**extra, "weights_hub_revision": "main"})
        assert done.returncode != 0 and "weights_hub_revision \\\"main\\\"" in done.stdout
        assert "is not a commit (40 hex digits)" in done.stdout and not (tmp_path / "models").exists()
        done, stats = run_role(tmp_path, extra)
    assert done.returncode != 0 and stats["failures"] == 1
    assert ("model-00001-of-00002.safetensors: its header holds tensor 'model.embed_tokens.weight', "
            "which the index does not list") in done.stdout
