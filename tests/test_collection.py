"""The repository root as the Ansible collection mlafleet.fleet (galaxy.yml).

`ansible-galaxy collection build` gives a tarball of Ansible content only (no tests, molecule,
bench, Python package, lab or docs images); it installs offline into an empty collections path;
a playbook outside the checkout that names only fully qualified names (a role, modules, one of
them with the collection's module_utils, a filter) runs from that install against localhost; and
`ansible-test sanity` passes for the collection's modules and module_utils on the controller's
Python (the tests that need nothing beyond the controller's pinned packages).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((REPO / "galaxy.yml").read_text(encoding="utf-8"))
# The collections the controller's `ansible` package carries (ansible.posix, which the roles use).
CONTROLLER_COLLECTIONS = Path(sysconfig.get_paths()["purelib"])
MODULES = ("gguf_weights_stage", "gguf_weights_merge", "mlafleet_rollout_lock", "mlafleet_vllm_patch",
           "mlafleet_release_switch")


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """No ansible.cfg of the checkout, no ANSIBLE_* of the caller: only what is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "MOLECULE_"))}
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}/usr/bin:/bin", ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(home / ".ansible-tmp"), ANSIBLE_REMOTE_TEMP=str(home / ".ansible-tmp"),
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0", **extra)
    return env


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("collection-build")
    done = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(out), str(REPO)],
                          capture_output=True, text=True, check=False, timeout=300, cwd=out,
                          env=clean_env(out))
    assert done.returncode == 0, done.stdout + done.stderr
    path = out / f"{GALAXY['namespace']}-{GALAXY['name']}-{GALAXY['version']}.tar.gz"
    assert path.is_file(), sorted(p.name for p in out.iterdir())
    return path


def test_galaxy_metadata_names_the_collection_and_what_the_roles_use() -> None:
    assert (GALAXY["namespace"], GALAXY["name"]) == ("mlafleet", "fleet")
    runtime = yaml.safe_load((REPO / "meta" / "runtime.yml").read_text(encoding="utf-8"))
    assert runtime["requires_ansible"].startswith(">=2.19")
    # every collection a role or playbook calls a module of (other than ansible.builtin and itself)
    used = set()
    for path in [*(REPO / "roles").rglob("*.yml"), *(REPO / "playbooks").rglob("*.yml")]:
        for line in path.read_text(encoding="utf-8").splitlines():
            word = line.strip().removeprefix("- ").split(":")[0]
            parts = word.split(".")
            if len(parts) == 3 and all(p.isidentifier() for p in parts) and line.rstrip().endswith(":"):
                used.add(".".join(parts[:2]))
    assert used - {"ansible.builtin", "mlafleet.fleet"} == set(GALAXY["dependencies"])


def test_the_tarball_holds_only_ansible_content(tarball: Path) -> None:
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
    tops = {n.split("/")[0] for n in names}
    assert {"roles", "playbooks", "plugins", "meta", "MANIFEST.json", "FILES.json", "README.md"} <= tops
    for outside in ("tests", "molecule", "bench", "mlafleet", "scripts", "inventory", "build", "reports",
                    "collections", ".lab", ".dev", ".venv", ".git", ".ci", "Makefile", "pyproject.toml"):
        assert outside not in tops, outside
    assert not [n for n in names if n.endswith((".png", ".log", ".pyc"))]
    assert not [n for n in names if n.startswith(("files/lab", "files/models", "docs/e2e"))]
    assert "requirements/controller.txt" not in names
    # what the playbooks and roles read: the patch sets and the release lock files
    assert "files/vllm/0.20.2/manifest.json" in names and "requirements/releases/vllm-0.20.2.txt" in names
    for module in MODULES:
        assert f"plugins/modules/{module}.py" in names
    for utils in ("digest", "gguf_stage", "gguf_merge"):
        assert f"plugins/module_utils/{utils}.py" in names
    for role in sorted(p.name for p in (REPO / "roles").iterdir()):
        assert f"roles/{role}/meta/argument_specs.yml" in names, role
    for playbook in ("site", "rollback"):
        assert f"playbooks/{playbook}.yml" in names


PLAYBOOK = """
- name: Only fully qualified names from the installed collection
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    lock: "{{ work }}/lock.json"
  tasks:
    - name: Take the lock with the collection's role
      ansible.builtin.include_role:
        name: mlafleet.fleet.rollout_lock
      vars:
        rollout_lock_path: "{{ lock }}"
        rollout_lock_run: run-1
        rollout_lock_owner: tester@controller

    - name: Another run is refused by the collection's module
      mlafleet.fleet.mlafleet_rollout_lock:
        path: "{{ lock }}"
        run: run-2
        owner: other@controller
      register: refused
      failed_when: false

    - name: Stage a shard from a directory (the module imports the collection's module_utils)
      mlafleet.fleet.gguf_weights_stage:
        dest: "{{ work }}/dest"
        shards: "{{ shards }}"
        sources: [{type: path, path: "{{ work }}/origin"}]
        reserve_mb: 0
      register: staged

    - name: Report what happened
      ansible.builtin.copy:
        dest: "{{ work }}/result.json"
        content: >-
          {{ {'refused': refused.msg, 'lock': lookup('ansible.builtin.file', lock) | from_json,
              'present': staged.present, 'fetched': staged.fetched,
              'parallel': ['--tensor-parallel-size=2', '-pp', '3'] | mlafleet.fleet.preflight_parallel_sizes}
             | to_json }}
        mode: "0644"
"""


