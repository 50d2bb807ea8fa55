"""mlafleet.ops.runner: real ansible-runner runs against the controller itself (connection local).

The playbooks here exercise the rollout_lock and vllm_rollback roles and vllm_install's activation
and prune on a scratch release root, so each test proves a role's behaviour and the runner's report
of it together.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlafleet.ops import runner

LOCK_PLAY = """
- hosts: all
  gather_facts: false
  serial: 1
  tasks:
    - ansible.builtin.include_role:
        name: rollout_lock
      vars:
        rollout_lock_path: "{{ scratch }}/{{ inventory_hostname }}.lock"
        rollout_lock_run: "{{ mlafleet_run }}"
"""

ROLLBACK_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: vllm_rollback
      vars:
        vllm_rollback_root: "{{ scratch }}/{{ inventory_hostname }}"
    - ansible.builtin.copy:
        dest: "{{ scratch }}/{{ inventory_hostname }}.restored"
        content: "{{ vllm_rollback_release_id }}"
        mode: "0644"
      delegate_to: localhost
"""


@pytest.fixture()
def scratch(tmp_path: Path) -> dict[str, Path]:
    inv = tmp_path / "inventory.yml"
    hosts = "".join(f"    {h}: {{ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n"
                    for h in ("h1", "h2"))
    inv.write_text(f"all:\n  vars:\n    scratch: {tmp_path}\n  hosts:\n{hosts}")
    return {"root": tmp_path, "inventory": inv, "runner": tmp_path / "runner", "reports": tmp_path / "reports"}


def run(scratch: dict[str, Path], play: str, run_id: str, command: str = "rollout", **kw) -> dict:
    playbook = scratch["root"] / f"{run_id}.yml"
    playbook.write_text(play)
    out = io.StringIO()
    report = runner.run_playbook(command, [scratch["inventory"]], run=run_id, out=out, playbook=str(playbook),
                                 runner_root=scratch["runner"], report_root=scratch["reports"], **kw)
    report["_out"] = out.getvalue()
    return report


def hosts(report: dict) -> dict[str, dict]:
    return {h["host"]: h for h in report["hosts"]}


def test_lock_taken_then_refused_for_another_run_with_owner_and_age(scratch):
    first = run(scratch, LOCK_PLAY, "run-a")
    assert first["rc"] == 0 and first["status"] == "successful"
    lock = json.loads((scratch["root"] / "h1.lock").read_text())
    assert lock["run"] == "run-a" and "@" in lock["owner"] and abs(lock["time"] - time.time()) < 120

    # The AWX layout of the private data dir, and the report files.
    pdd = scratch["runner"] / "run-a"
    assert not (pdd / "env" / "extravars").exists()  # removed after the run (it may hold secrets)
    assert first["extravars"]["mlafleet_run"] == "run-a"
    assert (pdd / "project").resolve() == runner.REPO
    assert (pdd / "artifacts" / "run-a" / "job_events").is_dir()
    assert json.loads((scratch["reports"] / "run-a" / "run.json").read_text())["rc"] == 0
    assert "h1" in (scratch["reports"] / "run-a" / "summary.txt").read_text()

    second = run(scratch, LOCK_PLAY, "run-b")
    assert second["rc"] != 0
    h1 = hosts(second)["h1"]
    assert h1["status"] == "failed"
    assert "another rollout holds this host" in h1["cause"] and "run run-a" in h1["cause"]
    assert "s ago" in h1["cause"]
    # serial 1 and max_fail_percentage 0 (default): the second host is never reached.
    assert hosts(second)["h2"]["status"] == "not reached"
    assert "FAILED" in second["_out"] and "failed hosts: h1" in second["_out"]
    # The lock still belongs to run-a.
    assert json.loads((scratch["root"] / "h1.lock").read_text())["run"] == "run-a"


