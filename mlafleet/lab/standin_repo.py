"""Build a STAND-IN of NVIDIA's CUDA apt repository for the lab (molecule scenario roles, its gpu-stack part).

Lab hosts have no GPU and no route to NVIDIA. This module builds a local, signed, flat apt
repository laid out like NVIDIA's (``<root>/<distro>/x86_64/`` with ``Packages``, ``Release``,
``InRelease`` and the signing key beside them) whose packages carry the real package names
(``nvidia-open``, ``nvidia-kernel-open-dkms``, ``cuda-toolkit-13-0``, ...) and stand-in content:
small scripts that behave like the real tools where the roles look (``nvidia-smi``, ``nvcc``,
``dkms``, ``modinfo``, ``mokutil``, ``nvidia-persistenced``). Every package Description,
every stand-in tool's output and this docstring say STAND-IN; nothing here is NVIDIA software.

The simulated kernel: ``/run`` is a tmpfs in the lab containers, so it is emptied by a container
restart just as ``/proc`` is by a reboot. The stand-in kernel module package installs a boot-time
unit that "loads" the module built for the running kernel by writing
``/run/mlafleet-standin/proc-driver-nvidia-version`` (the stand-in of ``/proc/driver/nvidia/version``).
Installing a new driver therefore leaves the old version loaded until the host restarts, which is
exactly what the roles' reboot decision reads.

Needs ``dpkg-deb`` (Debian package ``dpkg``) and ``gpg`` (Debian package ``gnupg``); stdlib otherwise.

    python -m mlafleet.lab.standin_repo --out DIR --kernel-release "$(uname -r)"
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from email.utils import formatdate
from pathlib import Path

from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import sha256_bytes

STANDIN = "STAND-IN (mlafleet lab, not NVIDIA software)"
MAINTAINER = "mlafleet lab stand-ins <standin@mlafleet.invalid>"
STATE_DIR = "/run/mlafleet-standin"
PROC_VERSION_FILE = f"{STATE_DIR}/proc-driver-nvidia-version"
KEY_NAME = "mlafleet-standin.pub"

# Driver releases published in the stand-in repository: an older one (what a host may already
# run), the one the scenario pins, and a newer one that holds and pins must keep out.
DRIVER_VERSIONS = ("580.82.07", "580.95.05", "580.105.08")
DEBIAN_REVISION = "1"
# cuda-toolkit-13-0 releases: (meta-package version, nvcc package version, nvcc build shown).
CUDA_RELEASES = (("13.0.1-1", "13.0.48-1", "V13.0.48"), ("13.0.2-1", "13.0.88-1", "V13.0.88"))
# What `nvcc --list-gpu-code` prints for CUDA 13.0 (architectures below sm_75 were dropped in 13.0).
CUDA_13_0_GPU_CODES = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_100",
                       "sm_103", "sm_110", "sm_120", "sm_121")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One simulated GPU as nvidia-smi reports it."""

    name: str = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    compute_capability: str = "12.0"
    memory_mib: int = 97887


@dataclasses.dataclass
class Package:
    """A stand-in .deb: control fields, files (path -> (content, mode)) and maintainer scripts."""

    name: str
    version: str
    summary: str
    depends: list[str] = dataclasses.field(default_factory=list)
    conflicts: list[str] = dataclasses.field(default_factory=list)
    provides: list[str] = dataclasses.field(default_factory=list)
    files: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    scripts: dict[str, str] = dataclasses.field(default_factory=dict)
    architecture: str = "amd64"

    def control(self) -> str:
        fields = [("Package", self.name), ("Version", self.version),
                  ("Architecture", self.architecture), ("Maintainer", MAINTAINER),
                  ("Section", "misc"), ("Priority", "optional")]
        for key, values in (("Depends", self.depends), ("Conflicts", self.conflicts),
                            ("Replaces", self.conflicts), ("Provides", self.provides)):
            if values:
                fields.append((key, ", ".join(values)))
        fields.append(("Description", f"{STANDIN}: {self.summary}\n "
                                      "Built by mlafleet's tests for the lab; it only imitates the "
                                      "real package's interface."))
        return "".join(f"{key}: {value}\n" for key, value in fields)


def _script(body: str) -> str:
    return textwrap.dedent(body).lstrip()


# ---------------------------------------------------------------- stand-in tools (run on lab hosts)

