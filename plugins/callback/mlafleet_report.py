# mlafleet: the rollout report for every way the playbooks are run.
"""Record what ran when on every host and write reports/<run>/timeline.json and index.html.

A notification callback (enabled in ansible.cfg), so `ansible-playbook site.yml` and `mlafleet
rollout` (ansible-runner, which keeps ansible.cfg's callbacks) write the same report. It runs
only for mlafleet runs: once the run id is known (the extra variable mlafleet_run, or the
mlafleet_run_id fact that playbooks/release.yml sets on the controller). At the end of the
playbook (also when every host failed, when later plays never start) it writes the timeline
and renders the HTML report from the JSON in the run's report directory with the collection's
plugin_utils/report.py (which `mlafleet report` runs too).

Enabled in the checkout's ansible.cfg; with the installed collection, enable it by its full name
(`callbacks_enabled = mlafleet.fleet.mlafleet_report`): it needs no checkout.
While the run lasts it keeps timeline.json up to date (at every play, and every few seconds as
tasks end), so a run that is killed (Ctrl-C: ansible-runner's cancel kills ansible-playbook)
still leaves what ran until then for `mlafleet rollout` to render. Its files are 0600 in a 0700
directory, like the rest of reports/<run>/.
"""

from __future__ import annotations

DOCUMENTATION = """
name: mlafleet_report
type: aggregate
short_description: Per-host timeline of an mlafleet run and its HTML report (reports/<run>/)
description:
  - Records, per host, which role ran when (per play and serial batch) with its outcome, and
    writes reports/<run>/timeline.json and reports/<run>/index.html at the end of the playbook.
  - The report directory's root is $MLAFLEET_REPORT_ROOT; else reports/ of the checkout when the
    collection is a checkout; else reports/ in the working directory (the lookup
    mlafleet.fleet.mlafleet_report_dir gives the same directory to the playbooks and roles).
requirements:
  - enable in ansible.cfg (callbacks_enabled = mlafleet_report in the checkout, mlafleet.fleet.mlafleet_report
    from the installed collection)
"""

import json
import os
import time
from pathlib import Path

from ansible.plugins.callback import CallbackBase
from ansible_collections.mlafleet.fleet.plugins.plugin_utils.report_dir import report_root, write_private

