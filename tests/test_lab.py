"""The lab: image recipe hashing and pruning, inventory, the tiny served model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mlafleet.lab import containers as lab
from mlafleet.lab.labmodel import HIDDEN, HEADS, VOCAB, write_tiny_llama


def test_recipe_hash_is_stable_and_follows_the_recipe(tmp_path: Path, monkeypatch):
    first = lab.recipe_hash()
    assert first == lab.recipe_hash() and len(first) == 12
    monkeypatch.setattr(lab, "PACKAGES", [*lab.PACKAGES, "vim"])
    assert lab.recipe_hash() != first


def test_inventory_names_every_host_and_links_the_lab_vars(tmp_path: Path):
    hosts = [lab.Host("lab1", "mlafleet-lab-1", 32001, "172.20.0.2"),
             lab.Host("lab2", "mlafleet-lab-2", 32002, "172.20.0.3")]
    path = tmp_path / "inv" / "hosts.yml"
    lab.write_inventory_file(path, hosts)
    inv = yaml.safe_load(path.read_text())
    group = inv["all"]["children"]["lab"]
    assert group["hosts"]["lab2"]["ansible_port"] == 32002
    assert group["hosts"]["lab1"]["lab_address"] == "172.20.0.2"
    assert group["vars"]["ansible_connection"] == "ssh" and group["vars"]["mlafleet_lab"] is True
    lab_vars = yaml.safe_load((path.parent / "group_vars" / "all.yml").read_text())
    assert lab_vars["preflight_require_gpu"] is False  # CPU lab hosts say so
    assert group["vars"]["lab_checkout"] == str(lab.REPO)


MODEL_VARS_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.copy:
        dest: "{{ out }}"
        content: "{{ [weights_manifest, weights_source, weights_path, preflight_model_config_src] | to_json }}"
        mode: "0644"
      delegate_to: localhost
"""