def _nvidia_smi(version: str, gpus: list[Gpu]) -> str:
    table = json.dumps([dataclasses.asdict(g) for g in gpus])
    return _script(f'''\
        #!/usr/bin/python3
        """STAND-IN nvidia-smi (mlafleet lab): no GPU here, it reports simulated GPUs."""
        import json, re, sys
        USERSPACE = "{version}"
        GPUS = json.loads({table!r})
        PROC = "{PROC_VERSION_FILE}"
        try:
            proc = open(PROC).read()
        except FileNotFoundError:
            print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                  "Make sure that the latest NVIDIA driver is installed and running. "
                  "(STAND-IN: no stand-in module is loaded)")
            sys.exit(9)
        loaded = re.search(r"NVRM version:.*?\\s(\\d+\\.\\d+(?:\\.\\d+)?)\\s", proc).group(1)
        if loaded != USERSPACE:
            print("Failed to initialize NVML: Driver/library version mismatch")
            print("NVML library version: " + USERSPACE.rsplit(".", 1)[0])
            sys.exit(18)
        if "Open Kernel Module" not in proc and any(float(g["compute_capability"]) >= 10.0 for g in GPUS):
            print("No devices were found")
            sys.exit(6)
        args = sys.argv[1:]
        query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
        if query is None and "--query-gpu" in args:
            query = args[args.index("--query-gpu") + 1]
        fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "csv")
        if query:
            fields = [f.strip() for f in query.split(",")]
            units = "nounits" not in fmt
            def value(i, g, f):
                if f == "index":
                    return str(i)
                if f in ("name", "gpu_name"):
                    return g["name"]
                if f == "compute_cap":
                    return g["compute_capability"]
                if f == "memory.total":
                    return str(g["memory_mib"]) + (" MiB" if units else "")
                if f == "driver_version":
                    return USERSPACE
                if f in ("uuid", "gpu_uuid"):
                    return "GPU-5ea1d000-0000-4000-8000-%012d" % i
                if f in ("pci.bus_id", "gpu_bus_id"):
                    return "00000000:%02X:00.0" % (0x18 + i)
                if f == "persistence_mode":
                    return "Enabled"
                print('Field "%s" is not a valid field to query.' % f)
                sys.exit(2)
            if "noheader" not in fmt:
                print(", ".join(fields))
            for i, g in enumerate(GPUS):
                print(", ".join(value(i, g, f) for f in fields))
            sys.exit(0)
        if "-L" in args or "--list-gpus" in args:
            for i, g in enumerate(GPUS):
                print("GPU %d: %s (UUID: GPU-5ea1d000-0000-4000-8000-%012d) [STAND-IN]" % (i, g["name"], i))
            sys.exit(0)
        print("STAND-IN nvidia-smi (mlafleet lab, not NVIDIA software)")
        print("NVIDIA-SMI %s    Driver Version: %s    CUDA Version: 13.0" % (USERSPACE, USERSPACE))
        for i, g in enumerate(GPUS):
            print("| %d  %s  %dMiB  compute capability %s |" % (i, g["name"], g["memory_mib"], g["compute_capability"]))
        ''')


def _dkms() -> str:
    return _script(f'''\
        #!/bin/sh
        # STAND-IN dkms (mlafleet lab): "builds" a stand-in module only when the running kernel's
        # headers are installed, as the real dkms does; it compiles nothing.
        set -eu
        action="${{1:-}}"; shift || true
        module=""; version=""; kernel="$(uname -r)"
        while [ $# -gt 0 ]; do
            case "$1" in
                -m) module="$2"; shift 2 ;;
                -v) version="$2"; shift 2 ;;
                -k) kernel="$2"; shift 2 ;;
                */*) module="${{1%%/*}}"; version="${{1#*/}}"; shift ;;
                *) shift ;;
            esac
        done
        dest="/lib/modules/$kernel/updates/dkms"
        case "$action" in
            install)
                src="/usr/src/$module-$version/dkms-standin.modinfo"
                [ -f "$src" ] || {{ echo "Error! Could not locate dkms.conf for $module/$version (STAND-IN)" >&2; exit 4; }}
                if [ ! -d "/lib/modules/$kernel/build" ]; then
                    echo "Error! Your kernel headers for kernel $kernel cannot be found at /lib/modules/$kernel/build (STAND-IN dkms)" >&2
                    exit 1
                fi
                mkdir -p "$dest" /var/lib/dkms
                [ -f /var/lib/dkms/mok.pub ] || echo "STAND-IN DKMS MOK signing key (mlafleet lab)" > /var/lib/dkms/mok.pub
                cp "$src" "$dest/$module.ko"
                echo "$module/$version: installed for $kernel (STAND-IN dkms, nothing compiled)" ;;
            remove)
                rm -f "$dest/$module.ko"
                echo "$module/$version: removed (STAND-IN dkms)" ;;
            status)
                for f in /lib/modules/*/updates/dkms/*.ko; do
                    [ -f "$f" ] && echo "$(sed -n 's/^version=//p' "$f"), $(basename "$(dirname "$(dirname "$(dirname "$f")")")"): installed (STAND-IN)"
                done; true ;;
            *) echo "STAND-IN dkms: unsupported action '$action'" >&2; exit 2 ;;
        esac
        ''')


