"""The weights role: its fan-out plan, and real ansible-playbook runs on the controller itself.

The two-host peer fan-out over SSH runs in the molecule scenario `roles` (its weights part); here the role runs on
localhost (connection local) with a path source and a hub source, which exercises its templates,
its modules, check mode, idempotence and the hub token's absence from Ansible's output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from weights_support import TOKEN, hub, mirror, write_model

from mlafleet.weights import shards as weights

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "plugins" / "filter" / "weights_fanout.py"
_spec = importlib.util.spec_from_file_location("weights_fanout", PLUGIN)
fanout_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fanout_module)
fanout = fanout_module.fanout


def test_fanout_doubles_the_holders_each_wave() -> None:
    hosts = [f"h{i}" for i in range(8)]
    plan = fanout(hosts, 1)
    assert [plan[h]["wave"] for h in hosts] == [0, 1, 2, 2, 3, 3, 3, 3]
    assert [plan[h]["peer"] for h in hosts] == [None, "h0", "h0", "h1", "h0", "h1", "h2", "h3"]


def test_fanout_with_two_origins() -> None:
    plan = fanout(["a", "b", "c", "d", "e"], 2)
    assert plan == {"a": {"wave": 0, "peer": None}, "b": {"wave": 0, "peer": None},
                    "c": {"wave": 1, "peer": "a"}, "d": {"wave": 1, "peer": "b"},
                    "e": {"wave": 2, "peer": "a"}}


@pytest.mark.parametrize("count, origins", [(1, 1), (2, 1), (7, 1), (100, 3), (33, 8)])
def test_fanout_every_peer_holds_the_shards_before_it_serves(count: int, origins: int) -> None:
    hosts = [f"h{i}" for i in range(count)]
    plan = fanout(hosts, origins)
    assert sum(1 for h in hosts if plan[h]["peer"] is None) == min(origins, count)
    for host in hosts:
        peer = plan[host]["peer"]
        if peer is not None:
            assert plan[peer]["wave"] < plan[host]["wave"]
    served = [(plan[h]["peer"], plan[h]["wave"]) for h in hosts if plan[h]["peer"]]
    assert len(served) == len(set(served))  # a holder serves one host per wave
    waves = max(p["wave"] for p in plan.values()) + 1
    assert origins * 2 ** (waves - 1) >= count > (origins * 2 ** (waves - 2) if waves > 1 else 0)


def test_fanout_disabled_and_bad_input() -> None:
    assert {p["wave"] for p in fanout(["a", "b", "c"], 1, enabled=False).values()} == {0}
    with pytest.raises(ValueError, match="positive integer"):
        fanout(["a"], 0)
    with pytest.raises(ValueError, match="duplicate hosts"):
        fanout(["a", "a"], 1)


PLAYBOOK = """\
- name: Stage weights on the controller
  hosts: all
  gather_facts: false
  roles:
    - role: weights
