"""Staging: HTTP mirror with resume, local path, peer rsync, hub token, stamps, space, corruption.

Everything runs the host-side staging code the weights role ships with its module
(plugins/module_utils/weights_stage.py) against real files and real servers.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from weights_support import TOKEN, HubHandler, hub, mirror, serving, stage_killed_once, write_model

from ansible_collections.mlafleet.fleet.plugins.module_utils import digest
from ansible_collections.mlafleet.fleet.plugins.module_utils import weights_stage as host
from mlafleet.weights import shards as weights
from mlafleet.weights.mirror import MirrorHandler

REPO = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def model(tmp_path: Path) -> tuple[Path, dict, list]:
    """Three real GGUF shards (about 1 MB each), their manifest and the parsed shard list."""
    origin = tmp_path / "origin"
    write_model(origin, shards=3, tensors_per_shard=2, elements=1 << 18)
    manifest = weights.build_manifest(origin)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return origin, manifest, host.parse_shards(manifest["shards"])


def assert_staged(dest: Path, origin: Path, shards: list) -> None:
    for shard in shards:
        assert (dest / shard.name).read_bytes() == (origin / shard.name).read_bytes()
        assert not (dest / (shard.name + ".partial")).exists()
        stamp = json.loads((dest / ".mlafleet-stamps" / (shard.name + ".json")).read_text())
        st = (dest / shard.name).stat()
        assert stamp["size"] == st.st_size and stamp["mtime_ns"] == st.st_mtime_ns
        assert stamp["sha256"] == shard.sha256


def test_http_mirror_stages_all_shards_and_a_rerun_costs_a_stat(model, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    with mirror(origin) as server:
        result = host.stage(str(dest), shards, [host.HttpSource(server.url)])
        assert result["changed"] and result["present"] == result["expected"] == 3
        assert result["sources_used"] == {s.name: f"http:{server.url}" for s in shards}
        assert_staged(dest, origin, shards)
        served = len(server.requests)

        def no_hashing(path: str) -> str:
            raise AssertionError(f"re-run hashed {path}")

        monkeypatch.setattr(host, "sha256_file", no_hashing)
        again = host.stage(str(dest), shards, [host.HttpSource(server.url)])
        assert not again["changed"] and again["ready"] == [s.name for s in shards] and again["fetched"] == []
        assert len(server.requests) == served  # nothing asked of the mirror either


def test_download_killed_mid_shard_resumes_with_a_range_request(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    first = dest / (shards[0].name + ".partial")
    with mirror(origin, rate=400_000) as server:  # slow enough to kill mid-shard
        kept = stage_killed_once(tmp_path / "manifest.json", dest, server.url, first, 200_000)
        assert 200_000 < kept < shards[0].size
        assert not (dest / shards[0].name).exists()
        server.rate = 0
        result = host.stage(str(dest), shards, [host.HttpSource(server.url)])
        assert server.ranges(shards[0].name)[-1] == f"bytes={kept}-"
    assert result["present"] == 3 and result["corrupt_downloads"] == 0
    assert_staged(dest, origin, shards)


class CorruptOnceHandler(MirrorHandler):
    """Serves one flipped byte in the first download of each shard (a bad proxy, a bit flip)."""

    def send_bytes(self, path: str, start: int, length: int) -> None:
        name = os.path.basename(path)
        if name in self.server.corrupted:
            super().send_bytes(path, start, length)
            return
        self.server.corrupted.add(name)
        with open(path, "rb") as handle:
            handle.seek(start)
            data = bytearray(handle.read(length))
        data[len(data) // 2] ^= 0xFF
        self.wfile.write(bytes(data))


def test_corrupt_download_is_detected_and_fetched_again(model, tmp_path: Path) -> None:
    origin, _, shards = model
    with mirror(origin, handler=CorruptOnceHandler) as server:
        server.corrupted = set()
        log: list[str] = []
        result = host.stage(str(tmp_path / "dest"), shards, [host.HttpSource(server.url)], log=log.append)
    assert result["corrupt_downloads"] == 3 and result["present"] == 3
    assert sum("corrupt download" in line for line in log) == 3
    assert_staged(tmp_path / "dest", origin, shards)


def test_a_source_that_stays_corrupt_fails_and_leaves_no_shard(model, tmp_path: Path) -> None:
    origin, _, shards = model
    bad = tmp_path / "bad"
    bad.mkdir()
    for shard in shards:
        data = bytearray((origin / shard.name).read_bytes())
        data[-1] ^= 1
        (bad / shard.name).write_bytes(bytes(data))
    with pytest.raises(host.StageError, match=rf"{shards[0].name}: no source delivered a verified copy.*sha256"):
        host.stage(str(tmp_path / "dest"), shards, [host.PathSource(str(bad))], retries=1)
    assert not (tmp_path / "dest" / shards[0].name).exists()
    assert not (tmp_path / "dest" / (shards[0].name + ".partial")).exists()


def test_shard_corrupted_on_disk_is_detected_and_fetched_again(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    victim = dest / shards[1].name
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x55
    victim.write_bytes(bytes(data))  # same size, new mtime: the stamp no longer matches
    result = host.stage(str(dest), shards, [host.PathSource(str(origin))])
    assert result["corrupt"] == [shards[1].name] and result["fetched"] == [shards[1].name]
    assert_staged(dest, origin, shards)


def test_stamp_trusts_mtime_and_full_verify_catches_a_silent_flip(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    victim = dest / shards[2].name
    st = victim.stat()
    with open(victim, "r+b") as handle:
        handle.seek(5000)
        byte = handle.read(1)
        handle.seek(5000)
        handle.write(bytes([byte[0] ^ 1]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as stamped
    assert host.prove_present(str(dest), shards)["present"] == 3  # the documented limit of a stamp
    with pytest.raises(host.StageError, match=f"1 of 3 shards are missing or corrupt.*{shards[2].name}"):
        host.prove_present(str(dest), shards, verify="full")
    result = host.stage(str(dest), shards, [host.PathSource(str(origin))], verify="full")
    assert result["fetched"] == [shards[2].name]
    assert_staged(dest, origin, shards)


def test_shard_missing_at_the_source_is_refused_by_name(model, tmp_path: Path) -> None:
    origin, _, shards = model
    (origin / shards[2].name).unlink()
    dest = tmp_path / "dest"
    with mirror(origin) as server:
        with pytest.raises(host.StageError, match=rf"{shards[2].name}: .*HTTP 404.*missing at the source"):
            host.stage(str(dest), shards, [host.HttpSource(server.url)], retries=0)
    with pytest.raises(host.StageError, match=rf"1 of 3 shards are missing or corrupt.*{shards[2].name}"):
        host.prove_present(str(dest), shards)


def test_too_little_disk_is_refused_before_any_byte(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    total = sum(s.size for s in shards)
    reserve = host.free_bytes(str(tmp_path)) - total + 1  # the filesystem is one byte short
    with mirror(origin) as server:
        with pytest.raises(host.StageError, match=f"not enough free space .*{total} bytes still to fetch"):
            host.stage(str(dest), shards, [host.HttpSource(server.url)], reserve=reserve)
        assert server.requests == []
    assert not dest.exists()


def test_free_space_counts_only_the_bytes_still_to_come(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    host.stage(str(dest), shards[:1], [host.PathSource(str(origin))])
    plan = host.make_plan(str(dest), shards)
    assert plan.remaining_bytes == shards[1].size + shards[2].size
    (dest / (shards[1].name + ".partial")).write_bytes((origin / shards[1].name).read_bytes()[:1000])
    assert host.make_plan(str(dest), shards).remaining_bytes == shards[1].size - 1000 + shards[2].size


def test_path_source_resumes_a_partial_copy(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / (shards[0].name + ".partial")).write_bytes((origin / shards[0].name).read_bytes()[:333_333])
    result = weights.main(["weights", "stage", "--manifest", str(tmp_path / "manifest.json"), "--dest", str(dest),
                           "--from-path", str(origin), "--reserve-mb", "0"])
    assert result == 0
    assert_staged(dest, origin, shards)
    assert weights.main(["weights", "verify", "--manifest", str(tmp_path / "manifest.json"), str(dest)]) == 0


def test_sources_fall_back_in_order(model, tmp_path: Path) -> None:
    origin, _, shards = model
    partial_origin = tmp_path / "half"
    partial_origin.mkdir()
    (partial_origin / shards[0].name).write_bytes((origin / shards[0].name).read_bytes())
    result = host.stage(str(tmp_path / "dest"), shards,
                        [host.PathSource(str(partial_origin)), host.PathSource(str(origin))], retries=0)
    assert result["sources_used"] == {shards[0].name: f"path:{partial_origin}", shards[1].name: f"path:{origin}",
                                      shards[2].name: f"path:{origin}"}


FAKE_SSH = """\
#!/bin/sh
# Stands in for ssh in front of rsync: records the login, then runs the remote command here.
user=
while [ $# -gt 0 ]; do
  case "$1" in
    -l) user="$2@"; shift 2 ;;
    -p|-o|-i) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
