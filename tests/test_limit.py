"""`--limit` without localhost: the playbooks fix the run id on the controller all the same.

The run id (and the controller's checks) come from a play on the controller; `--limit gpu-node-03`
leaves localhost out of every play. These run the real site.yml and rollback.yml with
ansible-playbook against hosts on the controller itself (connection local, every path under a
scratch directory), limited to one host and without localhost in the pattern, exactly as the docs
write the commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from weights_support import write_model

from mlafleet.weights import shards as weights

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def inventory(tmp_path: Path, **extra: object) -> Path:
    """Two hosts on the controller (h1, h2), each with its own scratch root."""
    root = tmp_path / "fleet"
    lines = ["all:", "  vars:", "    ansible_become: false", "    ansible_connection: local",
             f"    ansible_python_interpreter: {sys.executable}",
             f"    vllm_install_root: \"{root}/{{{{ inventory_hostname }}}}\"",
             f"    vllm_rollback_root: \"{root}/{{{{ inventory_hostname }}}}\"",
             f"    rollout_lock_path: \"{root}/{{{{ inventory_hostname }}}}/.lock\"",
             "    mlafleet_gpu_stack: false"]
    lines += [f"    {k}: {json.dumps(v)}" for k, v in extra.items()]
    lines += ["  hosts:", "    h1: {}", "    h2: {}"]
    path = tmp_path / "hosts.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def playbook(tmp_path: Path, inv: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               MLAFLEET_REPORT_ROOT=str(tmp_path / "reports"), ANSIBLE_LOCAL_TEMP=str(tmp_path / ".ansible-tmp"))
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inv), str(REPO / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def test_site_yml_with_one_tag_and_a_limit_without_localhost(tmp_path: Path) -> None:
    """`site.yml --tags weights --limit h1`: the weights are staged on h1 and the run ends well
    (it used to stage them and then fail on the lock: 'keep localhost in the pattern')."""
    origin = tmp_path / "origin"
    write_model(origin, shards=2)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(weights.build_manifest(origin)))
    inv = inventory(tmp_path, weights_manifest=str(manifest), weights_source="path",
                    weights_path=str(origin), weights_reserve_mb=0,
                    weights_root=f"{tmp_path}/fleet/{{{{ inventory_hostname }}}}/models")
    done = playbook(tmp_path, inv, "site.yml", "--tags", "weights", "--limit", "h1", "-e", "mlafleet_run=limit-1")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "keep localhost" not in out and "HostVarsVars" not in out
    staged = tmp_path / "fleet" / "h1" / "models" / "tiny-glm"
    assert sorted(p.name for p in staged.glob("*.gguf")) == [p.name for p in sorted(origin.glob("*.gguf"))]
    assert not (tmp_path / "fleet" / "h2").exists()  # outside the limit: untouched
    assert not (tmp_path / "fleet" / "h1" / ".lock").exists()  # taken by run limit-1 and released
    assert "run limit-1" in out
    recap = out.split("PLAY RECAP")[-1]
    assert "h1" in recap and "h2" not in recap and "failed=0" in recap


def test_rollback_yml_as_the_docs_write_it(tmp_path: Path) -> None:
    """`rollback.yml -e rollback_to=<id> --limit <host>`: the host's lock is asked for with this run's
    id, and the refusal (another run holds the lock) is reported in the run's report, not a template
    error from the rescue."""
    root = tmp_path / "fleet"
    for release in ("rel-a", "rel-b"):
        (root / "h1" / "releases" / release / "venv" / "bin").mkdir(parents=True)
        (root / "h1" / "releases" / release / "venv" / "bin" / "python").write_text("")
        (root / "h1" / "releases" / release / "release.json").write_text(json.dumps({"id": release}))
    os.symlink("releases/rel-b", root / "h1" / "current")
    (root / "h1" / ".lock").write_text(json.dumps({"owner": "ops@ctl", "run": "other", "time": time.time()}))
    inv = inventory(tmp_path)
    done = playbook(tmp_path, inv, "rollback.yml", "-e", "rollback_to=rel-a", "--limit", "h1", "-e", "mlafleet_run=rb-1")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    assert "keep localhost" not in out and "HostVarsVars" not in out, out[-4000:]
    report = json.loads((tmp_path / "reports" / "rb-1" / "h1.json").read_text())
    assert report["ok"] is False and report["release"] == "rel-a"
    assert "another rollout holds this host" in report["cause"] and "run other" in report["cause"]
    assert os.readlink(root / "h1" / "current") == "releases/rel-b"  # nothing changed
    assert json.loads((root / "h1" / ".lock").read_text())["run"] == "other"
    assert not (tmp_path / "reports" / "rb-1" / "h2.json").exists()
    assert (tmp_path / "reports" / "rb-1" / "timeline.json").is_file()  # the callback's, in the same directory
