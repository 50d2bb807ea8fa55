"""Staging benchmark (not a test): sha256 throughput against sha256sum, re-run cost with stamps.

    python bench/weights.py --dir /tmp/mlafleet-bench --size-mb 2048 --shards 4 --jobs 1,2,4

Writes `--shards` random files of `--size-mb / --shards` MiB each as <model>-0000K-of-0000N.gguf
(the hashing and staging paths do not parse GGUF), then measures, with the page cache warm:
  1. sha256 of one shard: mlafleet (hashlib, 8 MiB reads) against coreutils `sha256sum`;
  2. sha256 of all shards: mlafleet's parallel hashing with each `--jobs` against
     `sha256sum` on all files (one process) and `xargs -P <jobs> sha256sum`;
  3. staging from a local path (copy, verify, rename, stamp), then the re-run with stamps (a stat
     per shard), the re-run with stamps and the spot check (the role's default: 2 random chunks
     of 64 MiB a shard re-hashed) and the re-run with verify=full (a re-hash of every shard).
Prints one JSON object; docs/perf-weights.md records the results with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ansible_collections.mlafleet.fleet.plugins.module_utils import weights_stage as stager  # noqa: E402
from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import hash_file  # noqa: E402
from mlafleet.weights import shards as weights  # noqa: E402


def timed(func, repeat: int = 3) -> float:  # noqa: ANN001
    """Best of `repeat` wall-clock seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        best = min(best, time.perf_counter() - start)
    return best


def write_shards(directory: Path, count: int, size: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    block = os.urandom(8 << 20)
    for index in range(1, count + 1):
        path = directory / f"bench-{index:05d}-of-{count:05d}.gguf"
        if not path.exists() or path.stat().st_size != size:
            with open(path, "wb") as handle:
                written = 0
                while written < size:
                    chunk = block[: min(len(block), size - written)]
                    handle.write(chunk)
                    written += len(chunk)
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mlafleet-bench-weights")
    parser.add_argument("--size-mb", type=int, default=2048, help="total size of the shards")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--jobs", default="1,2,4")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()

    root = Path(args.dir)
    size = (args.size_mb << 20) // args.shards
    origin = write_shards(root / "origin", args.shards, size)
    total = size * args.shards
    for path in origin:  # warm the page cache: measure hashing, not the disk
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    results: dict = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
                     "python": platform.python_version(), "shard_bytes": size, "shards": args.shards}

    one = origin[0]
    t_py = timed(lambda: hash_file(str(one)))
    t_sum = timed(lambda: subprocess.run(["sha256sum", str(one)], stdout=subprocess.DEVNULL, check=True))
    results["one_file_MiBps"] = {"mlafleet": round(size / t_py / 2**20), "sha256sum": round(size / t_sum / 2**20)}

    names = [str(p) for p in origin]
    all_files: dict = {}
    t_sum_all = timed(lambda: subprocess.run(["sha256sum", *names], stdout=subprocess.DEVNULL, check=True), 2)
    all_files["sha256sum"] = round(total / t_sum_all / 2**20)
    for jobs in [int(j) for j in args.jobs.split(",")]:
        t = timed(lambda: weights.hash_files(origin, jobs), 2)
        all_files[f"mlafleet_jobs{jobs}"] = round(total / t / 2**20)
        t = timed(lambda: subprocess.run(f"printf '%s\\n' {' '.join(names)} | xargs -P {jobs} -n 1 sha256sum",
                                         shell=True, stdout=subprocess.DEVNULL, check=True), 2)
        all_files[f"sha256sum_xargs_P{jobs}"] = round(total / t / 2**20)
    results["all_files_MiBps"] = all_files

    chunk = stager.MANIFEST_CHUNK
    digests = weights.hash_files(origin, max(int(j) for j in args.jobs.split(",")), chunk_size=chunk)
    shards = stager.parse_shards([{"name": p.name, "size": size, "sha256": digests[p][0], "chunk_size": chunk,
                                   "chunks": digests[p][1]} for p in origin])
    dest = root / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    start = time.perf_counter()
    stager.stage(str(dest), shards, [stager.PathSource(str(root / "origin"))])
    results["stage_from_path_s"] = round(time.perf_counter() - start, 3)
    results["rerun_with_stamps_s"] = round(timed(lambda: stager.stage(str(dest), shards, []), 5), 5)
    spot: dict = {}
    results["rerun_with_spot_check_s"] = round(timed(lambda: spot.update(
        stager.stage(str(dest), shards, [], spot_chunks=2)["spot_check"]), 5), 4)
    results["spot_check_bytes"] = spot["bytes"]
    results["rerun_full_verify_s"] = round(timed(lambda: stager.stage(str(dest), shards, [], verify="full"), 2), 3)
    print(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
