"""The served state (release + server configuration revision) and exact rollback (issue 39).

The module plugins/modules/mlafleet_release_switch.py runs here as Ansible runs it on a host
(its file with ANSIBLE_MODULE_ARGS on stdin's JSON), on scratch release roots; the
vllm_rollback role runs through the real ansible-runner (mlafleet.ops.runner) with a local
connection.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlafleet.ops import runner

REPO = Path(__file__).resolve().parent.parent
MODULE = REPO / "plugins" / "modules" / "mlafleet_release_switch.py"
GROUP = __import__("grp").getgrgid(os.getgid()).gr_name


def switch(root: Path, release: str, **params) -> dict:
    args = {"ANSIBLE_MODULE_ARGS": {"root": str(root), "release": release, "server_group": GROUP, **params}}
    done = subprocess.run([sys.executable, str(MODULE)], input=json.dumps(args), capture_output=True, text=True,
                          check=False, timeout=60)
    out = json.loads(done.stdout)
    return out


def make_release(root: Path, release: str) -> None:
    (root / "releases" / release / "venv" / "bin").mkdir(parents=True)
    (root / "releases" / release / "venv" / "bin" / "python").write_text("")
    (root / "releases" / release / "release.json").write_text(json.dumps({"id": release}))


def server(args: str, key: str = "") -> dict[str, str]:
    return {"serve": f"#!/bin/sh\nexec python -m vllm {args}\n", "vllm.env": f"VLLM_API_KEY={key}\n"}


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_a_configuration_change_is_a_new_revision_and_the_old_one_stays_byte_for_byte(tmp_path: Path) -> None:
    make_release(tmp_path, "rel-a")
    first = switch(tmp_path, "rel-a", server=server("--max-num-seqs=64", key="k1"))
    assert first["changed"] and first["state"] == f"rel-a@{first['revision']}" and first["before"] is None
    assert os.readlink(tmp_path / "current") == "releases/rel-a"
    assert os.readlink(tmp_path / "releases" / "rel-a" / "server") == f"server.d/{first['revision']}"
    assert not (tmp_path / "previous").exists()  # nothing was served before
    served = digest(tmp_path / "current" / "server")

    again = switch(tmp_path, "rel-a", server=server("--max-num-seqs=64", key="k1"))
    assert not again["changed"] and again["revision"] == first["revision"]  # the same bytes: nothing to do

    changed = switch(tmp_path, "rel-a", server=server("--max-num-seqs=1", key="k1"))
    assert changed["changed"] and changed["revision"] != first["revision"]
    assert changed["before"] == first["state"]
    # previous names the state served before: the same release with its old configuration
    assert os.readlink(tmp_path / "previous") == f"releases/rel-a/server.d/{first['revision']}"
    assert digest(tmp_path / "releases" / "rel-a" / "server.d" / first["revision"]) == served
    assert "--max-num-seqs=1" in (tmp_path / "current" / "server" / "serve").read_text()
    # the key is in the env file only (0640), never in the module's result
    assert "k1" not in json.dumps(changed)
    assert oct((tmp_path / "current" / "server" / "vllm.env").stat().st_mode & 0o777) == "0o640"

    # a key change alone is a new revision too
    keyed = switch(tmp_path, "rel-a", server=server("--max-num-seqs=1", key="k2"))
    assert keyed["changed"] and keyed["revision"] not in (first["revision"], changed["revision"])


def test_a_new_release_makes_the_old_state_previous_and_its_first_configuration_keeps_it(tmp_path: Path) -> None:
    make_release(tmp_path, "rel-a")
    make_release(tmp_path, "rel-b")
    a = switch(tmp_path, "rel-a", server=server("--a"))
    activated = switch(tmp_path, "rel-b")  # vllm_install's activation: no configuration yet
    assert activated["changed"] and activated["revision"] is None
    assert os.readlink(tmp_path / "previous") == f"releases/rel-a/server.d/{a['revision']}"
    b = switch(tmp_path, "rel-b", server=server("--b"))
    assert b["changed"] and b["before"] == "rel-b"
    # the new release's first configuration does not make "rel-b without configuration" previous
    assert os.readlink(tmp_path / "previous") == f"releases/rel-a/server.d/{a['revision']}"


def test_restoring_puts_back_release_revision_and_previous_exactly_and_marks_the_attempt_rejected(tmp_path: Path) -> None:
    for r in ("rel-0", "rel-a"):
        make_release(tmp_path, r)
    zero = switch(tmp_path, "rel-0", server=server("--zero"))
    good = switch(tmp_path, "rel-a", server=server("--good"))
    before = {"previous": os.readlink(tmp_path / "previous"), "current": os.readlink(tmp_path / "current"),
              "server": digest(tmp_path / "current" / "server")}
    assert before["previous"] == f"releases/rel-0/server.d/{zero['revision']}"
    bad = switch(tmp_path, "rel-a", server=server("--max-num-seqs=1"))  # the attempt
    assert os.readlink(tmp_path / "previous") == f"releases/rel-a/server.d/{good['revision']}"

    back = switch(tmp_path, "rel-a", revision=good["revision"], previous=before["previous"],
                  reject={"release": "rel-a", "revision": bad["revision"], "cause": "perf gate: TTFT p50 +3700%",
                          "run": "r42"})
    assert back["changed"] and back["state"] == good["state"]
    assert os.readlink(tmp_path / "previous") == before["previous"]  # not the rejected attempt
    assert os.readlink(tmp_path / "current") == before["current"]
    assert digest(tmp_path / "current" / "server") == before["server"]
    mark = json.loads((tmp_path / "releases" / "rel-a" / "server.d" / bad["revision"] / "rejected.json").read_text())
    assert mark["cause"].startswith("perf gate") and mark["run"] == "r42"


def test_a_plain_server_directory_of_an_older_mlafleet_becomes_a_revision_with_the_same_bytes(tmp_path: Path) -> None:
    make_release(tmp_path, "rel-old")
    make_release(tmp_path, "rel-new")
    legacy = tmp_path / "releases" / "rel-old" / "server"
    legacy.mkdir()
    (legacy / "serve").write_text("#!/bin/sh\nexec old\n")
    (legacy / "vllm.env").write_text("A=1\n")
    old_bytes = digest(legacy)
    os.symlink("releases/rel-old", tmp_path / "current")
    switch(tmp_path, "rel-new", server=server("--new"))
    previous = os.readlink(tmp_path / "previous")
    assert previous.startswith("releases/rel-old/server.d/")
    assert (tmp_path / "releases" / "rel-old" / "server").is_symlink()
    assert digest(tmp_path / previous) == old_bytes


def test_a_missing_revision_or_release_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    make_release(tmp_path, "rel-a")
    first = switch(tmp_path, "rel-a", server=server("--a"))
    links = {n: os.readlink(tmp_path / n) for n in ("current",)}
    out = switch(tmp_path, "rel-a", revision="0123456789ab")
    assert out.get("failed") and "no server configuration revision 0123456789ab" in out["msg"]
    out = switch(tmp_path, "rel-zzz")
    assert out.get("failed") and "is not a directory" in out["msg"]
    assert {n: os.readlink(tmp_path / n) for n in ("current",)} == links
    assert os.readlink(tmp_path / "releases" / "rel-a" / "server") == f"server.d/{first['revision']}"


ROLLBACK_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: vllm_rollback
      vars:
        vllm_rollback_root: "{{ scratch }}/{{ inventory_hostname }}"
"""