def test_the_lab_stages_the_model_of_its_own_checkout_wherever_the_roles_come_from(tmp_path: Path):
    """The lab's weights manifest and model config are the lab checkout's .lab/models/ (from the
    inventory, or molecule's project directory), not a path beside the roles (an installed
    collection has none); the bytes come from the checkout's model directory mounted on each
    host (weights_source path); with no checkout known, the run stops naming what is missing."""
    path = tmp_path / "inv" / "hosts.yml"
    lab.write_inventory_file(path, [lab.Host("lab1", "mlafleet-lab-1", 32001, "172.20.0.2")])
    (tmp_path / "play.yml").write_text(MODEL_VARS_PLAY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "MOLECULE_"))}
    bin_dir = Path(sys.executable).parent

    def model_vars(inventory: Path, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / "ansible-playbook"), "-i", str(inventory), str(tmp_path / "play.yml"),
                               "-e", f"out={tmp_path / 'vars.json'}"], cwd=tmp_path, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=300, check=False)

    done = model_vars(path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert json.loads((tmp_path / "vars.json").read_text()) == [
        f"{lab.REPO}/.lab/models/tiny-llama.manifest.json", "path", lab.MODEL_MOUNT,
        f"{lab.REPO}/.lab/models/tiny-llama/config.json"]
    # a molecule scenario's inventory: no lab_checkout, the project directory in the environment
    bare = tmp_path / "molecule" / "hosts.yml"
    bare.parent.mkdir()
    bare.write_text("all:\n  hosts:\n    h1: {}\n")
    (bare.parent / "group_vars").symlink_to(lab.RECIPE_DIR / "group_vars")
    done = model_vars(bare, MOLECULE_PROJECT_DIRECTORY="/srv/clone")
    assert done.returncode == 0, done.stdout[-3000:]
    assert json.loads((tmp_path / "vars.json").read_text())[0] == "/srv/clone/.lab/models/tiny-llama.manifest.json"
    done = model_vars(bare)
    assert done.returncode != 0 and "lab_checkout is not set: `mlafleet lab up` writes it" in done.stdout, done.stdout


def test_the_lab_model_is_written_with_its_weights_manifest(tmp_path: Path, monkeypatch):
    """`mlafleet lab model` writes the snapshot and the manifest the weights role stages it by: every
    file of the directory, with its size and sha256; a model written again gets a new manifest."""
    import hashlib

    monkeypatch.setattr(lab, "LAB_DIR", tmp_path)
    out = lab.write_lab_model()
    manifest = json.loads((tmp_path / "models" / "tiny-llama.manifest.json").read_text())
    assert manifest["model"] == "tiny-llama" and manifest["format"] == "mlafleet-safetensors-manifest/1"
    files = {f["name"]: f for f in manifest["files"]}
    assert set(files) == {p.name for p in out.iterdir()}
    body = (out / "model.safetensors").read_bytes()
    assert files["model.safetensors"]["size"] == len(body)
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(body).hexdigest()
    written = (tmp_path / "models" / "tiny-llama.manifest.json").stat().st_mtime_ns
    lab.write_lab_model()  # nothing to do
    assert (tmp_path / "models" / "tiny-llama.manifest.json").stat().st_mtime_ns == written
    (out / "model.safetensors").unlink()
    lab.write_lab_model()
    again = tmp_path / "models" / "tiny-llama.manifest.json"
    assert again.stat().st_mtime_ns != written and json.loads(again.read_text())["files"] == manifest["files"]


def test_tiny_llama_is_deterministic_and_fits_cpu_attention(tmp_path: Path):
    a = write_tiny_llama(tmp_path / "a", seed=0)
    b = write_tiny_llama(tmp_path / "b", seed=0)
    c = write_tiny_llama(tmp_path / "c", seed=1)
    weights = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(a) == weights(b) and weights(a) != weights(c)
    config = json.loads((a / "config.json").read_text())
    assert config["head_dim"] == HIDDEN // HEADS in (32, 64, 80, 96, 112, 128)
    tok = json.loads((a / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) + len(tok["added_tokens"]) <= VOCAB == config["vocab_size"]
    assert "chat_template" in json.loads((a / "tokenizer_config.json").read_text())


def _tiny_image(ref: str, content: str, tmp_path: Path) -> None:
    """A real one-file image made with `docker import` (no registry needed)."""
    root = tmp_path / ref.replace(":", "-").replace("/", "-")
    root.mkdir()
    (root / "marker").write_text(content)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    lab.sh("docker", "import", "-", ref, stdin=tar.stdout)
    assert tar.wait() == 0


def test_a_new_image_drops_the_outdated_tags_of_its_repository(tmp_path: Path):
    """Old hash-tagged images go (the disk CI ran out of); the kept one and `latest` on it, an image
    a container uses, and other repositories' images stay."""
    lab.ensure_docker()
    repo, other = "mlafleet-test-prune", "mlafleet-test-prune-other"
    for ref in (f"{repo}:aaaaaaaaaaaa", f"{repo}:bbbbbbbbbbbb", f"{repo}:cccccccccccc", f"{other}:aaaaaaaaaaaa"):
        _tiny_image(ref, ref, tmp_path)
    lab.sh("docker", "tag", f"{repo}:cccccccccccc", f"{repo}:latest")
    busy = lab.sh("docker", "create", f"{repo}:bbbbbbbbbbbb", "/marker").stdout.strip()
    try:
        removed = lab.drop_other_tags(repo, "cccccccccccc")
        tags = set(lab.sh("docker", "image", "ls", repo, "--format", "{{.Tag}}").stdout.split())
        assert removed == ["aaaaaaaaaaaa"]
        assert tags == {"bbbbbbbbbbbb", "cccccccccccc", "latest"}  # bbbb: a container uses it
        assert lab.image_exists(f"{other}:aaaaaaaaaaaa")  # another repository is not touched
    finally:
        lab.sh("docker", "rm", "-f", busy, check=False)
        for ref in (f"{repo}:bbbbbbbbbbbb", f"{repo}:cccccccccccc", f"{repo}:latest", f"{other}:aaaaaaaaaaaa"):
            lab.sh("docker", "image", "rm", "-f", ref, check=False)


def test_outdated_images_go_children_first_so_their_layers_are_freed(tmp_path: Path):
    """An old child (lines) made from an old parent (release) by `docker commit`, each also tagged
    `latest` as the last build left them, and the new image not built yet: both old images are
    deleted, not merely untagged (their ids are gone); the current tag stays."""
    lab.ensure_docker()
    parent, child = "mlafleet-test-parent", "mlafleet-test-child"
    _tiny_image(f"{parent}:old000000000", "old parent", tmp_path)
    _tiny_image(f"{parent}:new000000000", "new parent", tmp_path)
    lab.sh("docker", "tag", f"{parent}:old000000000", f"{parent}:latest")
    maker = lab.sh("docker", "create", f"{parent}:old000000000", "/marker").stdout.strip()
    lab.sh("docker", "commit", maker, f"{child}:old000000000")
    lab.sh("docker", "rm", "-f", maker)
    lab.sh("docker", "tag", f"{child}:old000000000", f"{child}:latest")
    inspect = lambda ref: lab.sh("docker", "image", "inspect", "-f", "{{.Id}}", ref).stdout.strip()  # noqa: E731
    old_ids = [inspect(f"{parent}:old000000000"), inspect(f"{child}:old000000000")]
    try:
        assert set(lab.current_image_tags()) == {lab.LINES_IMAGE, lab.RELEASE_IMAGE, lab.BASE_IMAGE,
                                                 f"{lab.BASE_IMAGE}-rootfs"}
        assert list(lab.current_image_tags())[:3] == [lab.LINES_IMAGE, lab.RELEASE_IMAGE, lab.BASE_IMAGE]
        lab.drop_outdated_images({child: "new000000000", parent: "new000000000"})
        assert not any(lab.image_exists(i) for i in old_ids)  # the layers are gone, not only the tags
        assert lab.image_exists(f"{parent}:new000000000")
        assert not lab.image_exists(f"{parent}:latest") and not lab.image_exists(f"{child}:latest")
    finally:
        for ref in (f"{child}:old000000000", f"{child}:latest", f"{parent}:old000000000", f"{parent}:latest",
                    f"{parent}:new000000000"):
            lab.sh("docker", "image", "rm", "-f", ref, check=False)


def _inspected(labels: dict | None, key_source: str | None, running: bool = False) -> dict:
    """The parts of `docker inspect`'s answer for one container that ownership reads."""
    mounts = [{"Type": "bind", "Source": "/sys/fs/cgroup", "Destination": "/sys/fs/cgroup"}]
    if key_source:
        mounts.append({"Type": "bind", "Source": key_source, "Destination": "/root/.ssh/authorized_keys"})
    return {"Name": "/mlafleet-lab-1", "Config": {"Labels": labels}, "Mounts": mounts, "State": {"Running": running}}


def test_a_lab_container_is_owned_by_the_checkout_it_was_made_for(tmp_path: Path):
    """The label names the checkout; a container made before the label existed is known by its key's
    bind mount (.lab/ssh/id_ed25519.pub of the checkout that started it)."""
    other = tmp_path / "other-clone"
    labelled = _inspected({"mlafleet.lab": "lab", lab.CHECKOUT_LABEL: str(other)}, f"{other}/.lab/ssh/id_ed25519.pub")
    assert lab.container_owner(labelled) == other
    assert lab.container_owner(_inspected({"mlafleet.lab": "lab"}, f"{other}/.lab/ssh/id_ed25519.pub")) == other
    assert lab.container_owner(_inspected({"mlafleet.lab": "lab"}, None)) is None
    assert lab.container_owner(_inspected(None, None)) is None
    assert lab.container_owner(_inspected({lab.CHECKOUT_LABEL: str(lab.REPO)}, None)) == lab.REPO


def test_up_keeps_its_own_container_recreates_a_dead_checkouts_and_refuses_a_live_ones(tmp_path: Path):
    """Real containers (created, never started) labelled as `mlafleet lab up` labels them: this
    checkout's is kept; one of a checkout that was deleted goes (docker start of it fails on the
    missing key file), and so does one of this checkout's without the lab model's mount; one of a
    checkout that still exists is refused, naming it and the command that frees it, and kept."""
    lab.ensure_docker()
    image = "mlafleet-test-owner:latest"
    _tiny_image(image, "owner", tmp_path)
    live, dead = tmp_path / "live-clone", tmp_path / "deleted-clone"
    (live / ".lab" / "ssh").mkdir(parents=True)
    (live / ".lab" / "ssh" / "id_ed25519.pub").write_text("ssh-ed25519 AAAA test\n")
    names = {"ours": "mlafleet-ownertest-1", "dead": "mlafleet-ownertest-2", "live": "mlafleet-ownertest-3",
             "old": "mlafleet-ownertest-4", "unmounted": "mlafleet-ownertest-5"}
    owners = {"ours": lab.REPO, "dead": dead, "live": live, "unmounted": lab.REPO}
    try:
        for kind in ("ours", "dead", "live", "unmounted"):
            key = owners[kind] / ".lab" / "ssh" / "id_ed25519.pub"
            model = [] if kind == "unmounted" else ["--mount", f"type=bind,source={tmp_path},target={lab.MODEL_MOUNT}"]
            lab.sh("docker", "create", "--name", names[kind], "--label", "mlafleet.lab=ownertest",
                   "--label", f"{lab.CHECKOUT_LABEL}={owners[kind]}", "--mount",
                   f"type=bind,source={key if key.exists() else '/etc/hostname'},target=/root/.ssh/authorized_keys",
                   *model, image, "/marker")
        # one made before the label existed, bound to the deleted clone's key: known by that mount
        lab.sh("docker", "create", "--name", names["old"], "--label", "mlafleet.lab=ownertest", "-v",
               f"{dead}/.lab/ssh/id_ed25519.pub:/root/.ssh/authorized_keys:ro", image, "/marker")
        # another live checkout's among them: refused before anything is removed
        with pytest.raises(lab.LabError) as refused:
            lab.claim(list(names.values()))
        message = str(refused.value)
        assert f"{names['live']} belongs to the lab of another checkout, {live}" in message
        assert f"cd {live} && make lab-down" in message and f"docker rm -f {names['live']}" in message
        assert "Nothing was started or removed" in message
        assert all(lab.container_exists(c) for c in names.values())
        # without it: this checkout's kept, the dead checkouts' removed, none missing
        # this checkout's without the lab model's mount (an older mlafleet's) goes too, to be made again
        states = lab.claim([names["ours"], names["dead"], names["old"], names["unmounted"], "mlafleet-ownertest-none"])
        assert states == {names["ours"]: "stopped", names["dead"]: "missing", names["old"]: "missing",
                          names["unmounted"]: "missing", "mlafleet-ownertest-none": "missing"}
        assert lab.container_exists(names["ours"])
        assert not any(lab.container_exists(names[k]) for k in ("dead", "old", "unmounted"))
        # down removes this checkout's lab, not the live checkout's container of the same lab name
        lab.down("ownertest", quiet=True)
        assert not lab.container_exists(names["ours"]) and lab.container_exists(names["live"])
    finally:
        for container in names.values():
            lab.sh("docker", "rm", "-f", container, check=False)
        lab.sh("docker", "image", "rm", "-f", image, check=False)