def test_the_installed_collection_runs_a_playbook_of_fully_qualified_names(tarball: Path, tmp_path: Path) -> None:
    collections = tmp_path / "collections"
    collections.mkdir()
    # ansible.posix comes from the controller's installed collections, not from a network: --no-deps
    done = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline", "--no-deps",
                           "-p", str(collections), str(tarball)],
                          capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path,
                          env=clean_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    installed = collections / "ansible_collections" / "mlafleet" / "fleet"
    assert (installed / "MANIFEST.json").is_file() and not (installed / "tests").exists()

    work = tmp_path / "elsewhere"  # outside the checkout: no ansible.cfg, no roles/, no collections/ link
    (work / "origin").mkdir(parents=True)
    data = os.urandom(100_000)
    (work / "origin" / "tiny-00001-of-00001.gguf").write_bytes(data)
    shards = [{"name": "tiny-00001-of-00001.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    (work / "play.yml").write_text(PLAYBOOK, encoding="utf-8")
    env = clean_env(tmp_path, ANSIBLE_COLLECTIONS_PATH=f"{collections}{os.pathsep}{CONTROLLER_COLLECTIONS}",
                    ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false")

    # the names resolve to the install, nothing else
    doc = subprocess.run([str(BIN / "ansible-doc"), "-t", "module", "mlafleet.fleet.mlafleet_rollout_lock"],
                         capture_output=True, text=True, check=False, timeout=120, cwd=work, env=env)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert str(installed / "plugins" / "modules" / "mlafleet_rollout_lock.py") in doc.stdout
    assert str(REPO) not in doc.stdout

    done = subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", "-e", f"work={work}",
                           "-e", json.dumps({"shards": shards, "ansible_python_interpreter": sys.executable}),
                           "play.yml"],
                          capture_output=True, text=True, check=False, timeout=300, cwd=work, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((work / "result.json").read_text(encoding="utf-8"))
    assert result["lock"]["run"] == "run-1" and result["lock"]["owner"] == "tester@controller"
    assert "another rollout holds this host" in result["refused"] and "run run-1" in result["refused"]
    assert result["present"] == 1 and result["fetched"] == ["tiny-00001-of-00001.gguf"]
    assert (work / "dest" / "tiny-00001-of-00001.gguf").read_bytes() == data
    assert result["parallel"]["tensor"] == 2 and result["parallel"]["pipeline"] == 3
    assert result["parallel"]["world"] == 6


def makefile_sanity_tests() -> tuple[str, ...]:
    """The Makefile's SANITY_TESTS (what `make lint` runs): the tests that run offline on the
    controller's Python, those without requirements of their own."""
    text = (REPO / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("SANITY_TESTS :="))
    return tuple(line.split(":=", 1)[1].split())


SANITY_TESTS = makefile_sanity_tests()


def sanity_tree(root: Path) -> Path:
    """The collection's modules and module_utils at ansible_collections/mlafleet/fleet, as ansible-test wants."""
    tree = root / "ansible_collections" / "mlafleet" / "fleet"
    tree.mkdir(parents=True)
    for name in ("galaxy.yml", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    for part in ("meta", "plugins/modules", "plugins/module_utils"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def test_ansible_test_sanity_passes_for_the_modules_and_module_utils(tmp_path: Path) -> None:
    assert {"compile", "shebang", "runtime-metadata"} <= set(SANITY_TESTS)
    tree = sanity_tree(tmp_path)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run([str(BIN / "ansible-test"), "sanity", "--local", "--python", python, "--color", "no",
                           *[a for t in SANITY_TESTS for a in ("--test", t)], "plugins/modules/", "plugins/module_utils/"],
                          capture_output=True, text=True, check=False, timeout=600, cwd=tree,
                          env=clean_env(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for test in SANITY_TESTS:
        assert f'Running sanity test "{test}"' in output, output[-3000:]


def test_sanity_catches_a_broken_module(tmp_path: Path) -> None:
    """The same run fails for a module that does not compile: the test above can fail."""
    tree = sanity_tree(tmp_path)
    (tree / "plugins" / "modules" / "broken.py").write_text("#!/usr/bin/python\ndef main(:\n", encoding="utf-8")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run([str(BIN / "ansible-test"), "sanity", "--local", "--python", python, "--color", "no",
                           "--test", "compile", "plugins/modules/"],
                          capture_output=True, text=True, check=False, timeout=600, cwd=tree, env=clean_env(tmp_path))
    assert done.returncode != 0 and "broken.py" in done.stdout + done.stderr


def test_docs_name_every_role_module_plugin_and_playbook() -> None:
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    names = [p.name for p in (REPO / "roles").iterdir() if p.is_dir()]
    names += [p.stem for p in (REPO / "playbooks").glob("*.yml")]
    names += [p.stem for p in (REPO / "plugins" / "modules").glob("*.py")]
    names += [p.stem for p in (REPO / "plugins" / "callback").glob("*.py")]
    names += [p.stem for p in (REPO / "plugins" / "action").glob("*.py")]
    for path in (REPO / "plugins" / "filter").glob("*.py"):
        names += re.findall(r'"([a-z_]+)": ', path.read_text(encoding="utf-8").split("def filters", 1)[1])
    missing = [n for n in names if f"`{n}`" not in text and f"mlafleet.fleet.{n}`" not in text]
    assert not missing, f"docs/layout.md does not name {missing}"
    assert "plugins/module_utils/digest.py" in text