def test_stale_lock_reported_then_broken_only_on_request(scratch):
    old = time.time() - 3 * 3600
    (scratch["root"] / "h1.lock").write_text(json.dumps({"owner": "ops@ctl", "run": "old", "time": old}))
    refused = run(scratch, LOCK_PLAY, "run-c", limit="h1")
    cause = hosts(refused)["h1"]["cause"]
    assert refused["rc"] != 0 and "stale lock" in cause and "ops@ctl" in cause and "rollout_lock_break=true" in cause
    age = int(cause.split("(")[-1].split(" s ago")[0]) if "s ago" in cause else -1
    assert 3 * 3600 <= age < 3 * 3600 + 300
    assert json.loads((scratch["root"] / "h1.lock").read_text())["run"] == "old"
    # --limit keeps localhost, where the playbooks fix the release and run ids.
    assert (scratch["runner"] / "run-c" / "env" / "cmdline").read_text().split() == ["--limit", "h1,localhost"]

    broken = run(scratch, LOCK_PLAY, "run-d", limit="h1", extravars={"rollout_lock_break": True})
    assert broken["rc"] == 0
    # Breaking it is a warning naming whose lock it was, live and in the report.
    warning = [w for w in hosts(broken)["h1"]["warnings"] if "broke the stale lock" in w]
    assert warning and "owner ops@ctl" in warning[0] and "run old" in warning[0] and "s ago" in warning[0]
    assert "WARNING" in broken["_out"] and "broke the stale lock of owner ops@ctl, run old" in broken["_out"]
    assert json.loads((scratch["root"] / "h1.lock").read_text())["run"] == "run-d"
    assert set(hosts(broken)) == {"h1"}  # --limit: only h1 is part of the run


def test_release_only_by_its_own_run(scratch):
    run(scratch, LOCK_PLAY, "run-e", limit="h1")
    other = run(scratch, LOCK_PLAY, "run-f", limit="h1", extravars={"rollout_lock_state": "absent"})
    assert other["rc"] != 0 and "not releasing it" in hosts(other)["h1"]["cause"]
    own = run(scratch, LOCK_PLAY.replace('"{{ mlafleet_run }}"', "run-e"), "run-g", limit="h1",
              extravars={"rollout_lock_state": "absent"})
    assert own["rc"] == 0 and not (scratch["root"] / "h1.lock").exists()


def make_release(root: Path, release: str) -> None:
    (root / "releases" / release / "venv" / "bin").mkdir(parents=True)
    (root / "releases" / release / "venv" / "bin" / "python").write_text("")
    (root / "releases" / release / "release.json").write_text(json.dumps({"id": release}))


def test_rollback_role_restores_previous_and_refuses_clearly(scratch):
    h1, h2 = scratch["root"] / "h1", scratch["root"] / "h2"
    for host in (h1, h2):
        make_release(host, "rel-a")
        make_release(host, "rel-b")
        os.symlink("releases/rel-b", host / "current")
    os.symlink("releases/rel-a", h1 / "previous")  # h2 has no previous release

    report = run(scratch, ROLLBACK_PLAY, "rb-1")
    assert os.readlink(h1 / "current") == "releases/rel-a" and os.readlink(h1 / "previous") == "releases/rel-b"
    assert (scratch["root"] / "h1.restored").read_text() == "rel-a"
    assert hosts(report)["h1"]["status"] == "ok"
    # h2: a clear error, and nothing touched.
    assert hosts(report)["h2"]["status"] == "failed"
    assert "no previous release to roll back to" in hosts(report)["h2"]["cause"]
    assert os.readlink(h2 / "current") == "releases/rel-b" and not (h2 / "previous").exists()

    # A named release that is incomplete is refused before anything changes.
    (h1 / "releases" / "rel-b" / "release.json").unlink()
    named = run(scratch, ROLLBACK_PLAY, "rb-2", limit="h1", extravars={"vllm_rollback_to": "rel-b"})
    assert "not a complete release" in hosts(named)["h1"]["cause"] and "release.json" in hosts(named)["h1"]["cause"]
    assert os.readlink(h1 / "current") == "releases/rel-a"


ACTIVATE_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: vllm_install
        tasks_from: activate
      vars:
        vllm_install_root: "{{ scratch }}/{{ inventory_hostname }}"
        vllm_install_release_id: "{{ release }}"
