"""The `mlafleet` command line: one subcommand per module.

Each module named in COMMANDS provides `register(subparsers)`, which adds its subparsers (one
module may provide several commands, e.g. mlafleet.runner) and sets `func(args) -> int` on
each. Modules are imported when the parser is built, so they keep their import light (no
torch, no vLLM).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "lab": "mlafleet.lab",
    "plan": "mlafleet.runner",
    "patchset": "mlafleet.patchset",
    "report": "mlafleet.report",
    "rollback": "mlafleet.runner",
    "rollout": "mlafleet.runner",
    "smoke-report": "mlafleet.smoke",
    "status": "mlafleet.status",
    "weights": "mlafleet.weights",
    "wheelhouse": "mlafleet.wheelhouse",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlafleet", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in dict.fromkeys(COMMANDS.values()):  # a module may provide several commands
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