@pytest.fixture()
def scratch(tmp_path: Path) -> dict[str, Path]:
    inv = tmp_path / "inventory.yml"
    inv.write_text(f"all:\n  vars:\n    scratch: {tmp_path}\n  hosts:\n"
                   f"    h1: {{ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n")
    return {"root": tmp_path, "inventory": inv}


def rollback(scratch: dict[str, Path], run_id: str, **kw) -> dict:
    playbook = scratch["root"] / f"{run_id}.yml"
    playbook.write_text(ROLLBACK_PLAY)
    return runner.run_playbook("rollback", [scratch["inventory"]], run=run_id, out=io.StringIO(),
                               playbook=str(playbook), runner_root=scratch["root"] / "runner",
                               report_root=scratch["root"] / "reports", **kw)


def test_rollback_goes_to_the_last_good_state_and_refuses_a_rejected_previous(scratch) -> None:
    h1 = scratch["root"] / "h1"
    make_release(h1, "rel-a")
    r1 = switch(h1, "rel-a", server=server("--good-1"))
    r2 = switch(h1, "rel-a", server=server("--good-2"))  # a configuration change that passed
    done = rollback(scratch, "back-1")
    assert done["rc"] == 0, done["hosts"]
    # previous was the same release's earlier configuration: served again
    assert os.readlink(h1 / "releases" / "rel-a" / "server") == f"server.d/{r1['revision']}"
    assert os.readlink(h1 / "previous") == f"releases/rel-a/server.d/{r2['revision']}"

    # previous marked rejected (by hand here; a failed rollout writes the same mark): refused, nothing changes
    mark = h1 / "releases" / "rel-a" / "server.d" / r2["revision"] / "rejected.json"
    mark.write_text(json.dumps({"cause": "perf gate: TTFT p50 up", "run": "r9"}))
    refused = rollback(scratch, "back-2")
    cause = refused["hosts"][0]["cause"]
    assert refused["rc"] != 0 and "was rejected" in cause and "perf gate: TTFT p50 up" in cause
    assert f"rollback_to=rel-a@{r2['revision']}" in cause
    assert os.readlink(h1 / "releases" / "rel-a" / "server") == f"server.d/{r1['revision']}"
    # named explicitly, it is served anyway
    named = rollback(scratch, "back-3", extravars={"vllm_rollback_to": f"rel-a@{r2['revision']}"})
    assert named["rc"] == 0, named["hosts"]
    assert os.readlink(h1 / "releases" / "rel-a" / "server") == f"server.d/{r2['revision']}"