"""
SWITCH_TASK = "vllm_install : Switch current to the release atomically (the old target becomes previous)"


def test_install_activates_with_the_switch_rollback_uses(scratch):
    """vllm_install's activation and vllm_rollback switch through one module (mlafleet_release_switch)."""
    h1 = scratch["root"] / "h1"
    for release in ("rel-a", "rel-b"):
        make_release(h1, release)
    first = run(scratch, ACTIVATE_PLAY, "ac-1", limit="h1", extravars={"release": "rel-a"})
    assert first["rc"] == 0, first["_out"]
    assert os.readlink(h1 / "current") == "releases/rel-a" and not (h1 / "previous").exists()
    assert hosts(first)["h1"]["changed"] == [SWITCH_TASK]

    os.symlink("nowhere", h1 / "current.tmp")  # what an interrupted switch leaves
    second = run(scratch, ACTIVATE_PLAY, "ac-2", limit="h1", extravars={"release": "rel-b"})
    assert second["rc"] == 0, second["_out"]
    assert os.readlink(h1 / "current") == "releases/rel-b" and os.readlink(h1 / "previous") == "releases/rel-a"
    assert sorted(p.name for p in h1.iterdir()) == ["current", "previous", "releases"]

    # Already current: nothing changes. Check mode reports the switch and makes none.
    again = run(scratch, ACTIVATE_PLAY, "ac-3", limit="h1", extravars={"release": "rel-b"})
    assert again["rc"] == 0 and hosts(again)["h1"]["changed"] == [], again["_out"]
    planned = run(scratch, ACTIVATE_PLAY, "ac-4", command="plan", limit="h1", extravars={"release": "rel-a"})
    assert planned["rc"] == 0 and planned["check"] and hosts(planned)["h1"]["changed"] == [SWITCH_TASK]
    assert os.readlink(h1 / "current") == "releases/rel-b" and os.readlink(h1 / "previous") == "releases/rel-a"

    # A release that is not there is refused, and the links stay as they were.
    missing = run(scratch, ACTIVATE_PLAY, "ac-5", limit="h1", extravars={"release": "rel-x"})
    assert hosts(missing)["h1"]["status"] == "failed"
    assert "releases/rel-x is not a directory; nothing was changed" in hosts(missing)["h1"]["cause"]
    assert os.readlink(h1 / "current") == "releases/rel-b" and os.readlink(h1 / "previous") == "releases/rel-a"

    # The rollback role, through the same module, swaps them back.
    back = run(scratch, ROLLBACK_PLAY, "ac-6", limit="h1")
    assert hosts(back)["h1"]["status"] == "ok", back["_out"]
    assert os.readlink(h1 / "current") == "releases/rel-a" and os.readlink(h1 / "previous") == "releases/rel-b"


def test_bad_input_named_and_nothing_started(scratch, tmp_path):
    with pytest.raises(runner.RunnerError, match="inventory .* not found"):
        runner.run_playbook("rollout", [tmp_path / "missing.yml"], runner_root=scratch["runner"])
    with pytest.raises(runner.RunnerError, match="unknown command"):
        runner.run_playbook("deploy", [scratch["inventory"]], runner_root=scratch["runner"])
    with pytest.raises(runner.RunnerError, match="run id"):
        runner.run_playbook("rollout", [scratch["inventory"]], run="a b/c", runner_root=scratch["runner"])
    assert not scratch["runner"].exists()
    with pytest.raises(runner.RunnerError, match="KEY=VALUE"):
        runner.parse_extra_vars(["novalue"])
    with pytest.raises(runner.RunnerError, match="not found"):
        runner.parse_extra_vars(["@/nonexistent.yml"])
    with pytest.raises(runner.RunnerError, match="prepend a file name with '@'"):
        runner.parse_extra_vars(["./vars.yml"])
    with pytest.raises(runner.RunnerError, match="extra vars"):
        runner.parse_extra_vars(["{not: [closed"])
    assert runner.parse_serial('[1, "25%"]') == [1, "25%"]


def test_run_id_is_not_reused(scratch):
    run(scratch, LOCK_PLAY, "dup", limit="h1")
    with pytest.raises(runner.RunnerError, match="already has a private data directory"):
        run(scratch, LOCK_PLAY, "dup", limit="h1")


# -e: the CLI and ansible-playbook read the same options into the same values.
SHOW_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.copy:
        dest: "{{ out }}"
        mode: "0644"
        content: "{{ {'version': vllm_install_version, 'version_type': vllm_install_version | type_debug,
                      'serial': mlafleet_serial, 'n': n, 'flag': flag, 'a': a, 'b': b, 'spaced': spaced} | to_json }}"
