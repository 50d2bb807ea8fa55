"""Where a run's reports go on the controller: one rule for the playbooks, the roles and the callback.

`reports/<run>/` holds the smoke test's and perf gate's per-host JSON, a failed batch's rollback
records, the callback's timeline.json and index.html (and, for `mlafleet rollout`, run.json). Its
root is, in this order:

- $MLAFLEET_REPORT_ROOT (the `mlafleet` CLI sets it; anyone may);
- reports/ of the checkout, when this collection is a checkout (its root holds galaxy.yml, as a
  git clone does: `ansible-playbook site.yml` there keeps writing where it always did);
- reports/ in the current working directory, for an installed collection (its directory is
  Ansible's, not a place for a run's files).

Plain Python on the controller: the lookup plugin `mlafleet.fleet.mlafleet_report_dir` (the
playbooks' and roles' defaults) and the `mlafleet_report` callback import it by its collection name.
"""

from __future__ import annotations

import os
from pathlib import Path

COLLECTION = Path(__file__).resolve().parents[2]


def report_root(collection: Path = COLLECTION) -> Path:
    """The directory that holds one folder per run (absolute)."""
    given = os.environ.get("MLAFLEET_REPORT_ROOT")
    if given:
        return Path(os.path.abspath(given))
    if (collection / "galaxy.yml").is_file():
        return collection / "reports"
    return Path(os.path.abspath("reports"))


def report_dir(run: str, collection: Path = COLLECTION) -> Path:
    """reports/<run>: the run id must be one plain path component."""
    run = str(run)
    if not run or run in (".", "..") or "/" in run or "\0" in run:
        raise ValueError(f"a run id is one plain name (no '/', not empty, not '.' or '..'), not {run!r}")
    return report_root(collection) / run


def write_private(path: Path, text: str) -> None:
    """Write a report file 0600, atomically; each directory it creates for it is 0700."""
    path = Path(path)
    missing = []
    folder = path.parent
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another host's writer made it first
            pass
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
