"""The `mlafleet` command line: one subcommand per module.

Each module named in COMMANDS provides `register(subparsers)`, which adds its subparser and
sets `func(args) -> int` on it. Modules are imported when the parser is built, so they keep
their import light (no torch, no vLLM).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "lab": "mlafleet.lab",
    "patchset": "mlafleet.patchset",
    "smoke-report": "mlafleet.smoke",
    "weights": "mlafleet.weights",
    "wheelhouse": "mlafleet.wheelhouse",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlafleet", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
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
