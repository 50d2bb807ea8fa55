"""Run a play of a role's tasks with the controller's own ansible-playbook against one local host
(connection local, this interpreter), in a test's temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_local_play(tmp_path: Path, play: str, extra: dict, host: str = "localhost") -> subprocess.CompletedProcess:
    """Write `play` to tmp_path/play.yml and run it against `host` with `extra` as extra vars."""
    (tmp_path / "play.yml").write_text(play)
    env = {**os.environ, "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", f"{host},", "-c", "local",
                           "-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra}),
                           str(tmp_path / "play.yml")],
                          capture_output=True, text=True, env=env, check=False, timeout=300)
