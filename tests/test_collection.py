"""The repository root as the Ansible collection mlafleet.fleet (galaxy.yml).

`ansible-galaxy collection build` gives a tarball of Ansible content only (every member is
checked: no tests, molecule, bench, Python package, lab or docs images); it installs offline into
an empty collections path; a playbook outside the checkout that names only fully qualified names
runs from that install against localhost (connection local) with the collections path set to the
install alone: the rollout_lock and vllm_rollback roles, the lock, staging, merge and release
switch modules (with their module_utils), the filters and the variable-check action (with its
plugin_utils), every module file ansible packs and every plugin file it lists lying in the
install; and `ansible-test sanity` passes for the collection's modules and module_utils on the
controller's Python (the tests that need nothing beyond the controller's pinned packages).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((REPO / "galaxy.yml").read_text(encoding="utf-8"))
MODULES = ("weights_stage", "gguf_weights_merge", "mlafleet_rollout_lock", "mlafleet_vllm_patch",
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


def test_the_checkout_is_the_collection_under_a_version_of_its_own() -> None:
    """collections/ansible_collections/mlafleet/fleet is the checkout's content (its names resolve to
    the checkout), as version 0.0.0+checkout: never the release's version, so that ansible-galaxy,
    which counts the checkout among the installed collections, installs a release tarball beside it."""
    link = REPO / "collections" / "ansible_collections" / "mlafleet" / "fleet"
    manifest = json.loads((link / "MANIFEST.json").read_text(encoding="utf-8"))["collection_info"]
    assert (manifest["namespace"], manifest["name"]) == (GALAXY["namespace"], GALAXY["name"])
    assert manifest["version"] == "0.0.0+checkout" != GALAXY["version"]
    assert manifest["dependencies"] == GALAXY["dependencies"]
    for part in ("roles", "playbooks", "plugins", "meta", "files", "requirements"):
        assert (link / part).resolve() == REPO / part, part


def test_the_tarball_holds_only_ansible_content(tarball: Path) -> None:
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
    tops = {n.split("/")[0] for n in names}
    assert {"roles", "playbooks", "plugins", "meta", "MANIFEST.json", "FILES.json", "README.md"} <= tops
    for outside in ("tests", "molecule", "bench", "scripts", "inventory", "build", "reports",
                    "collections", ".lab", ".dev", ".venv", ".git", ".ci", "Makefile", "pyproject.toml"):
        assert outside not in tops, outside
    assert not [n for n in names if n.endswith((".png", ".log", ".pyc"))]
    assert not [n for n in names if n.startswith(("files/lab", "files/models", "docs/e2e"))]
    assert "requirements/controller.txt" not in names
    # what the playbooks and roles read: the patch sets and the release lock files
    assert "files/vllm/0.20.2/manifest.json" in names and "requirements/releases/vllm-0.20.2.txt" in names
    for module in MODULES:
        assert f"plugins/modules/{module}.py" in names
    for utils in ("digest", "weights_stage", "gguf_merge"):
        assert f"plugins/module_utils/{utils}.py" in names
    for role in sorted(p.name for p in (REPO / "roles").iterdir()):
        assert f"roles/{role}/meta/argument_specs.yml" in names, role
    for playbook in ("site", "rollback"):
        assert f"playbooks/{playbook}.yml" in names
    # every member, listed: Ansible content, the patch sets and lock files it reads, its docs, and
    # the controller modules its roles and plugins run (below); no test, lab, bench file anywhere
    assert tops == {"roles", "playbooks", "plugins", "meta", "files", "requirements", "docs", "mlafleet",
                    "MANIFEST.json", "FILES.json", "README.md", "CHANGELOG.md"}, sorted(tops)
    assert {n.split("/")[1] for n in names if n.startswith("files/") and n.count("/") >= 1 and n != "files/"} == {"vllm"}
    assert not [n for n in names if set(n.split("/")) & {"tests", "test", "bench", "molecule", "lab",
                                                         "inventory", "scripts", "build", "__pycache__"}]
    assert not [n for n in names if n.rsplit("/", 1)[-1].startswith(("test_", "conftest"))]
    python = [n for n in names if n.endswith(".py")]
    assert python and all(n.startswith(("plugins/", "files/vllm/", "mlafleet/ops/", "mlafleet/__init__"))
                          or re.match(r"roles/\w+/files/", n) for n in python), python
    # of the mlafleet package, exactly what the perf gate and the report callback import (nothing of
    # the CLI, the runner, the lab ...), and the report's template
    with tarfile.open(tarball) as tar:
        shipped = {m.name for m in tar.getmembers() if m.isfile() and m.name.startswith("mlafleet/")}
    assert shipped == controller_modules(), sorted(shipped)


def controller_modules(roots: tuple[str, ...] = ("mlafleet.ops.perfgate",)) -> set[str]:
    """The mlafleet files that the modules the collection runs on the controller import, at any depth
    (imports inside functions too), with the __init__.py of every package on the way."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for depth in range(1, len(parts)):
            seen.add("/".join(parts[:depth]) + "/__init__.py")
        path = "/".join(parts) + ".py"
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse((REPO / path).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "mlafleet"]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(parts[:-node.level] + ([node.module] if node.module else []))
                todo += [f"{base}.{a.name}" if (REPO / base.replace(".", "/") / f"{a.name}.py").is_file() else base
                         for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlafleet":
                todo += [f"{node.module}.{a.name}" if (REPO / node.module.replace(".", "/") / f"{a.name}.py").is_file()
                         else node.module for a in node.names]
    return {p for p in seen if (REPO / p).is_file()}


def test_controller_modules_follows_every_kind_of_import() -> None:
    """The closure above sees what the tarball must carry: the report the runner imports inside a
    function, the ones the CLI imports by relative or absolute name, every package's __init__.py."""
    closure = controller_modules(("mlafleet.ops.runner",))
    assert {"mlafleet/__init__.py", "mlafleet/ops/__init__.py", "mlafleet/ops/runner.py"} <= closure
    assert controller_modules() >= {"mlafleet/ops/perfgate.py"}
    assert "mlafleet/ops/runner.py" not in controller_modules()


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
      mlafleet.fleet.weights_stage:
        dest: "{{ work }}/dest"
        shards: "{{ shards }}"
        sources: [{type: path, path: "{{ work }}/origin"}]
        reserve_mb: 0
      register: staged

    - name: Stage a real two-shard GGUF model (its manifest checked by the collection's filter first)
      mlafleet.fleet.weights_stage:
        dest: "{{ work }}/model"
        shards: "{{ model.shards }}"
        sources: [{type: path, path: "{{ work }}/model-origin"}]
        reserve_mb: 0
      register: model_staged
      when: model | mlafleet.fleet.weights_manifest_problem == ''

    - name: Merge its shards into one file (gguf_merge of the collection's module_utils)
      mlafleet.fleet.gguf_weights_merge:
        dest: "{{ work }}/model"
        shards: "{{ model.shards | map(attribute='name') | list }}"
        output: "{{ work }}/model/tiny-glm.gguf"
      register: merged

    - name: Roll back with the collection's role (its switch is the collection's mlafleet_release_switch)
      ansible.builtin.include_role:
        name: mlafleet.fleet.vllm_rollback
      vars:
        vllm_rollback_root: "{{ work }}/root"

    - name: Switch forward again with the module itself
      mlafleet.fleet.mlafleet_release_switch:
        root: "{{ work }}/root"
        release: rel-b
      register: forward

    - name: Name a misspelled variable with the collection's action (its check in plugin_utils)
      mlafleet.fleet.mlafleet_check_vars:
      register: checked

    - name: Report what happened
      ansible.builtin.copy:
        dest: "{{ work }}/result.json"
        content: >-
          {{ {'refused': refused.msg, 'lock': lookup('ansible.builtin.file', lock) | from_json,
              'present': staged.present, 'fetched': staged.fetched,
              'parallel': ['--tensor-parallel-size=2', '-pp', '3'] | mlafleet.fleet.preflight_parallel_sizes,
              'model_fetched': model_staged.fetched, 'merged': merged,
              'bad_manifest': {'format': 'x'} | mlafleet.fleet.weights_manifest_problem,
              'restored': vllm_rollback_release_id, 'forward': forward, 'unknown': checked.unknown}
             | to_json }}
        mode: "0644"
"""


def test_the_installed_collection_runs_a_playbook_of_fully_qualified_names(tarball: Path, tmp_path: Path) -> None:
    """Roles, modules (with their module_utils), filters and the action of the installed copy, and
    nothing but it: the collections path is the install directory alone (the playbook needs no
    other collection), sys.path is not scanned, and ansible reports every plugin file under it."""
    from weights_support import write_model

    from mlafleet.weights import shards as weights

    collections = tmp_path / "collections"
    collections.mkdir()
    # ansible.posix (what other roles call) is not needed here and not installed: --no-deps
    done = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline", "--no-deps",
                           "-p", str(collections), str(tarball)],
                          capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path,
                          env=clean_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    installed = collections / "ansible_collections" / "mlafleet" / "fleet"
    assert (installed / "MANIFEST.json").is_file() and not (installed / "tests").exists(), done.stdout + done.stderr

    work = tmp_path / "elsewhere"  # outside the checkout: no ansible.cfg, no roles/, no collections/ link
    (work / "origin").mkdir(parents=True)
    data = os.urandom(100_000)
    (work / "origin" / "tiny-00001-of-00001.gguf").write_bytes(data)
    shards = [{"name": "tiny-00001-of-00001.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    model_paths = write_model(work / "model-origin", shards=2, tensors_per_shard=2)
    model = weights.build_manifest(work / "model-origin")
    for release in ("rel-a", "rel-b"):  # a host's release root: current rel-b, previous rel-a
        (work / "root" / "releases" / release / "venv" / "bin").mkdir(parents=True)
        (work / "root" / "releases" / release / "venv" / "bin" / "python").write_text("")
        (work / "root" / "releases" / release / "release.json").write_text(json.dumps({"id": release}))
    os.symlink("releases/rel-b", work / "root" / "current")
    os.symlink("releases/rel-a", work / "root" / "previous")
    (work / "play.yml").write_text(PLAYBOOK, encoding="utf-8")
    env = clean_env(tmp_path, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false")

    # the names resolve to the install, nothing else
    doc = subprocess.run([str(BIN / "ansible-doc"), "-t", "module", "mlafleet.fleet.mlafleet_rollout_lock"],
                         capture_output=True, text=True, check=False, timeout=120, cwd=work, env=env)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert str(installed / "plugins" / "modules" / "mlafleet_rollout_lock.py") in doc.stdout
    assert str(REPO) not in doc.stdout
    for kind, names in (("module", MODULES), ("filter", ("weights_manifest_problem", "preflight_parallel_sizes"))):
        listed = subprocess.run([str(BIN / "ansible-doc"), "-t", kind, "-F", "mlafleet.fleet"],
                                capture_output=True, text=True, check=False, timeout=120, cwd=work, env=env)
        files = dict(line.split(None, 1) for line in listed.stdout.splitlines() if line.strip())
        assert {f"mlafleet.fleet.{n}" for n in names} <= set(files), listed.stdout + listed.stderr
        assert all(Path(f.strip()).is_relative_to(installed / "plugins") for f in files.values()), files

    done = subprocess.run([str(BIN / "ansible-playbook"), "-vvv", "-i", "localhost,", "-e", f"work={work}",
                           "-e", json.dumps({"shards": shards, "model": model, "ansible_python_interpreter": sys.executable,
                                             "vllm_server_hots": "0.0.0.0"}),
                           "play.yml"],
                          capture_output=True, text=True, check=False, timeout=300, cwd=work, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # every module ran from the install (ansible names the file it packs for the host)
    used = re.findall(r"Using module file (\S+)", done.stdout)
    ours = {Path(u).stem for u in used if "/mlafleet/fleet/" in u}
    assert ours == {"mlafleet_rollout_lock", "weights_stage", "gguf_weights_merge", "mlafleet_release_switch"}, used
    assert all(Path(u).is_relative_to(installed / "plugins" / "modules") for u in used if "/mlafleet/fleet/" in u), used
    # nothing of the checkout but the controller's venv (ansible itself) is named
    assert set(re.findall(re.escape(str(REPO)) + r"/([^/\s'\"]+)", done.stdout + done.stderr)) <= {".venv"}
    result = json.loads((work / "result.json").read_text(encoding="utf-8"))
    assert result["lock"]["run"] == "run-1" and result["lock"]["owner"] == "tester@controller"
    assert "another rollout holds this host" in result["refused"] and "run run-1" in result["refused"]
    assert result["present"] == 1 and result["fetched"] == ["tiny-00001-of-00001.gguf"]
    assert (work / "dest" / "tiny-00001-of-00001.gguf").read_bytes() == data
    assert result["parallel"]["tensor"] == 2 and result["parallel"]["pipeline"] == 3
    assert result["parallel"]["world"] == 6
    # weights: the manifest passed the filter, both shards staged, merged into one GGUF file
    assert result["model_fetched"] == [p.name for p in model_paths]
    assert result["bad_manifest"].startswith("not an mlafleet weights manifest")
    merged = work / "model" / "tiny-glm.gguf"
    assert result["merged"]["changed"] and result["merged"]["tensors"] == 4
    assert result["merged"]["size"] == merged.stat().st_size
    assert result["merged"]["sha256"] == hashlib.sha256(merged.read_bytes()).hexdigest()
    # the release switch: the role went back to rel-a, the module forward to rel-b
    assert result["restored"] == "rel-a"
    assert result["forward"]["changed"] and result["forward"]["previous"] == "releases/rel-a"
    assert os.readlink(work / "root" / "current") == "releases/rel-b"
    assert os.readlink(work / "root" / "previous") == "releases/rel-a"
    # the action read the installed collection's argument specs
    assert {"name": "vllm_server_hots", "where": "extra variable", "closest": "vllm_server_host"} in result["unknown"]


def bare_python(venv: Path) -> Path:
    """A Python with Ansible and nothing of mlafleet: a venv that sees the controller venv's packages
    through a plain .pth line (whose own .pth files, among them the editable mlafleet install's
    finder, Python does not read), with an ansible-playbook of its own, like a venv that holds only
    `ansible`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    controller = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "ansible").is_dir())
    Path(purelib, "controller-packages.pth").write_text(f"{controller}\n", encoding="utf-8")
    script = venv / "bin" / "ansible-playbook"
    script.write_text(f"#!{python}\nimport sys\nfrom ansible.cli.playbook import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return python


PERF_PLAY = """
- name: The installed collection's perf gate on the controller itself
  hosts: all
  gather_facts: false
  vars:
    mlafleet_run_id: "{{ mlafleet_run }}"
  roles:
    - role: mlafleet.fleet.perf_gate
      vars:
        perf_gate_root: "{{ scratch }}/root"
        perf_gate_base_url: "{{ url }}"
        perf_gate_model: tiny
        perf_gate_release: rel-a
        perf_gate_workload: {input_len: 16, output_len: 8, num_prompts: 4, concurrency: 2, warmup: 1}
        perf_gate_repeats: 2
        perf_gate_thresholds: {itl_p50_ms: 50}
"""


def test_installed_from_the_checkout_it_runs_the_perf_gate_and_the_report_from_an_empty_directory(
        tarball: Path, tmp_path: Path) -> None:
    """`ansible-galaxy collection install -p DIR TARBALL` typed inside the checkout installs (the
    checkout's own collections/ entry is not the released version); then, from an empty working
    directory, with a Python that has no mlafleet package and no ansible.cfg, the collection's
    perf_gate role decides with its own mlafleet.ops.perfgate, the mlafleet_report callback (enabled
    by its full name) renders the page with its own plugin_utils/report.py, and every report lands in
    the working directory's reports/, none in the installed collection."""
    from perf_support import FakeVLLM
    from weights_support import serving

    collections = tmp_path / "collections"
    done = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline", "-p", str(collections),
                           str(tarball)], capture_output=True, text=True, check=False, timeout=300, cwd=REPO,
                          env=clean_env(tmp_path))  # the checkout's ansible.cfg, as a user in the clone has it
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"mlafleet.fleet:{GALAXY['version']} was installed successfully" in done.stdout, done.stdout + done.stderr
    installed = collections / "ansible_collections" / "mlafleet" / "fleet"
    assert (installed / "MANIFEST.json").is_file() and (installed / "mlafleet" / "ops" / "perfgate.py").is_file()

    python = bare_python(tmp_path / "venv")
    bare = subprocess.run([str(python), "-c", "import ansible, jinja2; import mlafleet"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, check=False)
    assert bare.returncode == 1 and "No module named 'mlafleet'" in bare.stderr, bare.stderr

    work = tmp_path / "work"  # the empty working directory
    work.mkdir()
    (tmp_path / "play.yml").write_text(PERF_PLAY, encoding="utf-8")
    (tmp_path / "root" / "releases" / "rel-a").mkdir(parents=True)
    (tmp_path / "hosts.yml").write_text(f"all:\n  hosts:\n    h1:\n      ansible_connection: local\n"
                                        f"      ansible_python_interpreter: {python}\n      ansible_become: false\n")
    env = clean_env(tmp_path, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",
                    ANSIBLE_CALLBACKS_ENABLED="mlafleet.fleet.mlafleet_report")
    env["PATH"] = f"{python.parent}{os.pathsep}/usr/bin:/bin"
    for name in ("PYTHONPATH", "MLAFLEET_REPORT_ROOT", "VIRTUAL_ENV"):
        env.pop(name, None)
    with serving(FakeVLLM()) as server:
        done = subprocess.run([str(python.parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
                               str(tmp_path / "play.yml"), "-e", "mlafleet_run=coll-1",
                               "-e", json.dumps({"scratch": str(tmp_path), "url": f"http://127.0.0.1:{server.server_address[1]}",
                                                 "__perf_gate_client": str(tmp_path / "perf-bench")})],
                              capture_output=True, text=True, check=False, timeout=600, cwd=work, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "No module named" not in out and "could not write the report" not in out, out[-4000:]
    run_dir = work / "reports" / "coll-1"
    verdict = json.loads((run_dir / "perf" / "h1.json").read_text())
    assert verdict["status"] == "baseline" and verdict["release"] == "rel-a"
    assert [p.name for p in (tmp_path / "root" / "releases" / "rel-a" / "perf").iterdir()] == [f"{verdict['workload_key']}.json"]
    assert json.loads((run_dir / "timeline.json").read_text())["hosts"]["h1"]
    assert f"rollout report: {run_dir / 'index.html'}" in done.stdout
    assert "h1" in (run_dir / "index.html").read_text()
    # the installed collection holds what it held: no reports, nothing compiled into it
    assert not [p for p in installed.rglob("*") if p.name in ("reports", "__pycache__")]


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
    names += [p.stem for p in (REPO / "plugins" / "lookup").glob("*.py")]
    for path in (REPO / "plugins" / "filter").glob("*.py"):
        names += re.findall(r'"([a-z_]+)": ', path.read_text(encoding="utf-8").split("def filters", 1)[1])
    missing = [n for n in names if f"`{n}`" not in text and f"mlafleet.fleet.{n}`" not in text]
    assert not missing, f"docs/layout.md does not name {missing}"
    assert "plugins/module_utils/digest.py" in text
    for path in (REPO / "plugins" / "plugin_utils").glob("*.py"):
        assert f"plugins/plugin_utils/{path.name}" in text, path.name
