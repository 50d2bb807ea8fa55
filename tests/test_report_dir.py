"""Where a run's reports go (plugins/plugin_utils/report_dir.py, the lookup mlafleet_report_dir and the
mlafleet_report callback): $MLAFLEET_REPORT_ROOT, else the checkout's reports/, else the working
directory's reports/ for an installed collection (never the collection's own directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ansible_collections.mlafleet.fleet.plugins.plugin_utils import report_dir as rd

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