def test_the_html_report_names_the_rejected_state_and_the_checksums_before_and_after(tmp_path: Path) -> None:
    import shutil

    from ansible_collections.mlafleet.fleet.plugins.plugin_utils import report

    run_dir = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "data" / "rollout-report", run_dir)
    host = "mlafleet-molecule-rollout-3"
    data = json.loads((run_dir / f"{host}.json").read_text())
    sums = {"serve": "a" * 64, "vllm.env": "b" * 64, "vllm": "c" * 64}
    data.update(rejected="rollout-b@0123456789ab", served_same=True,
                served_before={"state": "rel-a@aaaaaaaaaaaa", "checksums": sums},
                served_after={"state": "rel-a@aaaaaaaaaaaa", "checksums": dict(sums)})
    (run_dir / f"{host}.json").write_text(json.dumps(data))
    html = report.render(run_dir).read_text()
    section = html.split(f'id="host-{host}"')[1].split("<section")[0]
    assert "rollout-b@0123456789ab</strong>, is marked" in section and "rejected" in section
    assert "byte for byte the same" in section and section.count("a" * 16) == 2
    data.update(served_same=False, served_after={"checksums": {**sums, "serve": "d" * 64}})
    (run_dir / f"{host}.json").write_text(json.dumps(data))
    section = report.render(run_dir).read_text().split(f'id="host-{host}"')[1].split("<section")[0]
    assert "different" in section and "d" * 16 in section


def test_a_skipped_perf_gate_is_named_with_its_reason_in_the_html_report(tmp_path: Path) -> None:
    import shutil

    from ansible_collections.mlafleet.fleet.plugins.plugin_utils import report

    run_dir = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "data" / "rollout-report", run_dir)
    host = "mlafleet-molecule-rollout-2"
    message = "the host serves rel-a@0123456789ab as before and its server was not restarted: nothing new to measure"
    (run_dir / "perf" / f"{host}.json").write_text(json.dumps({"host": host, "status": "skipped",
                                                                "release": "rel-a@0123456789ab", "message": message,
                                                                "baseline_release": None, "baseline_measured_at": None}))
    section = report.render(run_dir).read_text().split(f'id="host-{host}"')[1].split("<section")[0]
    assert 'Performance gate: <span class="badge s-info">skipped</span>' in section and message in section
    assert 'class="metrics"' not in section  # nothing measured, no table
