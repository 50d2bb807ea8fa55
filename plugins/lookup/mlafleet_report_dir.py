# mlafleet: the controller directory of a run's reports.
"""Lookup `mlafleet_report_dir`: reports/<run> on the controller (plugins/plugin_utils/report_dir.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: mlafleet_report_dir
author: mlafleet maintainers
short_description: The controller directory of one run's reports
description:
  - Returns the absolute path <root>/<run> of the directory that holds a run's reports on the
    controller (the smoke test's and perf gate's per-host JSON, rollback records, the timeline and
    index.html of the mlafleet_report callback).
  - The root is $MLAFLEET_REPORT_ROOT when set; else reports/ of the checkout when the collection
    is a git checkout (its root holds galaxy.yml); else reports/ in the current working directory
    of ansible-playbook (an installed collection never writes into its own directory).
options:
  _terms:
    description: The run id (mlafleet_run_id), one plain path component.
    required: true
"""

EXAMPLES = r"""
- name: Where this run's reports go
  ansible.builtin.debug:
    msg: "{{ lookup('mlafleet.fleet.mlafleet_report_dir', mlafleet_run_id) }}"
"""

RETURN = r"""
_raw:
  description: The absolute path of the run's report directory (not created).
  type: list
  elements: str
"""

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase
from ansible_collections.mlafleet.fleet.plugins.plugin_utils.report_dir import report_dir


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        if len(terms) != 1:
            raise AnsibleLookupError(f"mlafleet_report_dir takes one run id, not {len(terms)} terms")
        try:
            return [str(report_dir(terms[0]))]
        except ValueError as exc:
            raise AnsibleLookupError(f"mlafleet_report_dir: {exc}") from None
