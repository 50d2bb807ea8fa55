"""playbooks/check_vars.yml (action mlafleet_check_vars): misspelled variables are named, with the closest
declared name, on the controller before anything else; real ansible-runner and ansible-playbook runs."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import yaml

from mlafleet.ops import runner

REPO = Path(__file__).resolve().parent.parent


def inventory(tmp_path: Path) -> Path:
    (tmp_path / "inv" / "group_vars").mkdir(parents=True)
    (tmp_path / "inv" / "hosts.yml").write_text(
        "all:\n  hosts:\n    gpu-1: {ansible_connection: local, vllm_server_portt: 8001, vllm_server_port: 8002}\n"
        "    gpu-2: {ansible_connection: local}\n")
    # group_vars from a directory (a vars plugin) count as inventory variables too.
    (tmp_path / "inv" / "group_vars" / "all.yml").write_text(
        "weights_manifset: /srv/m.json\nsmoke_test_timeout: 60\nmy_own_setting: 1\n")
    return tmp_path / "inv"


def test_cli_warns_for_each_misspelled_variable_and_names_the_closest(tmp_path: Path) -> None:
    out = io.StringIO()
    report = runner.run_playbook(
        "rollout", [inventory(tmp_path)], run="cv-1", out=out, playbook="playbooks/check_vars.yml",
        extravars=runner.parse_extra_vars(["vllm_verison=0.20.3", "mlafleet_seral=1", "vllm_install_version=0.20.2"]),
        runner_root=tmp_path / "runner", report_root=tmp_path / "reports")
    assert report["rc"] == 0  # a warning, not a refusal
    warnings = {w.split(" ")[0]: w for w in report["warnings"]}
    assert set(warnings) == {"vllm_verison", "mlafleet_seral", "vllm_server_portt", "weights_manifset"}
    assert "(extra variable)" in warnings["vllm_verison"] and "did you mean vllm_install_version?" in warnings["vllm_verison"]
    assert "did you mean mlafleet_serial?" in warnings["mlafleet_seral"]
    assert "(inventory: gpu-1)" in warnings["vllm_server_portt"] and "did you mean vllm_server_port?" in warnings["vllm_server_portt"]
    assert "(inventory: gpu-1, gpu-2)" in warnings["weights_manifset"]
    assert "did you mean weights_manifest?" in warnings["weights_manifset"]
    text = out.getvalue()
    assert text.count("WARNING") == 4 and "my_own_setting" not in text  # not our prefix: not ours to judge


def test_ansible_playbook_site_yml_warns_first(tmp_path: Path) -> None:
    # site.yml and rollback.yml (the checkout's, and the collection's mlafleet.fleet.site and
    # mlafleet.fleet.rollback they import) run the check before anything else.
    def first_playbook(path: Path) -> Path:
        first = yaml.safe_load(path.read_text())[0]
        target = first.get("ansible.builtin.import_playbook")
        return first_playbook(path.parent / target) if target else path

    for playbook in ("site.yml", "rollback.yml", "playbooks/site.yml", "playbooks/rollback.yml"):
        assert first_playbook(REPO / playbook) == REPO / "playbooks" / "check_vars.yml", playbook
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory(tmp_path)),
                           str(REPO / "playbooks" / "check_vars.yml"), "-e", "vllm_server_hots=0.0.0.0"],
                          capture_output=True, text=True, check=False, timeout=120,
                          env={"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "PATH": "/usr/bin:/bin",
                               "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "vllm_server_hots (extra variable)" in done.stderr + done.stdout
    assert "did you mean vllm_server_host?" in done.stderr + done.stdout


def test_every_variable_the_repository_sets_is_declared() -> None:
    """The lab and production example inventories and the molecule scenarios set only declared names."""
    from ansible_collections.mlafleet.fleet.plugins.plugin_utils import check_vars as plugin

    declared, ours = plugin.declared_variables(), plugin.prefixes()
    files = [*REPO.glob("inventory/prod.example/**/*.yml"), *REPO.glob("files/lab/group_vars/*.yml"),
             *REPO.glob("molecule/*/host_vars/*.yml"), *REPO.glob("molecule/*/group_vars/*.yml")]
    names = {k for f in files for k in (yaml.safe_load(f.read_text()) or {})}
    assert plugin.unknown_variables(names, declared, ours) == []
    assert {"vllm_", "vllm_server_", "weights_", "mlafleet_", "nvidia_driver_"} <= ours