"""


def test_extra_vars_mean_what_ansible_playbook_reads(scratch, tmp_path):
    (tmp_path / "vars.yml").write_text("flag: yes\nn: 7\n")
    options = ["vllm_install_version=0.20", '{"mlafleet_serial": [1, "25%"], "n": 3}', f"@{tmp_path / 'vars.yml'}",
               "a=1 b=two spaced='x y'"]
    playbook = tmp_path / "show.yml"
    playbook.write_text(SHOW_PLAY)
    direct = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                             str(playbook), "-e", f"out={tmp_path / 'direct.json'}", "-e", f"ansible_python_interpreter={sys.executable}",
                             *[arg for o in options for arg in ("-e", o)]],
                            capture_output=True, text=True, check=False, timeout=120)
    assert direct.returncode == 0, direct.stdout[-2000:]
    extravars = runner.parse_extra_vars(options + [f"out={tmp_path / 'cli.json'}"])
    report = run(scratch, SHOW_PLAY, "ev-1", extravars=extravars)
    assert report["rc"] == 0, report["_out"]
    cli = json.loads((tmp_path / "cli.json").read_text())
    assert cli == json.loads((tmp_path / "direct.json").read_text())
    assert cli["version"] == "0.20" and cli["version_type"] in ("str", "AnsibleUnicode")
    assert cli["serial"] == [1, "25%"] and cli["n"] == 7 and cli["flag"] is True
    assert (cli["a"], cli["b"], cli["spaced"]) == ("1", "two", "x y")


# Secrets: masked in the reports and the live output, extravars gone, private modes.
LEAK_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.fail:
        msg: "cannot reach the hub with token {{ weights_hub_token }} (key {{ vllm_server_api_key }})"
"""


def test_secrets_never_land_in_reports(scratch):
    token, key = "hf_LeakedToken0123456789", "sk-LeakedApiKey987"
    report = run(scratch, LEAK_PLAY, "sec-1", limit="h1",
                 extravars=runner.parse_extra_vars([f"weights_hub_token={token}",
                                                    json.dumps({"vllm_server_api_key": key}), "x=3"]))
    assert report["rc"] != 0
    report_dir = scratch["reports"] / "sec-1"
    pdd = scratch["runner"] / "sec-1"
    written = (report_dir / "run.json").read_text() + (report_dir / "summary.txt").read_text() + report["_out"]
    assert token not in written and key not in written
    assert "cannot reach the hub with token ********" in hosts(report)["h1"]["cause"]
    assert report["extravars"]["weights_hub_token"] == "********" and report["extravars"]["x"] == "3"
    assert not (pdd / "env" / "extravars").exists()
    assert (pdd.stat().st_mode & 0o777) == 0o700 and (report_dir.stat().st_mode & 0o777) == 0o700
    for path in (report_dir / "run.json", report_dir / "summary.txt", pdd / "env" / "envvars"):
        assert (path.stat().st_mode & 0o777) == 0o600, path


def test_every_report_and_artifact_file_is_private(scratch):
    """What the docs promise: 0600 files in 0700 directories, the HTML report, the timeline and
    ansible-runner's artifacts (its stdout, job events, command line) included."""
    report = run(scratch, LOCK_PLAY, "modes-1")
    assert report["rc"] == 0, report["_out"]
    report_dir, pdd = scratch["reports"] / "modes-1", scratch["runner"] / "modes-1"
    written = {p.name for p in report_dir.iterdir()}
    assert {"run.json", "summary.txt", "timeline.json", "index.html"} <= written, written
    assert (pdd / "artifacts" / "modes-1" / "stdout").is_file()
    loose = []
    for root in (report_dir, pdd):
        for path in [root, *root.rglob("*")]:
            if path.is_symlink():
                continue
            want = 0o700 if path.is_dir() else 0o600
            if path.stat().st_mode & 0o777 != want:
                loose.append(f"{path} {oct(path.stat().st_mode & 0o777)}")
    assert not loose, loose