echo "$user$1" >> "{log}"
shift
exec sh -c "$*"
"""


def test_peer_source_runs_rsync_and_resumes(model, tmp_path: Path) -> None:
    origin, _, shards = model
    fake = tmp_path / "fake-ssh"
    fake.write_text(FAKE_SSH.format(log=tmp_path / "ssh.log"))
    fake.chmod(0o755)
    dest = tmp_path / "dest"
    dest.mkdir()
    kept = 500_000
    partial = dest / (shards[1].name + ".partial")
    partial.write_bytes((origin / shards[1].name).read_bytes()[:kept])
    inode = partial.stat().st_ino
    peer = host.PeerSource("peer-1", path=str(origin), rsh=str(fake))
    result = host.stage(str(dest), shards, [peer])
    assert (dest / shards[1].name).stat().st_ino == inode  # appended in place, then renamed
    assert result["sources_used"] == {s.name: "peer:peer-1" for s in shards}
    assert (tmp_path / "ssh.log").read_text().split() == ["root@peer-1"] * 3
    assert_staged(dest, origin, shards)


def test_peer_command_is_rsync_append_over_strict_ssh() -> None:
    peer = host.PeerSource("10.0.0.2", path="/models/glm5", user="stage", port=2222,
                           ssh_key="/var/lib/k/id_ed25519", known_hosts="/var/lib/k/known_hosts")
    shard = host.Shard("m-00001-of-00002.gguf", 1, "0" * 64)
    cmd = peer.command(shard, "/dst/m-00001-of-00002.gguf.partial")
    assert cmd[:2] == ["rsync", "--append"]
    assert cmd[-2:] == ["stage@10.0.0.2:/models/glm5/m-00001-of-00002.gguf", "/dst/m-00001-of-00002.gguf.partial"]
    rsh = cmd[cmd.index("-e") + 1]
    for part in ("-p 2222", "BatchMode=yes", "-i /var/lib/k/id_ed25519", "IdentitiesOnly=yes",
                 "UserKnownHostsFile=/var/lib/k/known_hosts", "StrictHostKeyChecking=yes"):
        assert part in rsh
    restricted = host.PeerSource("10.0.0.2")  # rrsync-restricted key: names relative to the shard dir
    assert restricted.command(shard, "p")[-2] == "root@10.0.0.2:m-00001-of-00002.gguf"


def test_unreachable_peer_fails_with_its_name(model, tmp_path: Path) -> None:
    _, _, shards = model
    peer = host.PeerSource("peer-9", path="/nowhere", rsh="false")
    with pytest.raises(host.StageError, match="rsync from peer-9 failed"):
        host.stage(str(tmp_path / "dest"), shards, [peer], retries=0)


def test_hub_request_carries_the_token_only_to_the_hub(model, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    origin, _, shards = model
    source = host.hub_source("https://hub.example", "zai-org/GLM-5-GGUF", COMMIT, TOKEN)
    request = source.request(shards[0].name, 0)
    assert request.full_url == f"https://hub.example/zai-org/GLM-5-GGUF/resolve/{COMMIT}/{shards[0].name}"
    assert request.get_header("Authorization") == f"Bearer {TOKEN}"
    assert TOKEN not in source.label

    with mirror(origin) as cdn, hub(cdn.url) as hub_server:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        code = weights.main(["weights", "stage", "--manifest", str(tmp_path / "manifest.json"),
                             "--dest", str(tmp_path / "dest"), "--from-hub", "zai-org/GLM-5-GGUF",
                             "--hub-endpoint", hub_server.url, "--token-file", str(token_file), "--reserve-mb", "0",
                             "--revision", COMMIT])
        assert code == 0
        assert [path for path, _ in hub_server.seen] == [f"/zai-org/GLM-5-GGUF/resolve/{COMMIT}/{s.name}" for s in shards]
        assert all(auth == f"Bearer {TOKEN}" for _, auth in hub_server.seen)
        cdn_gets = [line for line in cdn.requests if " GET " in line]
        assert len(cdn_gets) == 3 and all(" auth=no " in line for line in cdn_gets)
        assert_staged(tmp_path / "dest", origin, shards)

        token_file.write_text("hf_wrong_" + TOKEN)
        code = weights.main(["weights", "stage", "--manifest", str(tmp_path / "manifest.json"),
                             "--dest", str(tmp_path / "dest2"), "--from-hub", "zai-org/GLM-5-GGUF",
                             "--hub-endpoint", hub_server.url, "--token-file", str(token_file), "--retries", "0",
                             "--revision", COMMIT])
        assert code == 2
    out = capsys.readouterr()
    assert "HTTP 401" in out.err
    assert TOKEN not in out.out + out.err


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", COMMIT[:12], COMMIT.upper(), ""])
def test_a_hub_revision_that_is_not_a_commit_is_refused(revision: str) -> None:
    """Staging from a hub pins a commit: a branch or tag could give hosts different bytes."""
    with pytest.raises(host.StageError, match="is not a commit \\(40 hex digits\\): a branch or tag name can move"):
        host.make_source({"type": "hub", "repo": "zai-org/GLM-5-FP8", "revision": revision, "token": TOKEN})


def test_redaction_hides_the_token_in_any_message() -> None:
    assert host.redact(f"GET https://x/?t={TOKEN} failed", [TOKEN, ""]) == "GET https://x/?t=******** failed"


def test_check_mode_reports_and_changes_nothing(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    result = host.stage(str(dest), shards, [host.PathSource(str(origin))], check_mode=True)
    assert result["changed"] and result["fetched"] == [s.name for s in shards] and not dest.exists()
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    again = host.stage(str(dest), shards, [host.PathSource(str(origin))], check_mode=True)
    assert not again["changed"] and again["present"] == 3


def test_a_second_stager_on_the_same_directory_is_refused(model, tmp_path: Path) -> None:
    _, _, shards = model
    dest = tmp_path / "dest"
    with host.locked(str(dest)):
        with pytest.raises(host.StageError, match="being staged by another process"):
            host.stage(str(dest), shards, [host.PathSource("/nonexistent")])


@pytest.mark.parametrize("entries, message", [
    ([], "lists no shards"),
    ([{"name": "model.gguf", "size": 1, "sha256": "0" * 64}], "not of the form"),
    ([{"name": "m-00001-of-00001.gguf", "size": -1, "sha256": "0" * 64}], "size -1"),
    ([{"name": "m-00001-of-00001.gguf", "size": 1, "sha256": "xyz"}], "not 64 hex digits"),
    ([{"name": "m-00001-of-00002.gguf", "size": 1, "sha256": "0" * 64},
      {"name": "n-00002-of-00002.gguf", "size": 1, "sha256": "0" * 64}], "mixes models"),
    ([{"name": "m-00001-of-00002.gguf", "size": 1, "sha256": "0" * 64}] * 2, r"duplicate or out of range \[1\]"),
])
def test_bad_manifests_are_named(entries: list, message: str) -> None:
    with pytest.raises(host.StageError, match=message):
        host.parse_shards(entries)


def _manifest(model: str = "m", count: int = 2, names: list[str] | None = None) -> dict:
    names = names or [f"{model}-{n:05d}-of-{count:05d}.gguf" for n in range(1, count + 1)]
    return {"format": host.MANIFEST_FORMAT, "model": model, "split_count": count,
            "shards": [{"name": n, "size": 1, "sha256": "0" * 64} for n in names]}


@pytest.mark.parametrize("manifest, message", [
    ({"format": "other"}, "not an mlafleet weights manifest"),
    (_manifest(model="../../tmp/evil", names=["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"]), "not a plain name"),
    (_manifest(model="a/b", names=["b-00001-of-00002.gguf", "b-00002-of-00002.gguf"]), "not a plain name"),
    (_manifest(model="..", names=["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]), "not a plain name"),
    (_manifest(model=".hidden", names=["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]), "not a plain name"),
    (_manifest(names=["../m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]), "no separators"),
    (_manifest(names=["m..x-00001-of-00002.gguf", "m..x-00002-of-00002.gguf"]), "no '..'"),
    (_manifest(model="m", names=["other-00001-of-00002.gguf", "other-00002-of-00002.gguf"]), "of model 'other'"),
    ({**_manifest(), "split_count": 3}, "lists 2 shards of 2, split_count says 3"),
    ({**_manifest(count=3), "shards": _manifest(count=3)["shards"][:2], "split_count": 2}, "1..3 of 3 exactly once (missing [3]"),
    ({**_manifest(), "split_count": "2"}, "split_count '2' is not a positive integer"),
])
def test_check_manifest_names_every_bad_name(manifest: dict, message: str) -> None:
    with pytest.raises(host.StageError, match=re.escape(message) if "'" in message or "." in message else message):
        host.check_manifest(manifest)


def test_check_manifest_accepts_a_complete_one() -> None:
    assert [s.name for s in host.check_manifest(_manifest(model="GLM-5-Q4_K_M", count=2))] == [
        "GLM-5-Q4_K_M-00001-of-00002.gguf", "GLM-5-Q4_K_M-00002-of-00002.gguf"]


def test_host_module_needs_only_the_standard_library() -> None:
    """Hosts have Debian's python3 and nothing else: the modules must import with -I -S, given only
    what Ansible ships with them (the collection's module_utils, on the path as in AnsiballZ)."""
    modules = REPO / "plugins" / "modules"
    code = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {str(REPO / 'collections')!r})
        spec = importlib.util.spec_from_file_location("m", {str(modules / 'weights_stage.py')!r})
        module = importlib.util.module_from_spec(spec); sys.modules["m"] = module; spec.loader.exec_module(module)
        spec = importlib.util.spec_from_file_location("g", {str(modules / 'gguf_weights_merge.py')!r})
        module = importlib.util.module_from_spec(spec); sys.modules["g"] = module; spec.loader.exec_module(module)
        print(sorted(n for n in sys.modules if n.split(".")[0] in ("ansible", "gguf", "numpy", "yaml")))
        print(sorted(n for n in sys.modules if n.startswith("ansible_collections.")))
    """)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    third_party, collection = out.stdout.splitlines()
    assert third_party == "[]"
    # Only the collection's own module_utils (the namespace packages above them included).
    utils = "ansible_collections.mlafleet.fleet.plugins.module_utils"
    loaded = ast.literal_eval(collection)
    assert {n for n in loaded if n.startswith(utils + ".")} == {f"{utils}.{m}" for m in ("digest", "gguf_merge", "safetensors_check",
                                                                           "weights_stage")}
    assert all(utils.startswith(n) or n.startswith(utils + ".") for n in loaded)


@pytest.fixture()
def chunked(tmp_path: Path) -> tuple[Path, dict, list]:
    """The three shards with per-chunk sha256 of 64 KiB (about 17 chunks a shard)."""
    origin = tmp_path / "origin"
    write_model(origin, shards=3, tensors_per_shard=2, elements=1 << 18)
    manifest = weights.build_manifest(origin, chunk_size=64 << 10)
    return origin, manifest, host.parse_shards(manifest["shards"])


def test_manifest_carries_chunk_sha256_that_match_the_bytes(chunked) -> None:
    origin, manifest, shards = chunked
    for entry, shard in zip(manifest["shards"], shards):
        data = (origin / entry["name"]).read_bytes()
        assert entry["chunk_size"] == 64 << 10 and shard.chunk_size == 64 << 10
        assert entry["chunks"] == [hashlib.sha256(data[i:i + (64 << 10)]).hexdigest()
                                   for i in range(0, len(data), 64 << 10)]
        assert list(shard.chunks) == entry["chunks"] and len(shard.chunks) > 10
    default = weights.build_manifest(origin)  # 64 MiB chunks: one per shard of this size
    assert [e["chunk_size"] for e in default["shards"]] == [64 << 20] * 3
    assert [len(e["chunks"]) for e in default["shards"]] == [1] * 3


def test_every_run_spot_checks_chunks_and_finds_a_silent_flip(chunked, tmp_path: Path) -> None:
    origin, _, shards = chunked
    dest = tmp_path / "dest"
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    flip(dest / shards[1].name, 5000 + 3 * (64 << 10))  # in chunk 3 of shard 2
    # without the spot check the stamp is trusted: the documented limit
    assert host.prove_present(str(dest), shards, spot_chunks=0)["present"] == 3
    # two random chunks a shard (what the role does by default) read exactly that much
    quick = host.prove_present(str(dest), [shards[0], shards[2]], spot_chunks=2)
    assert quick["spot_check"]["shards"] == 2 and quick["spot_check"]["chunks"] == 4
    # exactly the picked chunks' bytes: 64 KiB each, but a shard's last chunk is shorter
    full = 64 << 10
    tails = [s.size - (len(s.chunks) - 1) * full for s in (shards[0], shards[2])]
    assert all(0 < t < full for t in tails)
    assert quick["spot_check"]["bytes"] in {4 * full, 3 * full + tails[0], 3 * full + tails[1],
                                            2 * full + tails[0] + tails[1]}
    assert "4 chunks" in quick["spot_check"]["summary"] and " s" in quick["spot_check"]["summary"]
    assert "4 verified" in quick["spot_check"]["summary"] and "corrupt" not in quick["spot_check"]["summary"]
    # enough chunks to cover the shard: the flip is found however the picks fall
    every = len(shards[1].chunks)
    with pytest.raises(host.StageError, match=f"1 of 3 shards are missing or corrupt.*spot check failed.*{shards[1].name}"):
        host.prove_present(str(dest), shards, spot_chunks=every)
    log: list[str] = []
    result = host.stage(str(dest), shards, [host.PathSource(str(origin))], spot_chunks=every, log=log.append)
    assert result["fetched"] == [shards[1].name] and result["corrupt"] == [shards[1].name]
    assert result["spot_check"]["failed"] == [shards[1].name]
    assert result["spot_check"]["corrupt"] == [{"shard": shards[1].name, "chunk": 3}]
    assert any(line.startswith(f"{shards[1].name}: spot-checked chunk 3 does not match") and "fetched again" in line
               for line in log), log
    # what the role prints at the default verbosity: the bad chunk named, not called verified
    summary = result["spot_check"]["summary"]
    assert "read and verified" not in summary, summary
    assert f"1 corrupt: {shards[1].name} chunk 3 (of {every}), fetched again" in summary, summary
    assert f"{result['spot_check']['chunks'] - 1} verified" in summary, summary
    assert_staged(dest, origin, shards)
    # in check mode nothing is fetched: the summary says what would happen
    flip(dest / shards[1].name, 5000 + 3 * (64 << 10))
    planned = host.stage(str(dest), shards, [host.PathSource(str(origin))], spot_chunks=every, check_mode=True)
    assert f"{shards[1].name} chunk 3 (of {every}), to be fetched again" in planned["spot_check"]["summary"]
    # the proof (the role's last check) names the chunk too
    with pytest.raises(host.StageError, match=f"{shards[1].name} chunk 3 "):
        host.prove_present(str(dest), shards, spot_chunks=every)


def test_random_picks_find_a_flip_in_proportion(chunked, tmp_path: Path) -> None:
    """With k of n chunks picked, a flip in one chunk is found with probability k/n per run."""
    import random

    origin, _, shards = chunked
    dest = tmp_path / "dest"
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    flip(dest / shards[0].name, 10)  # chunk 0
    n = len(shards[0].chunks)
    rng = random.Random(7)
    found = sum(bool(host.make_plan(str(dest), shards[:1], "stamp", 2, rng).spot_failed) for _ in range(300))
    assert abs(found / 300 - 2 / n) < 0.06, (found, n)


def test_without_manifest_chunk_hashes_the_first_staging_keeps_them_in_the_stamp(model, tmp_path: Path) -> None:
    """A manifest read from the hub has each file's sha256 but no chunk sha256: the first staging
    computes them on the way in from the bytes whose sha256 matched, keeps them in the stamp, and
    the spot check reads them from there; a stamp without them (older mlafleet) is named unchecked."""
    origin, manifest, _ = model
    entries = [{k: v for k, v in e.items() if k not in ("chunk_size", "chunks")} for e in manifest["shards"]]
    shards = host.parse_shards(entries)
    dest = tmp_path / "dest"
    with mirror(origin) as server:  # hashed on the way in (http), and from a path
        host.stage(str(dest), shards[:2], [host.HttpSource(server.url)])
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    for entry in manifest["shards"]:
        stamp = json.loads((dest / ".mlafleet-stamps" / (entry["name"] + ".json")).read_text())
        assert stamp["chunk_size"] == host.MANIFEST_CHUNK and stamp["chunks"] == entry["chunks"]  # 64 MiB chunks
    flip(dest / shards[1].name, 1000)
    log: list[str] = []
    again = host.stage(str(dest), shards, [host.PathSource(str(origin))], spot_chunks=2, log=log.append)
    assert again["spot_check"]["unchecked"] == [] and again["spot_check"]["chunks"] == 3
    assert again["fetched"] == [shards[1].name] and "corrupt" in " ".join(log)
    assert (dest / shards[1].name).read_bytes() == (origin / shards[1].name).read_bytes()

    for shard in shards:  # stamps written before chunk sha256 were kept
        path = dest / ".mlafleet-stamps" / (shard.name + ".json")
        stamp = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in stamp.items() if k not in ("chunk_size", "chunks")}))
    old = host.prove_present(str(dest), shards, spot_chunks=2)
    assert old["spot_check"]["unchecked"] == [s.name for s in shards] and old["spot_check"]["chunks"] == 0
    assert "3 shards have no chunk sha256 in the manifest or their stamp" in old["spot_check"]["summary"]


def flip(path: Path, offset: int) -> None:
    """Flip one bit at `offset`, keeping the file's size and mtime (its stamp still matches)."""
    st = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize(("extra", "message"), [
    ({"chunk_size": 0, "chunks": []}, "chunk_size 0 is not a positive integer"),
    ({"chunk_size": 4, "chunks": "ab"}, "chunks is not a list"),
    ({"chunk_size": 4, "chunks": ["a" * 64]}, "1 chunk sha256 for 10 bytes in chunks of 4, expected 3"),
    ({"chunk_size": 4, "chunks": ["a" * 64, "b" * 64, "xyz"]}, "chunk sha256 'xyz' is not 64 hex digits"),
    ({"chunks": ["a" * 64]}, "chunk_size None is not a positive integer"),
])
def test_bad_chunk_lists_are_named(extra: dict, message: str) -> None:
    entry = {"name": "m-00001-of-00001.gguf", "size": 10, "sha256": "0" * 64, **extra}
    with pytest.raises(host.StageError, match=re.escape(message)):
        host.parse_shards([entry])


