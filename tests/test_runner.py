"""mlafleet.runner: real ansible-runner runs against the controller itself (connection local).

The playbooks here exercise the rollout_lock and vllm_rollback roles on a scratch release root,
so each test proves a role's behaviour and the runner's report of it together.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

import pytest

from mlafleet import runner

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


def run(scratch: dict[str, Path], play: str, run_id: str, **kw) -> dict:
    playbook = scratch["root"] / f"{run_id}.yml"
    playbook.write_text(play)
    out = io.StringIO()
    report = runner.run_playbook("rollout", [scratch["inventory"]], run=run_id, out=out, playbook=str(playbook),
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
    assert json.loads((pdd / "env" / "extravars").read_text())["mlafleet_run"] == "run-a"
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
    assert runner.parse_extra_vars(["mlafleet_serial=[1, '25%']", "x=3"]) == {"mlafleet_serial": [1, "25%"], "x": 3}


def test_run_id_is_not_reused(scratch):
    run(scratch, LOCK_PLAY, "dup", limit="h1")
    with pytest.raises(runner.RunnerError, match="already has a private data directory"):
        run(scratch, LOCK_PLAY, "dup", limit="h1")
