"""Where a run's reports go (plugins/plugin_utils/report_dir.py, the lookup mlafleet_report_dir and the
mlafleet_report callback): $MLAFLEET_REPORT_ROOT, else the checkout's reports/, else the working
directory's reports/ for an installed collection (never the collection's own directory); and how
the roles write a report there (the action mlafleet_report_file, in a real ansible-playbook run)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ansible_collections.mlafleet.fleet.plugins.plugin_utils import report_dir as rd
from play_support import run_local_play

REPO = Path(__file__).resolve().parent.parent


def test_the_root_is_the_variable_then_the_checkout_then_the_working_directory(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    checkout, installed, cwd = tmp_path / "clone", tmp_path / "ansible_collections" / "mlafleet" / "fleet", tmp_path / "work"
    for path in (checkout, installed, cwd):
        path.mkdir(parents=True)
    (checkout / "galaxy.yml").write_text("namespace: mlafleet\n")
    (installed / "MANIFEST.json").write_text("{}")
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLAFLEET_REPORT_ROOT", raising=False)
    assert rd.report_dir("run-1", checkout) == checkout / "reports" / "run-1"
    assert rd.report_dir("run-1", installed) == cwd / "reports" / "run-1"
    monkeypatch.setenv("MLAFLEET_REPORT_ROOT", "elsewhere")  # relative: to the working directory
    assert rd.report_dir("run-1", checkout) == cwd / "elsewhere" / "run-1"
    # this checkout's copy knows it is a checkout
    monkeypatch.delenv("MLAFLEET_REPORT_ROOT")
    assert rd.COLLECTION == REPO and rd.report_root() == REPO / "reports"


@pytest.mark.parametrize("run", ["", ".", "..", "a/b", "../x"])
def test_a_run_id_is_one_plain_name(run: str) -> None:
    with pytest.raises(ValueError, match="a run id is one plain name"):
        rd.report_dir(run)


REPORT_PLAY = """\
- name: Write a report file
  hosts: all
  gather_facts: false
  tasks:
    - name: Write it
      mlafleet.fleet.mlafleet_report_file:
        dest: "{{ dest }}"
        content: "{{ {'host': inventory_hostname, 'ok': true} | to_nice_json }}"
      register: written
    - name: Say what the task returned
      ansible.builtin.debug:
        msg: "RESULT {{ written | to_json }}"
"""


def test_the_report_action_writes_0600_in_new_0700_directories_and_changes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "reports" / "run-1" / "perf" / "host-a.json"
    done = run_local_play(tmp_path, REPORT_PLAY, {"dest": str(dest)}, host="host-a")
    assert done.returncode == 0, done.stdout[-3000:]
    assert json.loads(dest.read_text()) == {"host": "host-a", "ok": True}
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    for folder in (dest.parent, dest.parent.parent, dest.parent.parent.parent):  # perf/, run-1/, reports/
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert "changed=0" in done.stdout and '"changed": false' in done.stdout
    assert not list(dest.parent.glob("*.tmp"))
    # again over the file: replaced whole
    dest.write_text("old and longer than the new report " * 20)
    again = run_local_play(tmp_path, REPORT_PLAY, {"dest": str(dest)}, host="host-a")
    assert again.returncode == 0 and json.loads(dest.read_text()) == {"host": "host-a", "ok": True}


def test_the_report_action_writes_nothing_in_check_mode_and_refuses_a_relative_path(tmp_path: Path) -> None:
    dest = tmp_path / "run-2" / "host-a.json"
    checked = run_local_play(tmp_path, REPORT_PLAY.replace("gather_facts: false", "gather_facts: false\n  check_mode: true"),
                             {"dest": str(dest)}, host="host-a")
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert not dest.exists() and not dest.parent.exists()
    refused = run_local_play(tmp_path, REPORT_PLAY, {"dest": "reports/run-2/host-a.json"}, host="host-a")
    assert refused.returncode != 0
    assert "dest must be an absolute path, not 'reports/run-2/host-a.json'" in refused.stdout