"""


def run_role(tmp_path: Path, extra: dict, *args: str, stdout_callback: str = "json") -> tuple[subprocess.CompletedProcess, dict]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAYBOOK)
    extra_file = tmp_path / "extra.json"
    extra_file.write_text(json.dumps({"ansible_python_interpreter": sys.executable, **extra}))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_STDOUT_CALLBACK": stdout_callback,
           # the role calls the collection's modules and filters by name (mlafleet.fleet.weights_stage)
           "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_DEPRECATION_WARNINGS": "0"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"@{extra_file}", *args, str(playbook)],
                          capture_output=True, text=True, env=env, check=False, timeout=300)
    try:
        stats = json.loads(done.stdout[done.stdout.index("{"):])["stats"]["localhost"]
    except (ValueError, KeyError):
        stats = {}
    return done, stats


@pytest.fixture()
def staged_setup(tmp_path: Path) -> tuple[Path, Path]:
    origin = tmp_path / "origin"
    write_model(origin, shards=3)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(weights.build_manifest(origin)))
    return origin, manifest


def test_role_stages_merges_and_reruns_without_change(staged_setup, tmp_path: Path) -> None:
    origin, manifest = staged_setup
    dest = tmp_path / "models"
    extra = {"weights_manifest": str(manifest), "weights_source": "path",
             "weights_path": str(origin), "weights_root": str(dest), "weights_reserve_mb": 0,
             "weights_gguf_merge": True}

    done, stats = run_role(tmp_path, extra, "--check")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert stats["changed"] >= 1 and not (dest / "tiny-glm").exists()

    done, stats = run_role(tmp_path, extra)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert stats["changed"] >= 2 and stats["failures"] == 0
    for shard in json.loads(manifest.read_text())["shards"]:
        assert (dest / "tiny-glm" / shard["name"]).read_bytes() == (origin / shard["name"]).read_bytes()
    assert (dest / "tiny-glm" / "tiny-glm.gguf").read_bytes()[:4] == b"GGUF"
    assert "all 3 of 3 shards verified" in done.stdout

    done, stats = run_role(tmp_path, extra)
    assert done.returncode == 0 and stats["changed"] == 0, done.stdout[-3000:]
    done, stats = run_role(tmp_path, extra, "--check")
    assert done.returncode == 0 and stats["changed"] == 0, done.stdout[-3000:]


def test_a_corrupt_chunk_is_named_and_fetched_again_at_the_default_verbosity(staged_setup, tmp_path: Path) -> None:
    """A shard whose stamp matches but whose bytes changed (one flipped byte, size and mtime kept):
    the spot check's line names it corrupt with its chunk and says it was fetched again."""
    origin, manifest = staged_setup
    dest = tmp_path / "models"
    extra = {"weights_manifest": str(manifest), "weights_source": "path",
             "weights_path": str(origin), "weights_root": str(dest), "weights_reserve_mb": 0}
    done, _ = run_role(tmp_path, extra)
    assert done.returncode == 0, done.stdout[-3000:]
    shard = dest / "tiny-glm" / "tiny-glm-00002-of-00003.gguf"
    st = shard.stat()
    with open(shard, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    done, _ = run_role(tmp_path, extra, stdout_callback="default")
    assert done.returncode == 0, done.stdout[-3000:]
    text = " ".join(done.stdout.split())  # the output as read, wrapped lines joined
    line = text[text.index("spot check:"):][:300]
    assert "read and verified" not in line, line
    assert "2 verified, 1 corrupt: tiny-glm-00002-of-00003.gguf chunk 0 (of 1), fetched again" in line, line
    assert "1 fetched (path:" in text and "2 already verified" in text
    assert shard.read_bytes() == (origin / shard.name).read_bytes()


def test_role_refuses_a_missing_shard(staged_setup, tmp_path: Path) -> None:
    origin, manifest = staged_setup
    (origin / "tiny-glm-00002-of-00003.gguf").unlink()
    extra = {"weights_manifest": str(manifest), "weights_source": "path", "weights_path": str(origin),
             "weights_root": str(tmp_path / "models"), "weights_reserve_mb": 0, "weights_retries": 0}
    done, stats = run_role(tmp_path, extra)
    assert done.returncode != 0 and stats["failures"] == 1
    assert "tiny-glm-00002-of-00003.gguf: the shard is missing at the source" in done.stdout


def test_role_hub_token_never_reaches_ansible_output(staged_setup, tmp_path: Path) -> None:
    origin, manifest = staged_setup
    with mirror(origin) as cdn, hub(cdn.url) as hub_server:
        extra = {"weights_manifest": str(manifest), "weights_source": "hub",
                 "weights_hub_endpoint": hub_server.url, "weights_hub_repo": "zai-org/GLM-5-GGUF",
                 "weights_hub_token": TOKEN, "weights_root": str(tmp_path / "models"), "weights_hub_revision": "ab" * 20,
                 "weights_reserve_mb": 0}
        done, stats = run_role(tmp_path, extra, "-vvv")
        assert done.returncode == 0, done.stdout[-3000:]
        assert len(hub_server.seen) == 3 and all(auth == f"Bearer {TOKEN}" for _, auth in hub_server.seen)
        assert TOKEN not in done.stdout + done.stderr

        extra["weights_hub_token"] = TOKEN + "-revoked"
        extra["weights_root"] = str(tmp_path / "other")
        extra["weights_retries"] = 0
        done, _ = run_role(tmp_path, extra, "-vvv")
        assert done.returncode != 0 and "HTTP 401" in done.stdout
        assert TOKEN not in done.stdout + done.stderr


def test_role_argument_spec_names_bad_input(tmp_path: Path) -> None:
    done, _ = run_role(tmp_path, {"weights_manifest": "/x.json", "weights_source": "ftp"})
    assert done.returncode != 0 and "weights_source" in done.stdout and "ftp" in done.stdout


@pytest.mark.parametrize("change, message", [
    ({"model": "../../../evil"}, "manifest model '../../../evil' is not a plain name"),
    ({"model": "/tmp/evil"}, "manifest model '/tmp/evil' is not a plain name"),
    ({"split_count": 4}, "manifest lists 3 shards of 3, split_count says 4: the shard list is incomplete"),
    ({"drop_last": True, "split_count": 2}, "does not list shards 1..3 of 3 exactly once (missing [3]"),
    ({"rename_first": "../tiny-glm-00001-of-00003.gguf"}, "is not of the form <model>-0000K-of-0000N.gguf"),
])
def test_role_refuses_bad_manifest_names_before_anything_is_created(staged_setup, tmp_path: Path, change: dict,
                                                                     message: str) -> None:
    origin, manifest_path = staged_setup
    manifest = json.loads(manifest_path.read_text())
    if change.pop("drop_last", False):
        del manifest["shards"][-1]
    if "rename_first" in change:
        manifest["shards"][0]["name"] = change.pop("rename_first")
    manifest.update(change)
    bad = tmp_path / "bad-manifest.json"
    bad.write_text(json.dumps(manifest))
    root = tmp_path / "a" / "b" / "c" / "models"
    extra = {"weights_manifest": str(bad), "weights_source": "path", "weights_path": str(origin),
             "weights_root": str(root), "weights_reserve_mb": 0}
    done, stats = run_role(tmp_path, extra)
    assert done.returncode != 0 and stats["failures"] == 1
    assert message in done.stdout and "nothing was created" in done.stdout
    assert not (tmp_path / "a").exists() and not (tmp_path / "evil").exists()
