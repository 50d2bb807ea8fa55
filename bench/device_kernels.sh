#!/usr/bin/env bash
# Stage what the H200 run of bench/sparse_mla.py needs into <checkout>/.dev/<folder> (git-ignored),
# for the device tool, which sends the lead's checkout and the paths named in `carry`:
#   our kernel modules, the benchmark, and FlashMLA from the vllm==0.20.2 wheel
#   (vllm/_flashmla_C.abi3.so + vllm/third_party/flashmla/flash_mla_interface.py, never committed).
# Usage: bench/device_kernels.sh [checkout] [wheel] [folder under .dev, default kernels]
# Then:  run(carry=[".dev/<folder>"], command="cd .dev/<folder> && PYTHONPATH=. python3 bench_sparse_mla.py --flashmla . --out $OUT")
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
checkout="${1:-/work/main}"
wheel="${2:-$(ls /root/.cache/mlafleet/dl/vllm-0.20.2-*.whl | head -1)}"
folder="${3:-kernels}"
dest="$checkout/.dev/$folder"
git -C "$checkout" check-ignore -q ".dev/$folder" || { echo "$checkout/.dev is not git-ignored" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/mlafleet/kernels" "$dest/vllm/third_party/flashmla"
cp "$here/mlafleet/__init__.py" "$dest/mlafleet/"
cp "$here/mlafleet/kernels/__init__.py" "$here/mlafleet/kernels/sparse_mla.py" "$here/mlafleet/kernels/sm120.py" \
   "$dest/mlafleet/kernels/"
cp "$here/bench/sparse_mla.py" "$dest/bench_sparse_mla.py"
unzip -q -o -j "$wheel" vllm/_flashmla_C.abi3.so -d "$dest/vllm"
unzip -q -o -j "$wheel" vllm/third_party/flashmla/flash_mla_interface.py -d "$dest/vllm/third_party/flashmla"
touch "$dest/vllm/__init__.py" "$dest/vllm/third_party/__init__.py" "$dest/vllm/third_party/flashmla/__init__.py"
du -sh "$dest"