def test_one_pass_hash_gives_the_file_and_chunk_sha256(tmp_path: Path) -> None:
    for size in (0, 1, 3 << 20, (3 << 20) + 17):
        path = tmp_path / f"blob{size}"
        data = os.urandom(size)
        path.write_bytes(data)
        whole, chunks = digest.hash_file(str(path), 1 << 20)
        assert whole == hashlib.sha256(data).hexdigest()
        want = [hashlib.sha256(data[i:i + (1 << 20)]).hexdigest() for i in range(0, size, 1 << 20)] or \
            [hashlib.sha256(b"").hexdigest()]
        assert chunks == want, size


def test_sha256_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(3 << 20))
    assert digest.sha256_file(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()


RRSYNC_SSH = """\
#!/bin/sh
# Stands in for ssh to a peer whose authorized_keys forces `rrsync -ro DIR` (what the role installs).
while [ $# -gt 0 ]; do
  case "$1" in
    -l|-p|-o|-i) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
shift
SSH_ORIGINAL_COMMAND="$*" exec /usr/bin/rrsync -ro "{root}"
"""


def test_peer_restricted_to_read_only_rsync_of_the_shard_dir(model, tmp_path: Path) -> None:
    origin, _, shards = model
    fake = tmp_path / "rrsync-ssh"
    fake.write_text(RRSYNC_SSH.format(root=origin))
    fake.chmod(0o755)
    (tmp_path / "secret").write_text("outside the shard directory")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / (shards[0].name + ".partial")).write_bytes((origin / shards[0].name).read_bytes()[:12345])
    result = host.stage(str(dest), shards, [host.PeerSource("peer-1", rsh=str(fake))])  # names relative
    assert result["present"] == 3
    assert_staged(dest, origin, shards)
    escape = host.PeerSource("peer-1", path="..", rsh=str(fake))
    with pytest.raises(host.StageError, match="rsync from peer-1 failed"):
        escape.fetch(host.Shard("secret", 27, "0" * 64), str(tmp_path / "stolen"))
    assert not (tmp_path / "stolen").exists()


