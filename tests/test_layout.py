"""The Python package's layout: one folder per job, and the lab never imported by production code.

mlafleet/ holds the `mlafleet` command (cli.py) and one package per job: ops/ (operator tools),
patchset/, weights/, kernels/, lab/ (test and demo only). Production code, that is every module of
the package outside lab/ and every plugin of the collection, must run without the lab: no import
of it (read with ast), no module of it loaded by importing them all (in a fresh interpreter), and
the CLI loads it only for its own command. Between the package and the collection's plugins,
imports go one way: the package imports the plugins' utils, no plugin imports the package.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "mlafleet"
JOBS = ("ops", "patchset", "weights", "kernels", "lab")


def production_files() -> list[Path]:
    """Every Python file of the package outside lab/, and every plugin of the collection."""
    package = [p for p in PACKAGE.rglob("*.py") if "lab" not in p.relative_to(PACKAGE).parts[:1]]
    return sorted(package + list((REPO / "plugins").rglob("*.py")))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def lab_references(source: str, where: str) -> list[str]:
    """The imports of mlafleet.lab in `source`, and the strings that name it (importlib's way)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if re.match(r"mlafleet\.lab\b", a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if re.match(r"mlafleet\.lab\b", node.module):
                found.append(f"from {node.module} import ...")
            elif node.module == "mlafleet" and any(a.name == "lab" for a in node.names):
                found.append("from mlafleet import lab")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.match(r"mlafleet\.lab(\.\w+)*$", node.value):
                found.append(repr(node.value))
    return found


def test_the_reference_finder_sees_every_way_of_importing_the_lab() -> None:
    """The check below can fail: each form of importing the lab is found."""
    source = ("import mlafleet.lab.tinymodel\nfrom mlafleet.lab import containers\nfrom mlafleet import lab\n"
              "import importlib\nimportlib.import_module('mlafleet.lab.standin_repo')\n"
              "from mlafleet.ops import runner\nlabel = 'mlafleet.lab={name}'\n")
    assert lab_references(source, "x.py") == [
        "import mlafleet.lab.tinymodel", "from mlafleet.lab import ...", "from mlafleet import lab",
        "'mlafleet.lab.standin_repo'"]


def test_no_production_module_imports_the_lab() -> None:
    files = production_files()
    assert PACKAGE / "ops" / "runner.py" in files and REPO / "plugins" / "callback" / "mlafleet_report.py" in files
    assert not [p for p in files if p.is_relative_to(PACKAGE / "lab")]
    found = {str(p.relative_to(REPO)): refs for p in files
             if (refs := lab_references(p.read_text(encoding="utf-8"), str(p)))}
    # The one exception: the command line names the lab's own command (imported only when it runs).
    assert found == {"mlafleet/cli.py": ["'mlafleet.lab.containers'"]}
    from mlafleet import cli

    assert [c for c, m in cli.COMMANDS.items() if m.startswith("mlafleet.lab")] == ["lab"]
    for directory in ("roles", "playbooks"):
        for path in (REPO / directory).rglob("*"):
            if path.is_file():
                assert not re.search(r"mlafleet[./]lab\b", path.read_text(encoding="utf-8", errors="replace")), path


def package_references(source: str, where: str) -> list[str]:
    """The imports of the mlafleet package in `source`, and the strings that name one of its
    modules (importlib's way). The collection's own names (ansible_collections.mlafleet.fleet...,
    mlafleet.fleet.<plugin>) are not the package."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if re.match(r"mlafleet(\.|$)", a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if re.match(r"mlafleet(\.|$)", node.module):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"mlafleet(\.(?!fleet\b)\w+)+", node.value):
                found.append(repr(node.value))
    return found


def test_the_package_reference_finder_sees_every_way_of_importing_the_package() -> None:
    """The check below can fail: each form of importing the package is found, and the
    collection's own names are not taken for it."""
    source = ("import mlafleet\nimport mlafleet.ops.report\nfrom mlafleet.ops.report import render\n"
              "from mlafleet import cli\nimport importlib\nimportlib.import_module('mlafleet.ops.perfgate')\n"
              "from ansible_collections.mlafleet.fleet.plugins.plugin_utils.report import render\n"
              "name = 'mlafleet.fleet.mlafleet_report_dir'\nCALLBACK_NAME = 'mlafleet_report'\n")
    assert package_references(source, "x.py") == [
        "import mlafleet", "import mlafleet.ops.report", "from mlafleet.ops.report import ...",
        "from mlafleet import ...", "'mlafleet.ops.perfgate'"]


def test_plugins_never_import_the_package() -> None:
    """One direction between the collection and the package: the package imports the
    collection's module_utils and plugin_utils by their collection names (one copy of each, which
    Ansible ships with the modules); no plugin, module_utils or plugin_utils imports the package,
    so the collection runs where the package is not installed."""
    plugins = sorted((REPO / "plugins").rglob("*.py"))
    assert REPO / "plugins" / "callback" / "mlafleet_report.py" in plugins
    assert REPO / "plugins" / "plugin_utils" / "report.py" in plugins
    found = {str(p.relative_to(REPO)): refs for p in plugins
             if (refs := package_references(p.read_text(encoding="utf-8"), str(p)))}
    assert found == {}
    # the direction that stays: the package uses the collection's code by its collection name
    users = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
             if "ansible_collections.mlafleet.fleet.plugins." in p.read_text(encoding="utf-8")}
    assert {"mlafleet/cli.py", "mlafleet/ops/runner.py", "mlafleet/weights/shards.py"} <= users


