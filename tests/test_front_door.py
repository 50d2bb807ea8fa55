"""The README's front door on a controller that lacks what a fresh Debian 12 machine lacks.

- scripts/install-debs (what `make demo`/`make test` call first): as a user who cannot install,
  it names the missing packages and the command, and fails; what is installed is left alone.
- site.yml on a controller without rsync: the controller check refuses before any host is
  touched (the fresh-clone failure this check exists for had already created release
  directories on the canary). rsync is hidden by a PATH that holds every other program.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install-debs"


def _installed(pkg: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return "install ok installed" in out.stdout


def test_install_debs_names_what_is_missing_to_a_user_who_cannot_install() -> None:
    missing = "cowsay"  # a real Debian package this controller does not have
    assert not _installed(missing) and _installed("bash")
    tmp_path = Path(tempfile.mkdtemp(prefix="mlafleet-front-door-"))  # readable by the unprivileged user
    os.chmod(tmp_path, 0o755)
    shutil.copy(SCRIPT, tmp_path / "install-debs")
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          str(tmp_path / "install-debs"), "bash", missing],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert f"missing Debian packages: {missing};" in run.stderr
    assert f"sudo apt-get install {missing}" in run.stderr and "bash" not in run.stderr.split(";")[0]
    assert not _installed(missing)
    # nothing missing: nothing to do, whoever runs it
    ok = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         str(tmp_path / "install-debs"), "bash"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout == ok.stderr == ""
    shutil.rmtree(tmp_path)


def _path_without(tmp_path: Path, hidden: str) -> str:
    """A PATH holding every program of this machine's PATH except `hidden`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory) or directory.startswith(str(REPO)):
            continue
        for entry in os.scandir(directory):
            if entry.name != hidden and not (bin_dir / entry.name).exists():
                (bin_dir / entry.name).symlink_to(entry.path)
    return f"{REPO / '.venv' / 'bin'}{os.pathsep}{bin_dir}"


def test_site_yml_refuses_a_controller_without_rsync_before_any_host(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    # a host that would fail at once if anything tried it (nothing listens on port 9)
    inventory.write_text("all:\n  hosts:\n    canary-1:\n      ansible_host: 127.0.0.1\n      ansible_port: 9\n"
                         "      vllm_install_version: '0.20.2'\n")
    env = dict(os.environ, PATH=_path_without(tmp_path, "rsync"), ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               ANSIBLE_NOCOLOR="1")
    assert shutil.which("rsync", path=env["PATH"]) is None and shutil.which("ssh", path=env["PATH"])
    run = subprocess.run([str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory),
                          str(REPO / "site.yml")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "the controller lacks rsync" in out and "make prereqs" in out
    assert "UNREACHABLE" not in out and "canary-1" not in out.split("PLAY RECAP")[-1], out[-3000:]


def test_the_readme_names_the_disk_make_test_warns_at() -> None:
    """The README's two disk figures are the ones `make check-disk` warns at (a fresh machine, one with
    the lab images and wheels cached), and it does not call the lab image offline (debootstrap reads
    Debian's mirror)."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    fresh = int(re.search(r"^DISK_FRESH_GB := (\d+)$", makefile, re.M)[1])
    cached = int(re.search(r"^DISK_CACHED_GB := (\d+)$", makefile, re.M)[1])
    assert f"about {fresh} GB free on a machine that has built nothing yet" in readme
    assert f"about {cached} GB once the lab images and the lab releases' wheels are cached" in readme
    recipe = makefile.split("\ncheck-disk:\n", 1)[1].split("\n\n", 1)[0]
    assert "$(DISK_FRESH_GB)" in recipe and "$(DISK_CACHED_GB)" in recipe and "scripts/check-disk $$need" in recipe
    # a fresh machine (no wheel cache: docker is not even asked) gets the larger figure
    dry = subprocess.run(["make", "-s", "-n", "check-disk"], cwd=REPO, capture_output=True, text=True, timeout=60)
    script = dry.stdout.replace("\\\n", " ").replace("scripts/check-disk", "echo")
    shown = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "MLAFLEET_CACHE": "/nonexistent"})
    assert shown.stdout.split() == [str(fresh), "make", "test"], shown.stdout + shown.stderr
    assert "offline" not in readme.split("## Two commands", 1)[1].split("## Against a real fleet", 1)[0]
    assert "debootstrap` from Debian's mirror" in readme
