"""The HTML rollout report (plugins/plugin_utils/report.py), rendered from a recorded run and opened in Chromium.

tests/data/rollout-report/ is the report directory of a real run: the molecule rollout
scenario's main rollout (release rollout-b to two lab hosts; the perf gate passed on the first
batch and failed on the second, whose batch was rolled back), with its run.json, the report
callback's timeline.json, the per-host reports and the perf gate's verdicts. The browser is
Debian's chromium (installed by `make test-prereqs`), headless, with a fresh profile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.mlafleet.fleet.plugins.plugin_utils import report
from mlafleet.ops.perfgate import METRICS

RECORDED = Path(__file__).resolve().parent / "data" / "rollout-report"
H2, H3 = "mlafleet-molecule-rollout-2", "mlafleet-molecule-rollout-3"


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(RECORDED, out)
    return out


def chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe, "Debian's chromium is needed for this test: make test-prereqs (apt-get install chromium)"
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
                           "--v=0", *args, page.as_uri()], text=True, capture_output=True, timeout=120)


def console_errors(stderr: str) -> list[str]:
    """What the page logged to the console: script errors, blocked loads, policy violations."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_rendered_from_the_recorded_run(run_dir):
    recorded = json.loads((run_dir / "run.json").read_text())
    html = report.render(run_dir).read_text()
    # Every host of the run, with the runner's status and cause.
    for host in recorded["hosts"]:
        row = re.search(rf'<tr id="row-{host["host"]}">(.*?)</tr>', html, re.S)
        assert row, host["host"]
        assert f">{host['status']}</span>" in row.group(1)
    # The recorded run.json is an older mlafleet's: its rc was ansible-playbook's, and is named so.
    assert recorded["rc"] == 2 and "playbook_rc" not in recorded
    assert "; ansible-playbook rc 2</td>" in html and "exit status 2" not in html
    h3_row = re.search(rf'<tr id="row-{H3}">(.*?)</tr>', html, re.S).group(1)
    assert "rolled back" in h3_row and "TTFT p99 up" in h3_row
    # The perf gate per host: the verdict, the metric table and one plot per metric.
    for host, status in ((H2, "passed"), (H3, "failed")):
        section = re.search(rf'<section [^>]*id="host-{host}">(.*?)</section>', html, re.S).group(1)
        verdict = json.loads((run_dir / "perf" / f"{host}.json").read_text())
        assert verdict["status"] == status and f'class="badge s-{report.VERDICT_CLASSES[status]}">{status}<' in section
        assert section.count('class="metric ') == len(METRICS)
        assert (section.count('<span class="badge s-bad">regressed</span>')
                == sum(m["regressed"] for m in verdict["metrics"]))
        assert f"against release {verdict['baseline_release']}" in section
    # The timeline: one bar per role run of every host, plays as bands, the rollback drawn as such.
    timeline = json.loads((run_dir / "timeline.json").read_text())
    svg = re.search(r'<svg[^>]*class="timeline".*?</svg>', html, re.S).group(0)
    assert svg.count('class="seg ') == sum(len(v) for v in timeline["hosts"].values())
    assert svg.count(report.STATUS_COLORS["rollback"]) >= 3  # vllm_rollback, vllm_server, smoke_test on host 3
    assert "FAILED perf_gate : Fail the host when the release is slower than its baseline" in svg
    # Self-contained: no script, nothing fetched, a policy that forbids it.
    assert "<script" not in html and not re.search(r'(src|href)="(https?:)?//', html)
    assert "default-src 'none'" in html


def test_rendered_without_run_json_for_ansible_playbook_users(run_dir):
    (run_dir / "run.json").unlink()
    data = report.load(run_dir)
    status = {h["host"]: h["status"] for h in data["hosts"]}
    assert status[H2] == "ok" and status[H3] == "failed"
    h3 = next(h for h in data["hosts"] if h["host"] == H3)
    assert "perf gate" in h3["cause"] and h3["rolled_back_to"]
    assert data["summary"]["command"] == "ansible-playbook" and data["summary"]["status"] == "failed"
    assert H3 in report.render(run_dir).read_text()


def test_no_json_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="holds no run.json"):
        report.load(tmp_path)
    from mlafleet.cli import main

    assert main(["report", str(tmp_path)]) == 1
    assert "mlafleet report:" in capsys.readouterr().err


def test_opens_in_chromium_without_errors(run_dir, tmp_path):
    page = report.render(run_dir)
    dom = chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_errors(dom.stderr) == []
    assert f'id="host-{H2}"' in dom.stdout and f'id="host-{H3}"' in dom.stdout
    assert dom.stdout.count("<svg") == 1 + 2 * len(METRICS)
    shot = tmp_path / "shot.png"
    png = chromium(tmp_path, page, "--window-size=1280,2400", f"--screenshot={shot}")
    assert png.returncode == 0 and console_errors(png.stderr) == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a drawn page, not a blank one


