"""plugins/modules/mlafleet_files.py in real ansible-playbook runs on this machine: what it changes,
what it reports, check mode, and what it refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

from play_support import run_local_play

PLAY = """\
- name: Files in one run
  hosts: all
  gather_facts: false
  tasks:
    - name: Ensure them
      mlafleet.fleet.mlafleet_files:
        directories: [{path: "{{ out }}/a/b", mode: "0750"}]
        files:
          - {dest: "{{ out }}/a/b/one.txt", content: "{{ one }}", mode: "{{ mode }}"}
        absent: ["{{ out }}/old.env"]
      register: done
    - name: Keep what it said
      ansible.builtin.copy:
        dest: "{{ out }}/said.json"
        content: "{{ done | to_json }}"
        mode: "0600"
"""


def said(out: Path) -> dict:
    return json.loads((out / "said.json").read_text())


def test_it_writes_what_differs_sets_modes_and_reports_each_path(tmp_path: Path) -> None:
    out = tmp_path / "out"
    folder, one, old = out / "a" / "b", out / "a" / "b" / "one.txt", out / "old.env"
    out.mkdir()
    old.write_text("A_KEY=left over\n")
    first = run_local_play(tmp_path, PLAY, {"out": str(out), "one": "first\n", "mode": "0640"})
    assert first.returncode == 0, first.stdout[-3000:]
    assert one.read_text() == "first\n" and one.stat().st_mode & 0o777 == 0o640
    assert folder.stat().st_mode & 0o777 == 0o750
    assert not old.exists()
    assert said(out)["updated"] == [str(folder), str(one), str(old)]
    # the mode alone differs: only the file is named
    again = run_local_play(tmp_path, PLAY, {"out": str(out), "one": "first\n", "mode": "0644"})
    assert again.returncode == 0 and said(out)["updated"] == [str(one)]
    assert one.stat().st_mode & 0o777 == 0o644
    # nothing differs
    same = run_local_play(tmp_path, PLAY, {"out": str(out), "one": "first\n", "mode": "0644"})
    assert same.returncode == 0 and said(out)["changed"] is False and said(out)["updated"] == []
    # check mode: named, not written
    checked = run_local_play(tmp_path, PLAY.replace("gather_facts: false", "gather_facts: false\n  check_mode: true"),
                             {"out": str(out), "one": "second\n", "mode": "0644"})
    assert checked.returncode == 0 and one.read_text() == "first\n"
    assert re.search(r"TASK \[Ensure them\] \*+\nchanged: \[localhost\]", checked.stdout), checked.stdout


def test_a_directory_where_the_file_goes_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "a" / "b" / "one.txt").mkdir(parents=True)
    refused = run_local_play(tmp_path, PLAY, {"out": str(out), "one": "x", "mode": "0644"})
    assert refused.returncode != 0
    assert f"{out}/a/b/one.txt exists and is not a regular file" in refused.stdout