def _modinfo() -> str:
    return _script('''\
        #!/bin/sh
        # STAND-IN modinfo (mlafleet lab): reads the key=value lines of a stand-in module file.
        set -eu
        field=""
        while [ $# -gt 0 ]; do
            case "$1" in
                -F) field="$2"; shift 2 ;;
                -F*) field="${1#-F}"; shift ;;
                *) name="$1"; shift ;;
            esac
        done
        case "$name" in
            */*) file="$name" ;;
            *) file="/lib/modules/$(uname -r)/updates/dkms/$name.ko" ;;
        esac
        if [ ! -f "$file" ]; then
            echo "modinfo: ERROR: Module $name not found. (STAND-IN modinfo)" >&2
            exit 1
        fi
        if [ -n "$field" ]; then
            sed -n "s/^$field=//p" "$file"
        else
            echo "filename:       $file"
            sed -n 's/^\\([a-z_]*\\)=\\(.*\\)$/\\1:\\t\\2/p' "$file"
        fi
        ''')


def _mokutil() -> str:
    return _script(f'''\
        #!/bin/sh
        # STAND-IN mokutil (mlafleet lab): Secure Boot state from /etc/mlafleet-standin/secure-boot,
        # enrolled keys as sha256 sums in /etc/mlafleet-standin/mok-enrolled.
        set -eu
        case "${{1:-}}" in
            --sb-state)
                state="$(cat /etc/mlafleet-standin/secure-boot 2>/dev/null || echo disabled)"
                echo "SecureBoot $state" ;;
            --test-key)
                key="$2"
                [ -f "$key" ] || {{ echo "Failed to read $key" >&2; exit 255; }}
                sum="$(sha256sum "$key" | cut -d' ' -f1)"
                if grep -qx "$sum" /etc/mlafleet-standin/mok-enrolled 2>/dev/null; then
                    echo "$key is already enrolled"; exit 1
                fi
                echo "$key is not enrolled" ;;
            *) echo "STAND-IN mokutil: unsupported option '${{1:-}}'" >&2; exit 2 ;;
        esac
        ''')


def _module_load() -> str:
    return _script(f'''\
        #!/bin/sh
        # STAND-IN kernel (mlafleet lab): at boot, "load" the nvidia module built for the running
        # kernel by writing the stand-in of /proc/driver/nvidia/version.
        set -eu
        ko="/lib/modules/$(uname -r)/updates/dkms/nvidia.ko"
        mkdir -p {STATE_DIR}
        [ -f "$ko" ] || exit 0
        version="$(sed -n 's/^version=//p' "$ko")"
        if grep -qx 'license=Dual MIT/GPL' "$ko"; then
            kind="NVIDIA UNIX Open Kernel Module for x86_64"
        else
            kind="NVIDIA UNIX x86_64 Kernel Module"
        fi
        printf 'NVRM version: %s  %s  Release Build  (STAND-IN mlafleet lab)\\nGCC version:  STAND-IN\\n' "$kind" "$version" > {PROC_VERSION_FILE}
        ''')


