"""The vllm_watchdog role's rendered files: its settings file is one the program accepts, with the
role's defaults, and its unit is sandboxed (systemd-analyze security, offline: no systemd runs here).

Rendered by a real ansible-playbook run with the role's own defaults and vars and its templates;
what needs systemd (install, start, the restart through systemctl) is proven on the lab hosts by
molecule/default/tasks/watchdog.yml.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from play_support import run_local_play

REPO = Path(__file__).resolve().parent.parent
ROLE = REPO / "roles/vllm_watchdog"
_spec = importlib.util.spec_from_file_location("mlafleet_vllm_watchdog_r", ROLE / "files/mlafleet_vllm_watchdog.py")
wd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = wd
_spec.loader.exec_module(wd)

PLAY = """\
- name: Render the watchdog role's files with its defaults
  hosts: all
  gather_facts: false
  vars_files:
    - "{{ role }}/defaults/main.yml"
    - "{{ role }}/vars/main.yml"
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ role }}/templates/{{ item.src }}"
        dest: "{{ out }}/{{ item.dest }}"
        mode: "0644"
      loop:
        - {src: vllm-watchdog.json.j2, dest: vllm-watchdog.json}
        - {src: mlafleet-vllm-watchdog.service.j2, dest: mlafleet-vllm-watchdog.service}
    - name: Write them as the role does (lookups, one mlafleet_files run), and once more
      mlafleet.fleet.mlafleet_files:
        directories: [{path: "{{ out }}/by-role", mode: "0755"}]
        files:
          - {dest: "{{ out }}/by-role/program.py", mode: "0644",
             content: "{{ lookup('ansible.builtin.file', role ~ '/files/mlafleet_vllm_watchdog.py', rstrip=false) }}"}
          - {dest: "{{ out }}/by-role/vllm-watchdog.json", mode: "0644",
             content: "{{ lookup('ansible.builtin.template', role ~ '/templates/vllm-watchdog.json.j2') }}"}
          - {dest: "{{ out }}/by-role/mlafleet-vllm-watchdog.service", mode: "0644",
             content: "{{ lookup('ansible.builtin.template', role ~ '/templates/mlafleet-vllm-watchdog.service.j2') }}"}
      register: by_role
      loop: [first, again]
    - name: Keep what the module said
      ansible.builtin.copy:
        dest: "{{ out }}/by-role.json"
        content: "{{ by_role.results | map(attribute='updated') | list | to_json }}"
        mode: "0600"
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("watchdog-role")
    done = run_local_play(tmp, PLAY, {
        "role": str(ROLE), "out": str(tmp),
        # what the rollout play has in scope for a lab host
        "vllm_server_port": 8000, "vllm_server_served_model_name": "tiny-llama", "vllm_server_start_timeout": 600})
    assert done.returncode == 0, done.stdout[-3000:]
    return tmp


def test_the_role_writes_the_files_byte_for_byte_in_one_module_run_and_then_changes_nothing(rendered: Path) -> None:
    """install.yml's mlafleet_files task (lookups rendered on the controller): the same bytes as the
    template module's and the program's source, mode 0644; a second run changes nothing."""
    by_role = rendered / "by-role"
    assert (by_role / "program.py").read_bytes() == (ROLE / "files/mlafleet_vllm_watchdog.py").read_bytes()
    for name in ("vllm-watchdog.json", "mlafleet-vllm-watchdog.service"):
        assert (by_role / name).read_bytes() == (rendered / name).read_bytes(), name
        assert (by_role / name).stat().st_mode & 0o777 == 0o644
    first, again = json.loads((rendered / "by-role.json").read_text())
    assert sorted(first) == sorted([str(by_role), *(str(by_role / n) for n in (
        "program.py", "vllm-watchdog.json", "mlafleet-vllm-watchdog.service"))])
    assert again == []


def test_the_settings_file_is_what_the_program_reads(rendered: Path) -> None:
    settings = wd.Settings.load(str(rendered / "vllm-watchdog.json"))
    assert settings == wd.Settings(
        base_url="http://127.0.0.1:8000", model="tiny-llama", api_key_file="/opt/mlafleet/current/server/vllm.env",
        window_s=180.0, interval_s=10.0, max_restarts=3, restart_period_s=3600.0,
        restart_command=("sh", "-c", "systemctl kill --signal=SIGKILL vllm.service; exec systemctl restart vllm.service"), restart_timeout_s=600.0, recovery_timeout_s=600.0,
        probe_interval_s=0.0, probe_timeout_s=180.0, state_file="/var/lib/mlafleet-vllm-watchdog/state.json",
        textfile="/var/lib/prometheus/node-exporter/mlafleet_vllm_watchdog.prom", hold_file="/opt/mlafleet/.lock",
        release_link="/opt/mlafleet/current")


def test_the_unit_runs_the_release_python_sandboxed(rendered: Path) -> None:
    unit = (rendered / "mlafleet-vllm-watchdog.service").read_text()
    assert ("ExecStart=/opt/mlafleet/current/venv/bin/python -I -B /usr/local/lib/mlafleet/mlafleet_vllm_watchdog.py"
            " --config /etc/mlafleet/vllm-watchdog.json") in unit
    assert "StateDirectory=mlafleet-vllm-watchdog\n" in unit and "CapabilityBoundingSet=\n" in unit
    assert "ReadWritePaths=/var/lib/prometheus/node-exporter\n" in unit
    done = subprocess.run(["systemd-analyze", "security", "--offline=true", str(rendered / "mlafleet-vllm-watchdog.service")],
                          capture_output=True, text=True, check=False)
    exposure = re.search(r"Overall exposure level for mlafleet-vllm-watchdog.service: ([0-9.]+)", done.stdout)
    assert exposure, done.stdout[-2000:] + done.stderr[-2000:]
    assert float(exposure.group(1)) <= 2.5, done.stdout  # 2.2 when written; vllm.service rates 2.2 offline too


INSTALL_PLAY = """\
- name: The watchdog role's install, up to its first change
  hosts: all
  gather_facts: false
  tasks:
    - name: Install the watchdog
      ansible.builtin.include_role:
        name: "{{ role }}"
"""


@pytest.mark.parametrize("venv, expected", [
    ("missing", "which does not exist: no current release"),
    ("noprom", "which cannot import prometheus_client"),
])
def test_a_release_python_without_what_the_watchdog_needs_stops_before_any_change(
        tmp_path: Path, venv: str, expected: str) -> None:
    """One command checks the release's Python: a missing one and one without prometheus_client get
    their own message, before the role creates or writes anything (vllm_watchdog_root points into
    tmp_path: the directories the role would create next are not made)."""
    root = tmp_path / "root"
    if venv == "noprom":  # a Python that exists but cannot import prometheus_client (-I: no site-packages)
        (root / "current/venv/bin").mkdir(parents=True)
        (root / "current/venv/bin/python").write_text("#!/bin/sh\nexec python3 -I -S \"$@\"\n")
        (root / "current/venv/bin/python").chmod(0o755)
    done = run_local_play(tmp_path, INSTALL_PLAY, {
        "role": str(ROLE), "vllm_watchdog_root": str(root), "vllm_server_port": 8000,
        "vllm_server_served_model_name": "tiny-llama", "vllm_server_start_timeout": 600,
        "vllm_watchdog_textfile_dir": str(tmp_path / "textfile")})
    assert done.returncode == 2, done.stdout[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
    assert "changed=0" in done.stdout and not (tmp_path / "textfile").exists()