LOADED = """
import importlib, json, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
from mlafleet import cli
for command in json.loads(sys.argv[1]):
    cli.build_parser(command)
print(json.dumps(sorted(n for n in sys.modules if n == "mlafleet.lab" or n.startswith("mlafleet.lab."))))
"""


def loaded_lab_modules(modules: list[str], commands: list[str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", LOADED, json.dumps(commands), *modules],
                          capture_output=True, text=True, check=False, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_every_production_module_and_parsing_every_production_command_loads_no_lab_module() -> None:
    from mlafleet import cli

    modules = [module_name(p) for p in production_files()
               if p.is_relative_to(PACKAGE) and p.name != "__main__.py"]
    assert {"mlafleet.ops.runner", "mlafleet.weights.shards", "mlafleet.patchset.gguf_glm_dsa",
            "mlafleet.kernels.sparse_mla"} <= set(modules)
    commands = [c for c, m in cli.COMMANDS.items() if not m.startswith("mlafleet.lab")]
    assert {"rollout", "status", "weights", "patchset", "wheelhouse"} <= set(commands)
    assert loaded_lab_modules(modules, commands) == []
    # ... while the lab's own command does load it (the check can see a loaded lab module)
    assert loaded_lab_modules([], ["lab"]) == ["mlafleet.lab", "mlafleet.lab.containers"]


def test_one_folder_per_job() -> None:
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "cli.py"]
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(JOBS)
    for job in JOBS:
        assert (PACKAGE / job / "__init__.py").is_file(), job
    # docs/layout.md names every module of every folder
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    missing = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and f"`{p.relative_to(REPO)}`" not in text]
    assert not missing, f"docs/layout.md does not name {missing}"


def test_entry_points_run() -> None:
    """The console script and the `python -m` forms that roles, molecule and tests call."""
    bin_dir = Path(sys.executable).parent
    top = subprocess.run([str(bin_dir / "mlafleet"), "--help"], capture_output=True, text=True, check=False, cwd="/")
    assert top.returncode == 0 and all(c in top.stdout for c in ("rollout", "lab", "weights", "wheelhouse")), top.stderr
    for args, usage in ((["-m", "mlafleet.cli", "status", "--help"], "usage: mlafleet status"),
                        (["-m", "mlafleet.patchset", "build", "--help"], "usage: python -m mlafleet.patchset patchset build"),
                        (["-m", "mlafleet.weights", "weights", "verify", "--help"], "usage: mlafleet weights verify"),
                        (["-m", "mlafleet.lab.standin_repo", "--help"], "--kernel-release")):
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, cwd="/")
        assert done.returncode == 0 and usage in done.stdout, (args, done.stdout[-500:], done.stderr[-1500:])
    gate = subprocess.run([sys.executable, "-m", "mlafleet.ops.perfgate"], capture_output=True, text=True,
                          check=False, cwd="/")
    assert gate.returncode != 0 and "usage: python -m mlafleet.ops.perfgate" in gate.stderr


def test_every_condition_in_the_yaml_is_a_string() -> None:
    """A `that:`/`when:` item whose text holds ': ' is a YAML mapping, not a condition; Ansible only
    says so when the task runs ("Conditional expressions must be strings"), late in a molecule run."""
    import yaml

    keys = ("that", "when", "failed_when", "changed_when", "until")
    bad = []

    def walk(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in keys:
                    for item in value if isinstance(value, list) else [value]:
                        if not isinstance(item, (str, bool)):
                            bad.append(f"{where}: {key}: {item!r}"[:200])
                walk(value, where)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    for path in sorted(REPO.glob("**/*.yml")):
        if any(part.startswith(".") for part in path.relative_to(REPO).parts) or "collections" in path.parts:
            continue
        try:
            walk(yaml.safe_load(path.read_text(encoding="utf-8")), path.relative_to(REPO))
        except yaml.YAMLError:
            continue
    assert not bad, bad