def test_one_exit_status_in_the_cli_the_summary_and_the_html(scratch, capsys, monkeypatch):
    """The CLI's exit status is the `exit` its summary and the HTML header print; ansible-playbook's
    own return code is named as such."""
    from mlafleet.cli import main

    playbook = scratch["root"] / "fail.yml"
    playbook.write_text(LEAK_PLAY.replace("{{ weights_hub_token }} (key {{ vllm_server_api_key }})", "x"))
    monkeypatch.setenv("MLAFLEET_RUNNER_ROOT", str(scratch["runner"]))
    monkeypatch.setenv("MLAFLEET_REPORT_ROOT", str(scratch["reports"]))
    code = main(["rollout", "-i", str(scratch["inventory"]), "--limit", "h1", "--run", "ex-1", "--playbook", str(playbook)])
    out = capsys.readouterr().out
    report = json.loads((scratch["reports"] / "ex-1" / "run.json").read_text())
    assert code == 1 and report["rc"] == 1 and report["playbook_rc"] == 2
    assert "mlafleet rollout  run ex-1  exit 1 (ansible-playbook rc 2)  status failed" in out
    html = (scratch["reports"] / "ex-1" / "index.html").read_text()
    assert "exit status 1 (ansible-playbook rc 2)" in html and "exit status 2" not in html


# Live progress: the real task per host, a heartbeat on a long step, the failure cause whole.
PROGRESS_PLAY = LOCK_PLAY.replace("  serial: 1\n", "") + """\
    - name: Wait for the slow step
      ansible.builtin.command: sleep 3
      changed_when: false
    - name: Fail with a long cause
      ansible.builtin.fail:
        msg: "Make sure this host can be reached over ssh: {{ 'the whole detail after the colon, ' * 8 }}end of cause"
      when: inventory_hostname == 'h1'
"""


def test_progress_shows_real_tasks_heartbeats_and_whole_causes(scratch):
    report = run(scratch, PROGRESS_PLAY, "pg-1", heartbeat_s=1.0)
    out = report["_out"]
    assert "Validating arguments" not in out
    assert "rollout_lock     Take or release the rollout lock" in out
    beats = [ln for ln in out.splitlines() if "Wait for the slow step (still running," in ln]
    assert beats and all("on this step)" in ln for ln in beats), out
    assert {ln.split("] ", 1)[1].split()[0] for ln in beats} <= {"h1", "h2"}, beats
    whole = "Make sure this host can be reached over ssh: " + "the whole detail after the colon, " * 8 + "end of cause"
    assert whole in out and whole in hosts(report)["h1"]["cause"]


def test_unreachable_cause_is_whole(scratch, tmp_path):
    inv = tmp_path / "dead.yml"
    inv.write_text("all:\n  hosts:\n    dead: {ansible_host: 127.0.0.1, ansible_port: 1, ansible_connection: ssh}\n")
    playbook = tmp_path / "ping.yml"
    playbook.write_text("- hosts: all\n  gather_facts: false\n  tasks:\n    - ansible.builtin.ping:\n")
    out = io.StringIO()
    report = runner.run_playbook("rollout", [inv], run="dead-1", out=out, playbook=str(playbook),
                                 runner_root=scratch["runner"], report_root=scratch["reports"])
    dead = hosts(report)["dead"]
    assert dead["status"] == "unreachable"
    assert "port 1: Connection refused" in dead["cause"] and "port 1: Connection refused" in out.getvalue()


def test_message_keeps_every_part():
    assert runner._message({"msg": "non-zero return code", "stderr": "E: disk full", "stdout": "ignored"}) == \
        "non-zero return code E: disk full"
    assert runner._message({"msg": "", "stdout": "only stdout"}) == "only stdout"
    dropped = runner._message({"msg": 'Data could not be sent to remote host "h". Make sure this host can be '
                                      "reached over ssh:"})
    assert dropped.endswith("the connection dropped, e.g. the host stopped or lost its network)")


PRUNE_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: vllm_install
        tasks_from: prune
      vars:
        vllm_install_root: "{{ scratch }}/{{ inventory_hostname }}"
        vllm_install_keep_releases: 0
