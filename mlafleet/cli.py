"""The `mlafleet` command line: one subcommand per module.

Each module named in COMMANDS provides `register(subparsers)`, which adds its subparsers (one
module may provide several commands, e.g. mlafleet.ops.runner) and sets `func(args) -> int` on
each. Modules are imported when the parser is built, so they keep their import light (no
torch, no vLLM). For a known command only the module that provides it is imported (so an
operator's `mlafleet rollout` never loads the lab's modules); without one (`mlafleet --help`, a
typo) every module is, so that help and errors list every command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "lab": "mlafleet.lab.containers",
    "loadgen": "mlafleet.ops.loadgen",
    "plan": "mlafleet.ops.runner",
    "patchset": "mlafleet.patchset.builder",
    "report": "ansible_collections.mlafleet.fleet.plugins.plugin_utils.report",  # the collection's renderer (plugins/plugin_utils/report.py)
    "rollback": "mlafleet.ops.runner",
    "rollout": "mlafleet.ops.runner",
    "smoke-report": "mlafleet.ops.smoke",
    "status": "mlafleet.ops.status",
    "weights": "mlafleet.weights.shards",
    "wheelhouse": "mlafleet.ops.wheelhouse",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlafleet", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module in dict.fromkeys(modules):  # a module may provide several commands
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
