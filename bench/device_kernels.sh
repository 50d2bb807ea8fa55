#!/usr/bin/env bash
# The kernel benchmarks on the H200 test machine, in two steps.
#
# stage (here): copy into <checkout>/.dev/<folder> (git-ignored), for the device tool, which sends
#   the lead's checkout and the paths named in `carry`: our kernel modules, the tests' oracles
#   (tests/kernels/oracles.py: the references and cache writers) and sm_120 compile check
#   (tests/kernels/sm120.py), the benchmarks (sparse MLA,
#   its trimmed-loop, host-time, decode and prefill-workspace tables sparse_mla_tail.py,
#   sparse_mla_host.py, sparse_mla_prefill.py and
#   sparse_mla_decode.py, the Gluon probe
#   gluon_fp8_probe.py, the indexer), this
#   script, optionally the sparse-MLA kernels of an earlier git revision (as
#   mlafleet.kernels.sparse_mla_before, timed in the same run), and from the vllm==0.20.2 wheel
#   FlashMLA (vllm/_flashmla_C.abi3.so + its interface) and DeepGEMM (vllm/third_party/deep_gemm,
#   importable as deep_gemm). Nothing from the wheel is ever committed.
#     bench/device_kernels.sh stage [checkout=/work/main] [folder=kernels] [before-rev]
# run (there): compile every launch in parallel processes first (Triton's and DeepGEMM's JIT
#   caches), then time sparse MLA (bench/sparse_mla.py --sweep) and the indexer
#   (bench/indexer.py --sweep) one after the other, results and one log under $OUT.
#     run(carry=[".dev/<folder>"], command="bash .dev/<folder>/device_kernels.sh run")
set -euo pipefail
mode="${1:-stage}"
if [[ "$mode" == stage ]]; then
    here="$(cd "$(dirname "$0")/.." && pwd)"
    checkout="${2:-/work/main}"
    folder="${3:-kernels}"
    before="${4:-}"
    wheel="$(ls "$HOME"/.cache/mlafleet/dl/vllm-0.20.2-*.whl | head -1)"
    dest="$checkout/.dev/$folder"
    git -C "$checkout" check-ignore -q ".dev/$folder" || { echo "$checkout/.dev is not git-ignored" >&2; exit 1; }
    rm -rf "$dest"
    mkdir -p "$dest/mlafleet/kernels" "$dest/tests/kernels" "$dest/vllm/third_party/flashmla"
    cp "$here/mlafleet/__init__.py" "$dest/mlafleet/"
    cp "$here"/mlafleet/kernels/{__init__,sparse_mla,sparse_mla_gluon,indexer}.py "$dest/mlafleet/kernels/"
    # the references the benchmarks check against, and the sm_120 compile check (the Gluon probe's)
    cp "$here/tests/kernels/oracles.py" "$here/tests/kernels/sm120.py" "$dest/tests/kernels/"
    if [[ -n "$before" ]]; then
        git -C "$here" show "$before:mlafleet/kernels/sparse_mla.py" > "$dest/mlafleet/kernels/sparse_mla_before.py"
    fi
    cp "$here/bench/sparse_mla.py" "$dest/bench_sparse_mla.py"
    cp "$here/bench/indexer.py" "$dest/bench_indexer.py"
    cp "$here/bench/sparse_mla_tail.py" "$here/bench/sparse_mla_host.py" "$here/bench/sparse_mla_decode.py" \
        "$here/bench/sparse_mla_prefill.py" "$here/bench/gluon_fp8_probe.py" "$dest/"
    cp "$here/bench/cuda_timing.py" "$dest/"
    cp "$here/bench/device_kernels.sh" "$dest/"
    unzip -q -o -j "$wheel" vllm/_flashmla_C.abi3.so -d "$dest/vllm"
    unzip -q -o -j "$wheel" vllm/third_party/flashmla/flash_mla_interface.py -d "$dest/vllm/third_party/flashmla"
    touch "$dest/vllm/__init__.py" "$dest/vllm/third_party/__init__.py" "$dest/vllm/third_party/flashmla/__init__.py"
    tmp="$(mktemp -d)"
    unzip -q "$wheel" 'vllm/third_party/deep_gemm/*' -d "$tmp"
    mv "$tmp/vllm/third_party/deep_gemm" "$dest/deep_gemm"
    rm -rf "$tmp"
    du -sh "$dest"
    exit 0
fi
[[ "$mode" == run ]] || { echo "usage: $0 stage|run ..." >&2; exit 2; }
cd "$(dirname "$0")"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
out="${OUT:?OUT must name the folder for the results}"
log="$out/log.txt"
before_arg=()
[[ -f mlafleet/kernels/sparse_mla_before.py ]] && before_arg=(--before mlafleet.kernels.sparse_mla_before)
warm_procs="${WARM_PROCS:-12}"
{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    start=$(date +%s)
    # DeepGEMM's JIT (nvcc) takes longest: it runs on while sparse MLA is timed (a few launches)
    python3 bench_indexer.py --warm --sweep --out /tmp/indexer-warm.json > /tmp/warm_indexer.log 2>&1 &
    indexer_warm=$!
    pids=()
    for i in $(seq 0 $((warm_procs - 1))); do
        python3 bench_sparse_mla.py "${before_arg[@]}" --warm "$i/$warm_procs" > "/tmp/warm_$i.log" 2>&1 &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    tail -q -n 2 /tmp/warm_[0-9]*.log
    echo "sparse MLA compile phase: $(( $(date +%s) - start )) s, status $status"
    timeout "${MLA_TIMEOUT:-330}" python3 bench_sparse_mla.py --flashmla . "${before_arg[@]}" ${MLA_SWEEP---sweep} --out "$out" \
        || echo "sparse MLA benchmark: exit $?"
    echo "after sparse MLA: $(( $(date +%s) - start )) s"
    wait "$indexer_warm" || echo "indexer warm-up: exit $?"
    tail -n 3 /tmp/warm_indexer.log
    echo "indexer compile phase done: $(( $(date +%s) - start )) s"
    timeout "${INDEXER_TIMEOUT:-200}" python3 bench_indexer.py --sweep --out "$out/indexer.json" \
        || echo "indexer benchmark: exit $?"
    echo "total: $(( $(date +%s) - start )) s"
} 2>&1 | tee "$log"