# Seconds between two saves of the timeline while the run lasts.
SAVE_EVERY_S = 3.0


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "mlafleet_report"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started = time.time()
        self.run_id = None
        self.release_id = None
        self.playbook = ""
        self.plays: list[dict] = []
        self.batches: dict[str, int] = {}
        self.hosts: dict[str, list[dict]] = {}
        self.groups: dict[str, list[str]] = {}
        # roles/front_door: each backend's drain and ready (front_door_drain, front_door_ready), and
        # the sessions the door(s) had counted in all whenever the rollout read them
        self.door: dict[str, list] = {"events": [], "samples": []}
        self.task_start: dict[tuple[str, str], float] = {}
        self.saved = 0.0

    # --- what ran -------------------------------------------------------------------------
    def v2_playbook_on_start(self, playbook):
        self.playbook = os.path.basename(getattr(playbook, "_file_name", "") or "")

    def v2_playbook_on_play_start(self, play):
        name = play.get_name().strip()
        self.batches[name] = self.batches.get(name, 0) + 1
        if self.plays:
            self.plays[-1]["end"] = time.time()
        self.plays.append({"index": len(self.plays), "name": name, "batch": self.batches[name],
                           "start": time.time(), "end": None, "hosts": []})
        if self.run_id is None:
            try:
                extra = play.get_variable_manager().extra_vars
                self.run_id = extra.get("mlafleet_run") or None
            except AttributeError:
                pass
        self._save_timeline()

    def v2_runner_on_start(self, host, task):
        self.task_start[(host.get_name(), task._uuid)] = time.time()

    def _record(self, result, status: str) -> None:
        host = result._host.get_name()
        task = result._task
        facts = (result._result or {}).get("ansible_facts") or {}
        self.run_id = self.run_id or facts.get("mlafleet_run_id")
        self.release_id = facts.get("mlafleet_release_id") or self.release_id
        # playbooks/plan.yml: each serving group's members (the timeline draws them together)
        plan = facts.get("mlafleet_rollout_plan") or facts.get("mlafleet_rollback_plan")
        if isinstance(plan, dict) and isinstance(plan.get("groups"), dict):
            self.groups = plan["groups"]
        self._record_door(host, result._result or {}, facts)
        if host == "localhost" or not self.plays or task.action in ("include_role", "include_tasks",
                                                                       "ansible.builtin.include_role",
                                                                       "ansible.builtin.include_tasks"):
            return
        now = time.time()
        start = self.task_start.pop((host, task._uuid), now)
        play = self.plays[-1]
        if host not in play["hosts"]:
            play["hosts"].append(host)
        # the role's own name (vllm_install), also when a playbook names it mlafleet.fleet.vllm_install
        role = task._role.get_name(include_role_fqcn=False) if task._role else ""
        segments = self.hosts.setdefault(host, [])
        last = segments[-1] if segments else None
        if not (last and last["play"] == play["index"] and last["role"] == role and last["status"] not in
                ("failed", "unreachable")):
            last = {"play": play["index"], "role": role, "first_task": task.get_name(), "start": start,
                    "end": now, "tasks": 0, "changed": 0, "status": "ok", "failures": []}
            segments.append(last)
        last["end"] = now
        last["tasks"] += 1
        if status == "changed":
            last["changed"] += 1
            if last["status"] == "ok":
                last["status"] = "changed"
        elif status in ("failed", "unreachable"):
            res = result._result or {}
            msg = str(res.get("msg") or res.get("stderr") or "").strip()
            last["status"] = status
            last["failures"].append({"task": task.get_name(), "msg": msg[:1000]})
        if now - self.saved >= SAVE_EVERY_S:
            self._save_timeline()

    def _record_door(self, host: str, res: dict, facts: dict) -> None:
        """A backend's drain or ready (facts the front_door role sets), and the door's session count
        from each answer of the mlafleet_front_door module (its servers' cumulative sessions)."""
        now = time.time()
        drain, ready = facts.get("front_door_drain"), facts.get("front_door_ready")
        if isinstance(drain, dict):
            seconds = float(drain.get("seconds") or 0)
            self.door["events"].append({"host": host, "event": "drain", "start": now - seconds, "end": now,
                                        "timed_out": bool(drain.get("timed_out"))})
        if isinstance(ready, dict):
            seconds = float(ready.get("seconds") or 0)
            self.door["events"].append({"host": host, "event": "ready", "start": now - seconds, "end": now,
                                        "up": bool(ready.get("up"))})
        answers = [r for r in [res, *(res.get("results") or [])] if isinstance(r, dict)]
        counts = [sum(int(s.get("stot") or 0) for s in r["servers"]) for r in answers
                  if isinstance(r.get("servers"), list) and r["servers"] and "stot" in r["servers"][0]]
        if counts:
            self.door["samples"].append([now, sum(counts)])

    def v2_runner_on_ok(self, result):
        self._record(result, "changed" if (result._result or {}).get("changed") else "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._record(result, "ok" if ignore_errors else "failed")

    def v2_runner_on_unreachable(self, result):
        self._record(result, "unreachable")

    def v2_runner_item_on_failed(self, result):
        pass  # the loop's own result follows as v2_runner_on_failed

    # --- the report -----------------------------------------------------------------------
    def _report_dir(self) -> Path:
        return report_root() / self.run_id

    def _save_timeline(self, stats=None) -> Path | None:
        """Write timeline.json as it stands (ended: null while the run lasts); never fails the run."""
        if not self.run_id:
            return None
        self.saved = time.time()
        report_dir = self._report_dir()
        timeline = {
            "run": self.run_id, "release": self.release_id, "playbook": self.playbook,
            "started": self.started, "ended": time.time() if stats is not None else None, "plays": self.plays,
            "hosts": self.hosts, "groups": self.groups, "door": self.door,
            "stats": ({h: stats.summarize(h) for h in sorted(stats.processed) if h != "localhost"}
                      if stats is not None else {}),
        }
        try:
            write_private(report_dir / "timeline.json", json.dumps(timeline, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            self._display.warning(f"mlafleet_report: could not write the timeline in {report_dir}: {exc}")
            return None
        return report_dir

    def v2_playbook_on_stats(self, stats):
        if not self.run_id:
            return
        if self.plays:
            self.plays[-1]["end"] = time.time()
        report_dir = self._save_timeline(stats)
        if report_dir is None:
            return
        try:
            from ansible_collections.mlafleet.fleet.plugins.plugin_utils.report import render

            path = render(report_dir)
            self._display.display(f"rollout report: {path}")
        except Exception as exc:  # a report must never fail the rollout  # noqa: BLE001
            self._display.warning(f"mlafleet_report: could not write the report in {report_dir}: {exc}")