def _persistenced() -> str:
    return _script(f'''\
        #!/bin/sh
        # STAND-IN nvidia-persistenced (mlafleet lab): refuses to start without a matching loaded module.
        set -eu
        if [ ! -f {PROC_VERSION_FILE} ]; then
            echo "nvidia-persistenced failed to initialize: no NVIDIA kernel module loaded (STAND-IN)" >&2
            exit 1
        fi
        echo "STAND-IN nvidia-persistenced running: $(head -1 {PROC_VERSION_FILE})"
        exec sleep infinity
        ''')


def _nvcc(release: str, build: str) -> str:
    codes = "\\n".join(CUDA_13_0_GPU_CODES)
    archs = "\\n".join(c.replace("sm_", "compute_") for c in CUDA_13_0_GPU_CODES)
    return _script(f'''\
        #!/bin/sh
        # STAND-IN nvcc (mlafleet lab): reports CUDA {release}; compiles nothing.
        case "${{1:-}}" in
            --version|-V)
                printf 'nvcc: NVIDIA (R) Cuda compiler driver (STAND-IN, mlafleet lab)\\n'
                printf 'Cuda compilation tools, release {release}, {build}\\n' ;;
            --list-gpu-code) printf '{codes}\\n' ;;
            --list-gpu-arch) printf '{archs}\\n' ;;
            *) echo "STAND-IN nvcc: compiles nothing" >&2; exit 1 ;;
        esac
        ''')


# ---------------------------------------------------------------- the package set

def driver_packages(version: str, gpus: list[Gpu]) -> list[Package]:
    """The Debian-12 driver packages of NVIDIA's repository, for one driver version (stand-ins)."""
    full = f"{version}-{DEBIAN_REVISION}"
    unit = "mlafleet-standin-nvidia-load.service"
    loader = _script(f'''\
        [Unit]
        Description=STAND-IN kernel: load the stand-in nvidia module at boot (mlafleet lab)
        [Service]
        Type=oneshot
        ExecStart=/usr/lib/mlafleet-standin/nvidia-load
        RemainAfterExit=yes
        [Install]
        WantedBy=multi-user.target
        ''')

    def kernel_module(name: str, license_: str, other: str, flavour: str) -> Package:
        return Package(
            name=name, version=full, depends=["dkms"], conflicts=[other],
            provides=["nvidia-kernel-dkms-any"],
            summary=f"NVIDIA {flavour} kernel module source for DKMS, {version}",
            files={
                f"/usr/src/nvidia-{version}/dkms-standin.modinfo": (
                    f"STAND-IN kernel module (mlafleet lab)\nversion={version}\nlicense={license_}\n"
                    f"description=NVIDIA {flavour} kernel module (STAND-IN)\n", 0o644),
                "/usr/lib/mlafleet-standin/nvidia-load": (_module_load(), 0o755),
                f"/lib/systemd/system/{unit}": (loader, 0o644),
            },
            scripts={
                "postinst": _script(f'''\
                    #!/bin/sh
                    set -e
                    if [ "$1" = configure ]; then
                        dkms install -m nvidia -v {version} -k "$(uname -r)"
                        systemctl enable {unit} >/dev/null 2>&1 || true
                    fi
                    '''),
                "prerm": _script(f'''\
                    #!/bin/sh
                    set -e
                    dkms remove -m nvidia -v {version} -k "$(uname -r)" || true
                    '''),
            })

    return [
        Package(name="nvidia-open", version=full, architecture="all",
                depends=[f"nvidia-kernel-open-dkms (= {full})", f"nvidia-driver-cuda (= {full})"],
                summary=f"NVIDIA driver {version} with the open GPU kernel modules (metapackage)"),
        Package(name="cuda-drivers", version=full, architecture="all",
                depends=[f"nvidia-kernel-dkms (= {full})", f"nvidia-driver-cuda (= {full})"],
                summary=f"NVIDIA driver {version} with the proprietary kernel modules (metapackage)"),
        kernel_module("nvidia-kernel-open-dkms", "Dual MIT/GPL", "nvidia-kernel-dkms", "open"),
        kernel_module("nvidia-kernel-dkms", "NVIDIA", "nvidia-kernel-open-dkms", "proprietary"),
        Package(name="nvidia-driver-cuda", version=full,
                depends=[f"nvidia-kernel-open-dkms (= {full}) | nvidia-kernel-dkms (= {full})"],
                summary=f"NVIDIA driver {version} CUDA components: nvidia-smi",
                files={"/usr/bin/nvidia-smi": (_nvidia_smi(version, gpus), 0o755)}),
        Package(name="nvidia-persistenced", version=full,
                summary=f"NVIDIA persistence daemon {version}",
                files={
                    "/usr/bin/nvidia-persistenced": (_persistenced(), 0o755),
                    "/lib/systemd/system/nvidia-persistenced.service": (_script('''\
                        [Unit]
                        Description=NVIDIA Persistence Daemon (STAND-IN, mlafleet lab)
                        After=mlafleet-standin-nvidia-load.service
                        [Service]
                        ExecStart=/usr/bin/nvidia-persistenced
                        [Install]
                        WantedBy=multi-user.target
                        '''), 0o644),
                }),
    ]


