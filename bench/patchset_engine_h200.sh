#!/bin/bash
# On the H200 test machine: the patched vLLM 0.20.2 engine with TRITON_MLA_SPARSE against
# vLLM's own FLASHMLA_SPARSE, bf16 and fp8_ds_mla KV caches, same dummy-weight tiny GLM-5.
#   bench/patchset_engine_h200.sh BUNDLE_DIR MODEL_DIR OUT_DIR
# BUNDLE_DIR: vllm-site.tar.xz (the vllm==0.20.2 wheel unpacked, fa2 binary left out,
# with build/patchset/0.20.2/files copied over it) and wheels/ (vLLM requirements the
# machine's image lacks). Results: OUT_DIR/<backend>-<kv>.json, OUT_DIR/compare.jsonl.
set -euo pipefail
bundle=$1 model=$2 out=$3
work=/tmp/mlafleet-engine
mkdir -p "$work/site" "$work/deps" "$out"
if [ ! -f "$work/site/vllm/__init__.py" ]; then
  cat "$bundle"/vllm-site.tar.xz* | xz -d -T8 | tar -C "$work/site" -xf -
  python3 -m pip install -q --no-index --no-deps --target "$work/deps" "$bundle"/wheels/*.whl
fi
export PYTHONPATH="$work/site:$work/deps" CUDA_HOME=/usr/local/cuda VLLM_CACHE_ROOT="$work/cache"
python3 -c "import vllm.v1.attention.backends.registry as r; print(r.AttentionBackendEnum.TRITON_MLA_SPARSE.value)"
runs=()
for kv in auto fp8_ds_mla; do
  for backend in FLASHMLA_SPARSE TRITON_MLA_SPARSE; do
    log="$work/$backend-$kv.log"
    if python3 "$(dirname "$0")/patchset_engine.py" "$model" "$backend" "$kv" "$out/$backend-$kv.json" >"$log" 2>&1; then
      tail -1 "$log"; runs+=("$out/$backend-$kv.json")
    else
      echo "== $backend $kv failed:"; grep -E "Error|error|Traceback" "$log" | tail -8; tail -5 "$log"
    fi
    grep -E "Using .* attention backend|DSA indexer|TRITON_MLA_SPARSE" "$log" | head -3 || true
  done
done
python3 "$(dirname "$0")/patchset_engine.py" compare "${runs[@]}" | tee "$out/compare.jsonl"
