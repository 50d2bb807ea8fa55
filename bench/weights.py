"""Staging benchmark (not a test): sha256 throughput against sha256sum, staging against rsync,
re-run cost with stamps.

    python bench/weights.py --dir /tmp/mlafleet-bench --size-mb 2048 --shards 4 --jobs 1,2,4
    python bench/weights.py --format safetensors --size-mb 2048 --shards 4

Writes `--shards` random files of `--size-mb / --shards` MiB each: as <model>-0000K-of-0000N.gguf
(the hashing and staging paths do not parse GGUF), or with --format safetensors a real snapshot
(model-0000K-of-0000N.safetensors written by the safetensors package, one uint8 tensor a file,
model.safetensors.index.json, config.json; its manifest built and checked as `mlafleet weights
manifest DIR` does), then measures, with the page cache warm:
  1. sha256 of one shard: mlafleet (hashlib, 8 MiB reads) against coreutils `sha256sum`;
  2. sha256 of all shards: mlafleet's parallel hashing with each `--jobs` against
     `sha256sum` on all files (one process) and `xargs -P <jobs> sha256sum`;
  3. staging from a local path (copy, verify, rename, stamp), then the re-run with stamps (a stat
     per shard), the re-run with stamps and the spot check (the role's default: 2 random chunks
     of 64 MiB a shard re-hashed) and the re-run with verify=full (a re-hash of every shard);
  4. the same files by hand: `rsync -a` to a new directory, then `sha256sum` of the copies (what
     the first stage does), and the re-runs `rsync -a` (size and time only) and `rsync -a -c`
     (a checksum of every file on both sides).
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


def write_snapshot(directory: Path, count: int, size: int) -> list[Path]:
    """A safetensors snapshot: `count` files of one uint8 tensor each (about `size` bytes), its index
    and config (the files a manifest lists, sorted by name as the manifest lists them)."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for index in range(1, count + 1):
        name = f"model-{index:05d}-of-{count:05d}.safetensors"
        tensor = f"model.layers.{index - 1}.weight"
        weight_map[tensor] = name
        path = directory / name
        if not path.exists() or abs(path.stat().st_size - size) > 4096:
            save_file({tensor: rng.integers(0, 256, size=size, dtype=np.uint8)}, str(path))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"architectures": ["BenchForCausalLM"], "model_type": "bench"}))
    return sorted(p for p in directory.iterdir() if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mlafleet-bench-weights")
    parser.add_argument("--size-mb", type=int, default=2048, help="total size of the shards")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--jobs", default="1,2,4")
    parser.add_argument("--format", choices=["gguf", "safetensors"], default="gguf")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()

    root = Path(args.dir)
    size = (args.size_mb << 20) // args.shards
    if args.format == "safetensors":
        origin = write_snapshot(root / "origin", args.shards, size)
    else:
        origin = write_shards(root / "origin", args.shards, size)
    total = sum(p.stat().st_size for p in origin)
    for path in origin:  # warm the page cache: measure hashing, not the disk
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    results: dict = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
                     "python": platform.python_version(), "format": args.format, "shard_bytes": size,
                     "shards": args.shards, "files": len(origin), "total_bytes": total}

    one = max(origin, key=lambda p: p.stat().st_size)
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
    jobs_max = max(int(j) for j in args.jobs.split(","))
    if args.format == "safetensors":
        from mlafleet.weights import snapshot

        start = time.perf_counter()
        entries = snapshot.build_from_directory(root / "origin", jobs=jobs_max)["files"]
        results["manifest_s"] = round(time.perf_counter() - start, 3)
    else:
        digests = weights.hash_files(origin, jobs_max, chunk_size=chunk)
        entries = [{"name": p.name, "size": p.stat().st_size, "sha256": digests[p][0], "chunk_size": chunk,
                    "chunks": digests[p][1]} for p in origin]
    shards = stager.parse_files(entries) if args.format == "safetensors" else stager.parse_shards(entries)
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

    by_hand = root / "rsync"
    shutil.rmtree(by_hand, ignore_errors=True)
    copies = [str(by_hand / p.name) for p in origin]
    start = time.perf_counter()
    subprocess.run(["rsync", "-a", f"{root / 'origin'}/", f"{by_hand}/"], check=True)
    results["rsync_copy_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    subprocess.run(["sha256sum", *copies], stdout=subprocess.DEVNULL, check=True)
    results["rsync_copy_then_sha256sum_s"] = round(results["rsync_copy_s"] + time.perf_counter() - start, 3)
    rsync_again = ["rsync", "-a", f"{root / 'origin'}/", f"{by_hand}/"]
    results["rsync_rerun_s"] = round(timed(lambda: subprocess.run(rsync_again, check=True), 5), 4)
    results["rsync_rerun_checksum_s"] = round(timed(lambda: subprocess.run(
        [*rsync_again[:2], "-c", *rsync_again[2:]], check=True), 2), 3)
    print(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