def test_a_server_that_ignores_range_restarts_the_shard(model, tmp_path: Path) -> None:
    """Python's own http.server answers a Range request with 200 and the whole file."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    origin, _, shards = model
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / (shards[0].name + ".partial")).write_bytes(b"\x00" * 70_000)  # wrong bytes: must not be kept
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(origin))
    handler.log_message = lambda *a: None
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as server:
        result = host.stage(str(dest), shards, [host.HttpSource(f"http://127.0.0.1:{server.server_address[1]}")])
    assert result["corrupt_downloads"] == 0
    assert_staged(dest, origin, shards)


def test_a_partial_longer_than_the_shard_is_started_over(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / (shards[2].name + ".partial")).write_bytes(b"\xff" * (shards[2].size + 10))
    with mirror(origin) as server:
        host.stage(str(dest), shards, [host.HttpSource(server.url)])
        assert server.ranges(shards[2].name) == ["-"]
    assert_staged(dest, origin, shards)


def test_full_verify_of_an_intact_directory_changes_nothing(model, tmp_path: Path) -> None:
    origin, _, shards = model
    dest = tmp_path / "dest"
    host.stage(str(dest), shards, [host.PathSource(str(origin))])
    result = host.stage(str(dest), shards, [], verify="full")
    assert not result["changed"] and result["ready"] == [s.name for s in shards]
    (dest / ".mlafleet-stamps" / (shards[0].name + ".json")).unlink()
    result = host.stage(str(dest), shards, [])  # an intact shard without its stamp: hashed once, stamped
    assert result["changed"] and result["restamped"] == [shards[0].name] and result["fetched"] == []
    assert host.stage(str(dest), shards, [])["changed"] is False


def test_http_and_path_downloads_are_hashed_on_the_way_in(model, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No second read of a 40 GB shard after its download: the sha256 is computed as bytes arrive."""
    origin, _, shards = model

    def no_rereading(path: str) -> str:
        raise AssertionError(f"re-read {path} to hash it")

    monkeypatch.setattr(host, "sha256_file", no_rereading)
    (tmp_path / "d1").mkdir()
    (tmp_path / "d1" / (shards[0].name + ".partial")).write_bytes((origin / shards[0].name).read_bytes()[:77_777])
    with mirror(origin) as server:
        assert host.stage(str(tmp_path / "d1"), shards, [host.HttpSource(server.url)])["present"] == 3
    assert host.stage(str(tmp_path / "d2"), shards, [host.PathSource(str(origin))])["present"] == 3
    assert_staged(tmp_path / "d1", origin, shards)
    assert_staged(tmp_path / "d2", origin, shards)