def cuda_packages() -> list[Package]:
    """cuda-toolkit-13-0 and its nvcc (stand-ins), one pair per CUDA 13.0 update."""
    packages: list[Package] = []
    for meta_version, nvcc_version, build in CUDA_RELEASES:
        packages.append(Package(
            name="cuda-toolkit-13-0", version=meta_version, architecture="all",
            depends=[f"cuda-nvcc-13-0 (= {nvcc_version})"],
            summary=f"CUDA Toolkit 13.0 ({meta_version}) metapackage"))
        packages.append(Package(
            name="cuda-nvcc-13-0", version=nvcc_version,
            summary=f"CUDA nvcc 13.0 ({build})",
            files={"/usr/local/cuda-13.0/bin/nvcc": (_nvcc("13.0", build), 0o755)}))
    return packages


def host_packages(kernel_release: str) -> list[Package]:
    """Stand-ins for what a real host gets from its distribution (dkms, headers) or already has."""
    return [
        Package(name="dkms", version="3.0.10-8+standin1", architecture="all",
                summary="Dynamic Kernel Module System",
                files={"/usr/sbin/dkms": (_dkms(), 0o755)}),
        Package(name=f"linux-headers-{kernel_release}", version="1+standin1",
                summary=f"Header files for Linux {kernel_release}",
                files={f"/usr/src/linux-headers-{kernel_release}/STANDIN": (
                    f"STAND-IN kernel headers for {kernel_release} (mlafleet lab)\n", 0o644)},
                scripts={"postinst": _script(f'''\
                    #!/bin/sh
                    set -e
                    mkdir -p /lib/modules/{kernel_release}
                    ln -sfn /usr/src/linux-headers-{kernel_release} /lib/modules/{kernel_release}/build
                    '''),
                    "postrm": _script(f'''\
                    #!/bin/sh
                    set -e
                    rm -f /lib/modules/{kernel_release}/build
                    ''')}),
        Package(name="mlafleet-standin-modinfo", version="1",
                summary="modinfo that reads stand-in module files",
                files={"/usr/local/sbin/modinfo": (_modinfo(), 0o755)}),
        Package(name="mlafleet-standin-mokutil", version="1",
                summary="mokutil that reports a simulated Secure Boot state",
                files={"/usr/local/sbin/mokutil": (_mokutil(), 0o755)}),
    ]


# ---------------------------------------------------------------- building and signing

def build_deb(package: Package, out_dir: Path) -> Path:
    """Build one .deb with dpkg-deb; returns its path."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "DEBIAN").mkdir()
        (root / "DEBIAN" / "control").write_text(package.control())
        for script, body in package.scripts.items():
            path = root / "DEBIAN" / script
            path.write_text(body)
            path.chmod(0o755)
        for dest, (content, mode) in package.files.items():
            path = root / dest.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            path.chmod(mode)
        for directory in [root, *root.rglob("*")]:
            if directory.is_dir():
                directory.chmod(0o755)
        deb = out_dir / f"{package.name}_{package.version}_{package.architecture}.deb"
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
                       check=True, capture_output=True, text=True)
    return deb


def packages_index(debs: list[Path], repo_dir: Path, controls: dict[Path, str]) -> str:
    """The flat repository's Packages file: each control paragraph plus Filename, Size, SHA256."""
    paragraphs = []
    for deb in sorted(debs):
        data = deb.read_bytes()
        paragraphs.append(controls[deb].rstrip("\n") + "\n"
                          f"Filename: ./{deb.relative_to(repo_dir)}\n"
                          f"Size: {len(data)}\n"
                          f"SHA256: {sha256_bytes(data)}\n")
    return "\n".join(paragraphs)