def test_a_serving_groups_members_are_drawn_together_under_its_name(run_dir, tmp_path):
    # The recorded run's hosts 2 and 3 made one serving group, as the plan (playbooks/plan.yml)
    # records it in timeline.json; a third, single host sorts between them by name.
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert "groups" not in timeline  # recorded before groups: drawn as single hosts
    plain = str(report.timeline_svg(report.load(run_dir)))
    assert 'class="group"' not in plain
    timeline["groups"] = {"fleet": [H2, H3]}
    timeline["hosts"]["a-single-host-in-between"] = timeline["hosts"][H2][:1]
    timeline["hosts"]["mlafleet-molecule-rollout-2b"] = timeline["hosts"][H2][:1]
    (run_dir / "timeline.json").write_text(json.dumps(timeline))
    data = report.load(run_dir)
    svg = str(report.timeline_svg(data))
    # one frame for the group, named, listing its members; the members' rows are adjacent
    assert svg.count('data-group="fleet"') == 1 and ">group fleet</text>" in svg
    assert f"serving group fleet: {H2}, {H3}" in svg
    rows = re.findall(r'class="host">([^<]+)</text>', svg)
    assert abs(rows.index(H2) - rows.index(H3)) == 1, rows
    frame = re.search(r'<rect x="1" y="([0-9.]+)" width="[0-9.]+" height="([0-9.]+)"[^>]*data-group="fleet"', svg)
    assert float(frame.group(2)) > 26  # spans both rows
    # the hosts table names each member's group; the single host has none
    html = report.render(run_dir).read_text()
    assert re.search(rf'<tr id="row-{H3}">\s*<td><a [^>]+>{H3}</a> <span class="muted">\(group fleet\)</span>', html)
    assert not re.search(r'<tr id="row-a-single-host-in-between">\s*<td><a [^>]+>[^<]+</a> <span', html)
    dom = chromium(tmp_path, run_dir / "index.html", "--dump-dom")
    assert dom.returncode == 0 and console_errors(dom.stderr) == [], dom.stderr[-2000:]
    assert 'data-group="fleet"' in dom.stdout


def test_the_console_check_catches_a_broken_page(tmp_path):
    # The same check on a page that breaks the rules: it must see the blocked load and script.
    page = tmp_path / "bad.html"
    page.write_text(report.render_html(report.load(RECORDED)).replace(
        "</body>", '<img src="http://127.0.0.1:9/x.png"><script>undefinedFunction()</script></body>'))
    out = chromium(tmp_path, page, "--dump-dom")
    errors = console_errors(out.stderr)
    assert any("img-src" in e for e in errors) and any("script" in e.lower() for e in errors), out.stderr[-2000:]


SERIAL_PLAY = """
- hosts: all
  gather_facts: false
  serial: 1
  tasks:
    - ansible.builtin.command: "true"
      changed_when: true
    - ansible.builtin.fail:
        msg: boom on {{ inventory_hostname }}
      when: inventory_hostname == 'h2'
"""


def test_ansible_playbook_users_get_the_report_too(tmp_path):
    # The callback is enabled in ansible.cfg: a plain ansible-playbook run of an mlafleet run id
    # writes the timeline and the page, also when the last batch failed and the playbook stopped.
    (tmp_path / "play.yml").write_text(SERIAL_PLAY)
    hosts = "".join(f"    {h}: {{ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n"
                    for h in ("h1", "h2"))
    (tmp_path / "inv.yml").write_text(f"all:\n  hosts:\n{hosts}")
    env = {**os.environ, "ANSIBLE_CONFIG": str(Path(__file__).resolve().parents[1] / "ansible.cfg"),
           "MLAFLEET_REPORT_ROOT": str(tmp_path / "reports")}
    out = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "inv.yml"),
                          str(tmp_path / "play.yml"), "-e", "mlafleet_run=plain"], text=True, capture_output=True,
                         env=env, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:]
    page = tmp_path / "reports" / "plain" / "index.html"
    assert f"rollout report: {page}" in out.stdout
    timeline = json.loads((tmp_path / "reports" / "plain" / "timeline.json").read_text())
    assert [(p["batch"], p["hosts"]) for p in timeline["plays"]] == [(1, ["h1"]), (2, ["h2"])]
    status = {h["host"]: (h["status"], h["cause"], h["batch"]) for h in report.load(page.parent)["hosts"]}
    assert status["h1"] == ("ok", "", "all, batch 1 of 2")
    assert status["h2"][0] == "failed" and "boom on h2" in status["h2"][1]
    assert 'id="host-h2"' in page.read_text()


def test_a_backends_drain_down_and_ready_are_drawn_under_the_doors_request_rate(run_dir, tmp_path):
    # What the callback records from the front_door role (front_door_drain, front_door_ready, and
    # the door's cumulative sessions from each mlafleet_front_door answer), on the recorded run.
    timeline = json.loads((run_dir / "timeline.json").read_text())
    t = timeline["started"]
    timeline["door"] = {
        "events": [{"host": H2, "event": "drain", "start": t + 10, "end": t + 14, "timed_out": False},
                   {"host": H2, "event": "ready", "start": t + 40, "end": t + 43, "up": True}],
        "samples": [[t + 5, 100], [t + 14, 118], [t + 43, 176]]}
    (run_dir / "timeline.json").write_text(json.dumps(timeline))
    data = report.load(run_dir)
    spans = next(h for h in data["hosts"] if h["host"] == H2)["door"]
    assert [(s["kind"], round(s["t0"]), round(s["t1"])) for s in spans] == [
        ("drain", 10, 14), ("down", 14, 40), ("ready", 40, 43)]
    assert next(h for h in data["hosts"] if h["host"] == H3)["door"] == []
    assert [(round(r["t0"]), round(r["t1"]), r["rate"]) for r in data["door_rate"]] == [(5, 14, 2.0), (14, 43, 2.0)]
    svg = str(report.timeline_svg(data))
    assert ">drain: +10.0 s for 4.0 s (drained)</title>" in svg
    assert ">down: +14.0 s for 26.0 s (out of the door)</title>" in svg
    assert ">ready: +40.0 s for 3.0 s (UP at the door)</title>" in svg
    assert svg.count('class="door-rate"') == 2 and "2 sessions/s at the door, +5 s to +14 s" in svg
    # no door in a run: no strip, no bands
    assert 'class="door-' not in str(report.timeline_svg(report.load(RECORDED)))
    page = report.render(run_dir)
    dom = chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0 and console_errors(dom.stderr) == [], dom.stderr[-2000:]
    assert 'class="door-drain"' in dom.stdout