"""


def test_prune_removes_what_an_interrupted_run_left(scratch):
    h1 = scratch["root"] / "h1"
    make_release(h1, "rel-a")
    os.symlink("releases/rel-a", h1 / "current")
    (h1 / "releases" / "rel-lost" / "venv" / "bin").mkdir(parents=True)  # interrupted: no release.json
    (h1 / "wheelhouse" / "vllm-0.20.2").mkdir(parents=True)
    (h1 / "wheelhouse" / "vllm-0.20.2" / "x.whl").write_text("")
    (h1 / "releases" / "rel-b").mkdir()  # current's target is never removed, marker or not
    os.unlink(h1 / "current")
    os.symlink("releases/rel-b", h1 / "current")
    report = run(scratch, PRUNE_PLAY, "pr-1", limit="h1")
    assert report["rc"] == 0, report["_out"]
    assert sorted(p.name for p in (h1 / "releases").iterdir()) == ["rel-a", "rel-b"]
    assert list((h1 / "wheelhouse").iterdir()) == []
    assert "vllm_install : Remove them" in hosts(report)["h1"]["changed"]
    # Nothing left (an empty wheelhouse, no releases directory matching): nothing to do, no error.
    again = run(scratch, PRUNE_PLAY, "pr-2", limit="h1")
    assert again["rc"] == 0 and hosts(again)["h1"]["changed"] == [], again["_out"]
    (h1 / "wheelhouse").rmdir()
    assert run(scratch, PRUNE_PLAY, "pr-3", limit="h1")["rc"] == 0


def test_rollback_playbook_reports_every_failure(scratch, tmp_path):
    """rollback.yml itself (through `mlafleet rollback`): each refused host gets its report, 0600."""
    root = tmp_path / "fleet"
    for host in ("nop", "inc", "held"):
        make_release(root / host, "rel-b")
        os.symlink("releases/rel-b", root / host / "current")
    (root / "inc" / "releases" / "rel-a").mkdir()  # previous points at an incomplete release
    os.symlink("releases/rel-a", root / "inc" / "previous")
    make_release(root / "held", "rel-a")
    os.symlink("releases/rel-a", root / "held" / "previous")
    (root / "held" / ".lock").write_text(json.dumps({"owner": "ops@ctl", "run": "other", "time": time.time()}))
    inv = tmp_path / "fleet.yml"
    inv.write_text("all:\n  vars:\n    ansible_become: false\n    ansible_connection: local\n"
                   f"    ansible_python_interpreter: {sys.executable}\n"
                   f"    vllm_rollback_root: \"{root}/{{{{ inventory_hostname }}}}\"\n"
                   f"    rollout_lock_path: \"{root}/{{{{ inventory_hostname }}}}/.lock\"\n"
                   "  hosts:\n    nop: {}\n    inc: {}\n    held: {}\n")
    run_id = f"test-rbp-{os.getpid()}-{int(time.time())}"
    reports = runner.REPO / "reports" / run_id  # where the playbooks write their host reports
    try:
        report = runner.run_playbook("rollback", [inv], run=run_id, out=io.StringIO(), runner_root=scratch["runner"])
        written = {h: json.loads((reports / f"{h}.json").read_text()) for h in ("nop", "inc", "held")}
        modes = {(reports / f"{h}.json").stat().st_mode & 0o777 for h in written}
    finally:
        shutil.rmtree(reports, ignore_errors=True)
    got = hosts(report)
    assert {h: got[h]["status"] for h in got} == {"nop": "failed", "inc": "failed", "held": "failed"}
    assert all(r["ok"] is False for r in written.values())
    assert "no previous release to roll back to" in written["nop"]["cause"]
    assert "not a complete release" in written["inc"]["cause"] and "release.json" in written["inc"]["cause"]
    assert "another rollout holds this host" in written["held"]["cause"] and "run other" in written["held"]["cause"]
    assert modes == {0o600}
    assert "no previous release to roll back to" in got["nop"]["cause"]  # the CLI's cause, from the report
    # Nothing changed: links as they were, the other run's lock untouched, no lock left by this run.
    assert os.readlink(root / "inc" / "current") == "releases/rel-b" and not (root / "nop" / ".lock").exists()
    assert json.loads((root / "held" / ".lock").read_text())["run"] == "other"


def test_a_rollback_takes_batch_sizes_too():
    # one backend at a time keeps a front door serving through a rollback (docs/front-door.md)
    from mlafleet.cli import build_parser

    args = build_parser().parse_args(["rollback", "-i", "inv", "--serial", "1", "--to", "r1"])
    assert (args.serial, args.to) == ("1", "r1")
    assert build_parser().parse_args(["rollback", "-i", "inv"]).serial is None