def release_file(repo_dir: Path, index_names: list[str]) -> str:
    lines = ["Origin: mlafleet-standin", "Label: STAND-IN of NVIDIA CUDA repository (mlafleet lab)",
             "Architectures: amd64 all", f"Date: {formatdate(usegmt=True)}", "SHA256:"]
    for name in index_names:
        data = (repo_dir / name).read_bytes()
        lines.append(f" {sha256_bytes(data)} {len(data):>16} {name}")
    return "\n".join(lines) + "\n"


def sign_repository(repo_dir: Path) -> str:
    """Make a throw-away signing key, write InRelease and Release.gpg, export the key; returns its fingerprint."""
    with tempfile.TemporaryDirectory() as home:
        gpg = ["gpg", "--homedir", home, "--batch", "--quiet", "--pinentry-mode", "loopback",
               "--passphrase", ""]
        subprocess.run(gpg + ["--quick-gen-key",
                              "mlafleet STAND-IN CUDA repository key (not NVIDIA) <standin@mlafleet.invalid>",
                              "ed25519", "sign", "never"], check=True, capture_output=True)
        listing = subprocess.run(gpg + ["--with-colons", "--list-keys"], check=True,
                                 capture_output=True, text=True).stdout
        fingerprint = next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:"))
        release = repo_dir / "Release"
        subprocess.run(gpg + ["--clearsign", "-o", str(repo_dir / "InRelease"), str(release)],
                       check=True, capture_output=True)
        subprocess.run(gpg + ["--armor", "--detach-sign", "-o", str(repo_dir / "Release.gpg"), str(release)],
                       check=True, capture_output=True)
        key = subprocess.run(gpg + ["--armor", "--export", fingerprint], check=True,
                             capture_output=True, text=True).stdout
        (repo_dir / KEY_NAME).write_text(key)
    return fingerprint


def build_repository(out: Path, kernel_release: str, distro: str = "debian12",
                     gpus: list[Gpu] | None = None) -> Path:
    """Build the stand-in repository under ``out/<distro>/x86_64``; returns that directory.

    Refuses a non-empty ``out`` so that nothing stale is ever served.
    """
    if distro != "debian12":
        raise ValueError(f"stand-in packages exist for debian12 (the lab's OS) only, not {distro!r}")
    if not kernel_release or "/" in kernel_release or " " in kernel_release:
        raise ValueError(f"kernel release {kernel_release!r} is not a kernel release like 6.1.0-18-amd64")
    for tool in ("dpkg-deb", "gpg"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is missing: install the Debian packages dpkg and gnupg")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: give a new directory for the stand-in repository")
    gpus = gpus if gpus is not None else [Gpu()] * 8
    repo_dir = out / distro / "x86_64"
    repo_dir.mkdir(parents=True)
    packages = [p for v in DRIVER_VERSIONS for p in driver_packages(v, gpus)]
    packages += cuda_packages() + host_packages(kernel_release)
    controls: dict[Path, str] = {}
    for package in packages:
        controls[build_deb(package, repo_dir)] = package.control()
    index = packages_index(list(controls), repo_dir, controls)
    (repo_dir / "Packages").write_text(index)
    with gzip.open(repo_dir / "Packages.gz", "wt") as handle:
        handle.write(index)
    (repo_dir / "Release").write_text(release_file(repo_dir, ["Packages", "Packages.gz"]))
    fingerprint = sign_repository(repo_dir)
    (repo_dir / "STANDIN-README.txt").write_text(
        f"{STANDIN}.\nA local stand-in of NVIDIA's CUDA apt repository for the mlafleet lab, "
        f"signed by the throw-away key {fingerprint} ({KEY_NAME}).\n")
    return repo_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="new or empty directory")
    parser.add_argument("--kernel-release", required=True, help="the lab hosts' `uname -r`")
    parser.add_argument("--gpu-count", type=int, default=8)
    args = parser.parse_args(argv)
    if args.gpu_count < 1:
        parser.error("--gpu-count must be at least 1")
    try:
        repo_dir = build_repository(args.out, args.kernel_release, gpus=[Gpu()] * args.gpu_count)
    except (ValueError, RuntimeError, FileExistsError) as error:
        print(f"standin_repo: {error}", file=sys.stderr)
        return 2
    print(repo_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
