#!/bin/bash
# On the GPU machine (H200 image, from the repository root): the patched vLLM engine end to end,
# the line bench/engine_bundle.sh packed (0.20.2 on the image's torch; 0.32.0 on torch 2.13.0).
#
#   bench/engine_gpu.sh setup PARTS_DIR    unpack bench/engine_bundle.sh's parts into a venv (the
#                                          image's torch behind it), patch that venv with the
#                                          vllm_patch role (bench/engine_patch.yml), write the tiny
#                                          GLM-5 (safetensors + 3 GGUF shards; an 8-head variant)
#   bench/engine_gpu.sh single OUT_DIR     1 GPU per run, two runs at a time on GPUs 0 and 1:
#                                          FLASHMLA_SPARSE + DeepGEMM (vLLM's own, reference) and
#                                          TRITON_MLA_SPARSE + the DeepGEMM-free indexer, bf16 and
#                                          fp8_ds_mla KV, safetensors and GGUF, and the
#                                          two mixed pairs (attention of one, indexer of the other)
#   bench/engine_gpu.sh heads8 OUT_DIR     the same pair with 8 heads (one rank of GLM-5 at TP8)
#   bench/engine_gpu.sh heads8-profile OUT_DIR   8 heads, compiled + CUDA graphs, fp8_ds_mla then bf16,
#                                          ours and FLASHMLA_SPARSE + DeepGEMM, each with a profile of
#                                          its decode steps at batch 32 (engine_e2e.py --profile); resumable
#   bench/engine_gpu.sh heads8-round OUT_DIR   heads8-profile's runs (bf16 first), ours with vLLM's own
#                                          top-k (SM120's choice on 0.32.0), then the prefill steps of
#                                          the batch profiled (--profile-phase prefill); resumable
#   bench/engine_gpu.sh heads8-prefill OUT_DIR   only heads8-round's prefill profiles (bf16, then fp8_ds_mla)
#   bench/engine_gpu.sh heads8-deep OUT_DIR   8 heads, compiled + CUDA graphs, ours (vLLM's own top-k, SM120's
#                                          default on 0.32.0) and the reference, bf16 and fp8_ds_mla, on a
#                                          16-layer variant and on the 2-layer model, 3 timed runs each; resumable
#   bench/engine_gpu.sh heads8-host OUT_DIR   the 2-layer model, ours and the reference, bf16 then fp8_ds_mla,
#                                          each with a profile of decode steps at batch 1 and their host
#                                          side (step interval, annotated host scopes, CUDA API calls); resumable
#   bench/engine_gpu.sh heads8-graphs-fp8|heads8-graphs-bf16 OUT_DIR   8 heads, compiled + CUDA
#                                          graphs, one GPU (the issue-16 regime); -fp8-mixed after
#                                          -fp8: the two mixed pairs in that regime
#   bench/engine_gpu.sh heads8-gluon-fp8 OUT_DIR   8 heads, fp8_ds_mla, compiled + CUDA graphs, ours with the
#                                          Triton fp8 kernel and with the Gluon one forced; resumable
#   bench/engine_gpu.sh prefill-ws OUT_DIR ours, fp8_ds_mla, compiled + CUDA graphs, 8 and 64 heads, the
#                                          prefill workspace on (the rule) and off; resumable (0.20.2: with
#                                          VLLM_USE_FLASHINFER_MOE_FP16=0, else FlashInfer's CUTLASS MoE JIT
#                                          build takes over 6 minutes on a fresh machine)
#   bench/engine_gpu.sh control OUT_DIR    vLLM's own path with prefill chunks of 2048 tokens (compare
#                                          with the single/heads8 references: vLLM's self-difference)
#   bench/engine_gpu.sh tp2 OUT_DIR        tensor parallel 2 over GPUs 0,1 (32 heads per rank)
#   bench/engine_gpu.sh line OUT_DIR       ONE GPU, the issue-20 set for the bundled line, resumable (a
#                                          step with a result is skipped, a step starts only in the call's
#                                          first 300 s: call it again for the rest):
#                                          compiled + CUDA graphs, vLLM's own choice + DeepGEMM against ours,
#                                          bf16 and fp8_ds_mla; GGUF (eager) both; then `serve`
#   bench/engine_gpu.sh serve OUT_DIR      the OpenAI-compatible server on the tiny GLM-5 with ours
#                                          (fp8_ds_mla, DeepGEMM-free indexer, CUDA graphs), answered by the
#                                          OpenAI client (bench/serve_openai.py) and the perf gate's client
#   bench/engine_gpu.sh vllm-tests OUT_DIR [FIRST] [SHARDS]  vLLM's own tests/v1/attention/test_sparse_mla_backends.py
#                                          (the line's sdist) with TRITON_MLA_SPARSE added to its backends
#                                          (bench/vllm_sparse_mla_plugin.py), on the patched install,
#                                          from its FIRST-th item on (default 1; a FIRST that is not a
#                                          number picks the items whose id contains it), in SHARDS pytest
#                                          processes side by side on the GPU (default 1; items dealt round robin)
#   bench/engine_gpu.sh fp8-block OUT_DIR  ONE GPU, issue 42: the tiny GLM-5 written as a block-FP8
#                                          safetensors snapshot (GLM-5-FP8's layout, write_tiny_glm5_fp8),
#                                          its manifest built (mlafleet weights manifest), staged by the
#                                          weights role into a lab-like layout (bench/engine_weights.yml,
#                                          path source, connection local; if the role cannot run, the
#                                          written directory is served and OUT_DIR/fp8-block-staging.json
#                                          says so), then served eagerly, greedy tokens only, by ours
#                                          (TRITON_MLA_SPARSE + DeepGEMM-free indexer) and vLLM's own
#                                          (FLASHMLA_SPARSE + DeepGEMM), bf16 then fp8_ds_mla KV, and ours
#                                          once more with no DeepGEMM at all (VLLM_USE_DEEP_GEMM=0: the
#                                          block-FP8 GEMMs on another kernel, CUTLASS on SM90); resumable (a
#                                          step starts only in the call's first 300 s; vLLM's DeepGEMM
#                                          warm-up skipped: VLLM_DEEP_GEMM_WARMUP=skip unless set). Writes
#                                          OUT_DIR/fp8-block.md and OUT_DIR/fp8-block-tokens.json (each
#                                          run's tokens beside the reference's, equal counts, first
#                                          divergence). DRY_RUN=1: write and stage, then only print each
#                                          run's plan (engine_e2e.py --dry-run); runs on a CPU machine with
#                                          E2E_WORK, E2E_PYTHON and E2E_ANSIBLE_PLAYBOOK (below)
#   (setup PARTS_DIR --no-models skips the tiny GLM-5, which only the engine phases need)
#
# Every run writes /tmp/e2e/results/<name>.json (bench/engine_e2e.py) and <name>.log; the phase
# ends with OUT_DIR/<phase>.md (the comparison) and OUT_DIR/<phase>-results.tar.gz (all of it).
# Overrides (for fp8-block's DRY_RUN on a CPU machine; the GPU run sets none): E2E_WORK (default
# /tmp/e2e), E2E_PYTHON (the engine's Python, default the setup's venv), E2E_ANSIBLE_PLAYBOOK (an
# ansible-playbook to run, default the bundle's), E2E_FP8_CONFIG (JSON merged into the tiny GLM-5's
# config for the FP8 snapshot: a smaller model for a quick dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
work=${E2E_WORK:-/tmp/e2e}
venv=$work/venv models=$work/models results=$work/results
py=${E2E_PYTHON:-$venv/bin/python}
# NVLink multicast stays off on the shared machines (device notes); vLLM's symmetric-memory
# all-reduce is kept off with it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} VLLM_CACHE_ROOT=$work/cache PYTHONUNBUFFERED=1
# 0.32.0's torch 2.13.0 was built with cuDNN 9.20, the image has 9.19 (same soname): only a cuDNN
# call checks it, and no sparse-MLA path makes one (bench/engine_bundle.sh)
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
# the line the bundle holds (bench/engine_bundle.sh writes it; older bundles are 0.20.2)
line=$(cat "$work/bundle/VERSION" 2>/dev/null || echo 0.20.2)

setup() {
  set -e
  local parts=$1
  rm -rf "$work" && mkdir -p "$work" "$results"
  cat "$parts"/all.tar.part-* | tar -C "$work" -xf -
  python3 -m venv --without-pip "$venv"
  local site image
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  image=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # behind the venv's own packages: the image's (0.20.2: its torch 2.11.0+cu130 and Triton too)
  echo "$image" > "$site/zz-gpu-image-site.pth"
  # 0.32.0: torch 2.13.0, Triton 3.7.1, NCCL 2.29.7, torchvision 0.28.0 in front of the image's
  [ ! -d "$work/bundle/wheels/torch" ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$work"/bundle/wheels/torch/*.whl
  xz -d -T0 < "$work/bundle/vllm-site.tar.xz" | tar -C "$site" -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$work"/bundle/wheels/vllm/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/ansible" "$work"/bundle/wheels/ansible/*.whl
  echo "== vllm_patch role on $venv"
  playbook bench/engine_patch.yml -e engine_venv="$venv" -v | tail -25
  "$venv/bin/python" -c "import vllm, torch, triton; from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), E.TRITON_MLA_SPARSE.get_path())"
  mkdir -p "$work/vllm-tests" && xz -d -T0 < "$work/bundle/vllm-tests.tar.xz" | tar -C "$work/vllm-tests" -xf -
  [ "${2:-}" = --no-models ] && return
  echo "== tiny GLM-5"
  PYTHONPATH=$PWD "$venv/bin/python" - "$models" <<'PY'
import json, sys, time
from mlafleet.lab.tinymodel import load_config, write_tiny_glm5
t = time.time()
paths = write_tiny_glm5(f"{sys.argv[1]}/tiny-glm5", gguf_shards=3, gguf_type="Q8_0", seed=0)
eight = dict(load_config(), num_attention_heads=8, num_key_value_heads=8)
write_tiny_glm5(f"{sys.argv[1]}/tiny-glm5-8heads", gguf_shards=0, seed=0, config=eight)
# the same 8 heads over 16 layers (GLM-5 has 78): a decode step's GPU work then outweighs the host's
deep = dict(eight, num_hidden_layers=16, mlp_layer_types=["dense"] + ["sparse"] * 15,
            indexer_types=["full"] * 16, layer_types=["deepseek_sparse_attention"] * 16)
write_tiny_glm5(f"{sys.argv[1]}/tiny-glm5-8heads-16layers", gguf_shards=0, seed=0, config=deep)
print("written in %.0f s:" % (time.time() - t), [p.name for p in paths["gguf"]], paths["safetensors"].stat().st_size)
PY
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
}

# a playbook of bench/ run on this machine (connection local): the bundle's ansible-core (or
# E2E_ANSIBLE_PLAYBOOK), the repository's roles, modules on the machine's python3, the run report
# (the mlafleet_report callback) under $work/reports
playbook() {
  local cmd=(python3 "$work/ansible/bin/ansible-playbook")
  [ -z "${E2E_ANSIBLE_PLAYBOOK:-}" ] || cmd=("$E2E_ANSIBLE_PLAYBOOK")
  LC_ALL=C.UTF-8 PYTHONPATH="$work/ansible" ANSIBLE_ROLES_PATH="$PWD/roles" ANSIBLE_LOCALHOST_WARNING=False \
    ANSIBLE_NOCOLOR=1 MLAFLEET_REPORT_ROOT="$work/reports" "${cmd[@]}" -i localhost, "$@" \
    -e ansible_python_interpreter="$(command -v python3)"
}

# one run: NAME GPUS ARGS... (GPUS: CUDA_VISIBLE_DEVICES); DRY_RUN=1: the run's plan only
one() {
  local name=$1 gpus=$2; shift 2
  if [ "${DRY_RUN:-}" = 1 ]; then
    echo "== $name (GPU $gpus): dry run"
    CUDA_VISIBLE_DEVICES=$gpus "$py" bench/engine_e2e.py run "$results/$name.json" "$@" --dry-run
    return
  fi
  local t0=$SECONDS log=${LOGS:-$results}/$name.log
  # with LOGS (a phase's OUT_DIR) the log is written there, so a call that is stopped still brings it back
  CUDA_VISIBLE_DEVICES=$gpus timeout "${RUN_TIMEOUT:-420}" "$py" bench/engine_e2e.py run "$results/$name.json" "$@" \
    > "$log" 2>&1
  local rc=$?
  [ "$log" = "$results/$name.log" ] || cp "$log" "$results/"
  echo "== $name (GPU $gpus): rc $rc, $((SECONDS - t0)) s"
  # the block-FP8 GEMMs vLLM picked too (a block-FP8 checkpoint's linear kernel and MoE backend)
  grep -E "Using AttentionBackendEnum|DSA indexer|DeepGEMM E8M0|fp8_ds_mla KV cache format|prefill workspace|for Fp8LinearMethod|Fp8 MoE backend out" \
    "$log" | sort -u | head -7 | cut -c1-220
  if [ $rc -eq 0 ]; then tail -1 "$log" | cut -c1-600; else grep -E "Error|error" "$log" | tail -6 | cut -c1-400; fi
  return $rc
}

# resumable phases (one GPU): NAME ARGS...: one run unless it has a result or too little of the
# call is left (a run starts only within the call's first 300 s)
began=$SECONDS
step() {
  local name=$1; shift
  [ -f "$results/$name.json" ] && { echo "== $name: done before"; return 0; }
  [ $((SECONDS - began)) -le 300 ] || { echo "== $name: not started (call again)"; return 1; }
  one "$name" 0 "$@" && return 0
  # a module the bundle lacks fails every run the same way: stop at the first and name it
  ! grep -q "ModuleNotFoundError" "$results/$name.log" ||
    { echo "== stopped: $(grep -m1 -o "ModuleNotFoundError: .*" "$results/$name.log")"; exit 3; }
  return 1
}

# two lanes of runs side by side: lane A on GPU 0, lane B on GPU 1
lanes() {
  local a=$1 b=$2
  (eval "$a") > "$work/laneA.txt" 2>&1 & local pa=$!
  (eval "$b") > "$work/laneB.txt" 2>&1 & local pb=$!
  wait $pa $pb; cat "$work/laneA.txt" "$work/laneB.txt"
}

finish() {
  local phase=$1 out=$2; shift 2
  local files=()
  for n in "$@"; do [ -f "$results/$n.json" ] && files+=("$results/$n.json"); done
  "$py" bench/engine_e2e.py compare "${files[@]}" | tee "$out/$phase.md"
  tar -C "$results" -czf "$out/$phase-results.tar.gz" .
}

# the 8-head model's prefill profiles (heads8-round, heads8-prefill): ours and the reference, bf16 then fp8_ds_mla
prefill_profiles() {
  for kv in auto fp8_ds_mla; do
    step "ours8pre-$kv" --model "$m8" $ours --graphs --kv $kv --profile "$results/pre-ours8-$kv" --profile-phase prefill
    step "ref8pre-$kv" --model "$m8" $ref --graphs --kv $kv --profile "$results/pre-ref8-$kv" --profile-phase prefill
  done
}

# issue 42's snapshot: write it (once), build its manifest, stage it with the weights role into
# $work/lab/opt/mlafleet/models (the lab hosts' weights_root layout); sets mfp8 to the directory the
# engine loads and writes OUT_DIR/fp8-block-staging.json (how it got there)
fp8_stage() {
  local out=$1 origin=$models/tiny-glm5-fp8 root=$work/lab/opt/mlafleet/models t0=$SECONDS staged_by
  mkdir -p "$models" "$results"
  if [ ! -f "$origin/model.safetensors.index.json" ]; then
    PYTHONPATH=$PWD "$py" - "$origin" "${E2E_FP8_CONFIG:-}" <<'PY' || return 1
import json, sys, time
from mlafleet.lab.tinymodel import load_config, write_tiny_glm5_fp8
t = time.time()
config = dict(load_config(), **json.loads(sys.argv[2] or "{}"))
paths = write_tiny_glm5_fp8(sys.argv[1], shards=4, seed=0, config=config)
print("== block-FP8 snapshot written in %.0f s: %d FP8 weights, %s" % (
    time.time() - t, paths["fp8_weights"], ", ".join(p.name for p in paths["safetensors"])))
PY
  fi
  PYTHONPATH=$PWD/collections:$PWD "$py" -m mlafleet.weights weights manifest "$origin" -q \
    -o "$work/fp8-manifest.json" || return 1
  mfp8=$root/tiny-glm5-fp8 staged_by="the weights role (bench/engine_weights.yml, path source)"
  echo "== weights role: $origin -> $mfp8"
  if ! playbook bench/engine_weights.yml -e engine_manifest="$work/fp8-manifest.json" -e engine_origin="$origin" \
      -e engine_weights_root="$root" -e engine_owner="$(id -un)" -e engine_group="$(id -gn)" \
      > "$out/fp8-block-staging.log" 2>&1; then
    tail -20 "$out/fp8-block-staging.log"
    mfp8=$origin staged_by="none: the weights role failed (fp8-block-staging.log), the written directory is served"
  fi
  grep -E -A2 "all [0-9]+ of [0-9]+ files verified" "$out/fp8-block-staging.log" | sed 's/^ *//' | tr '\n' ' '
  echo; grep -E "ok=[0-9]+" "$out/fp8-block-staging.log"
  "$py" - "$out/fp8-block-staging.json" "$origin" "$mfp8" "$staged_by" "$work/fp8-manifest.json" \
    $((SECONDS - t0)) <<'PY'
import json, sys
out, origin, served, staged_by, manifest, seconds = sys.argv[1:]
m = json.load(open(manifest))
json.dump({"written": origin, "served": served, "staged_by": staged_by, "seconds": int(seconds),
           "manifest": {k: m.get(k) for k in ("model", "revision", "file_count", "safetensors_count", "total_size",
                                              "tensor_count", "fp8_weights", "weight_block_size")}},
          open(out, "w"), indent=1)
print("== serving", served, "(staged by", staged_by + ")")
PY
}

m=$models/tiny-glm5 m8=$models/tiny-glm5-8heads m8deep=$models/tiny-glm5-8heads-16layers
ref="--backend FLASHMLA_SPARSE --indexer deepgemm" ours="--backend TRITON_MLA_SPARSE --indexer fallback"
# a machine that was given back and started afresh has no /tmp/e2e: say so, not a later phase's error
[ "${1:-}" = setup ] || [ -x "$py" ] || [ -z "${1:-}" ] ||
  { echo "no setup on this machine ($py is missing: the machine was started afresh?): carry the parts again and run: $0 setup PARTS_DIR" >&2; exit 3; }
# every phase's run logs go to its OUT_DIR as they are written (a stopped call still brings them back)
[ "${1:-}" != setup ] && [ -d "${2:-}" ] && export LOGS=$2
case ${1:-} in
  setup) setup "$2" "${3:-}" ;;
  vllm-tests)
    # the whole file: vLLM's own backends as they run on this GPU, and ours added; offline (the
    # model config the tests read comes from the bundle's seeded cache). The 0.20.2 file needs
    # about 1000 s in one process, more than one call: `vllm-tests OUT_DIR FIRST` runs its items
    # from the FIRST-th on (1-based, in the file's collection order), so a second call takes the
    # rest; SHARDS processes side by side (the cases are small next to an H200) take it in one.
    first=${3:-1} shards=${4:-1} tag=vllm-tests-$line-from-${3:-1}
    tag=${tag//[^A-Za-z0-9._-]/_}
    (cd "$work/vllm-tests" && export HF_HOME="$work/bundle/hf-home" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       PYTHONPATH="$OLDPWD/bench" && plugin=(-p vllm_sparse_mla_plugin -p no:cacheprovider) &&
     "$venv/bin/python" -m pytest "${plugin[@]}" -q --collect-only tests/v1/attention/test_sparse_mla_backends.py |
       grep '::' | { if [[ $first =~ ^[0-9]+$ ]]; then tail -n +"$first"; else grep -F -- "$first"; fi; } \
       > "$work/vllm-tests-ids.txt"
     [ -s "$work/vllm-tests-ids.txt" ] || { echo "no test items collected for FIRST=$first"; exit 1; }
     echo "items $first.. of the file: $(wc -l < "$work/vllm-tests-ids.txt"), in $shards process(es)"
     pids=()
     for k in $(seq 0 $((shards - 1))); do
       awk -v n="$shards" -v k="$k" '(NR - 1) % n == k' "$work/vllm-tests-ids.txt" > "$work/vllm-tests-ids-$k.txt"
       timeout 540 "$venv/bin/python" - "${plugin[@]}" -q -rfE --tb=line --durations=5 --maxfail=25 \
         > "$2/$tag-shard$k.txt" 2>&1 <<PY &
import sys, pytest
ids = open("$work/vllm-tests-ids-$k.txt").read().splitlines()
sys.exit(pytest.main(sys.argv[1:] + ids))
PY
       pids+=($!)
     done
     rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
     for k in $(seq 0 $((shards - 1))); do echo "-- shard $k: $(grep -E '(passed|failed|error)' "$2/$tag-shard$k.txt" | tail -1)"; done
     exit $rc
    ) > "$2/$tag.txt" 2>&1
    echo "rc $?"; cat "$2/$tag.txt"; grep -hE "^(FAILED|ERROR)" "$2/$tag"-shard*.txt | head -30 ;;
  line)
    # one GPU, resumable
    export RUN_TIMEOUT=400
    step lgraphs-ours-bf16 --model "$m" $ours --graphs
    step lgraphs-ref-bf16 --model "$m" --backend auto --indexer deepgemm --graphs ||
      step lgraphs-flashmla-bf16 --model "$m" $ref --graphs
    step lgraphs-ours-fp8 --model "$m" $ours --graphs --kv fp8_ds_mla
    step lgraphs-ref-fp8 --model "$m" --backend auto --indexer deepgemm --graphs --kv fp8_ds_mla ||
      step lgraphs-flashmla-fp8 --model "$m" $ref --graphs --kv fp8_ds_mla
    step lgguf-ours-bf16 --model "$m" $ours --gguf
    step lgguf-ref-bf16 --model "$m" --backend auto --indexer deepgemm --gguf
    finish line "$2" lgraphs-ref-bf16 lgraphs-flashmla-bf16 lgraphs-ours-bf16 lgraphs-ref-fp8 lgraphs-flashmla-fp8 \
      lgraphs-ours-fp8 lgguf-ref-bf16 lgguf-ours-bf16
    if [ $((SECONDS - began)) -le 330 ]; then "$0" serve "$2"; else echo "== serve: not started (call again)"; fi ;;
  serve)
    # ours behind vLLM's OpenAI-compatible server (what the vllm_server role starts), CUDA graphs on
    [ -f "$results/serve.json" ] && { cat "$results/serve.json"; exit 0; }
    port=8765 t0=$SECONDS
    MLAFLEET_INDEXER_FALLBACK=1 CUDA_VISIBLE_DEVICES=0 "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
      --host 127.0.0.1 --port $port --model "$m" --served-model-name tiny-glm5 --max-model-len 4096 \
      --gpu-memory-utilization 0.45 --kv-cache-dtype fp8_ds_mla --attention-backend TRITON_MLA_SPARSE \
      > "$2/serve-server.log" 2>&1 &
    server=$!
    until "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$port/health" 2>/dev/null; do
      kill -0 $server 2>/dev/null && [ $((SECONDS - t0)) -lt 300 ] || { echo "server not ready:"; tail -20 "$2/serve-server.log"; kill $server; exit 1; }
      sleep 2
    done
    echo "== server ready in $((SECONDS - t0)) s; $(grep -ohE "Using AttentionBackendEnum[^ ]* backend|DSA indexer: [^(]*" "$2/serve-server.log" | sort -u | tr '\n' ';')"
    "$venv/bin/python" bench/serve_openai.py "http://127.0.0.1:$port/v1" tiny-glm5 "$2/serve-openai.json"; rc=$?
    "$venv/bin/python" roles/perf_gate/files/mlafleet-perf-bench --base-url "http://127.0.0.1:$port" --model tiny-glm5 \
      --workload '{"input_len": 1024, "output_len": 128, "num_prompts": 32, "concurrency": 16, "warmup": 8, "seed": 0}' \
      --repeats 2 > "$2/serve-perf.json" || rc=1
    kill -INT $server; wait $server
    [ $rc -eq 0 ] && cp "$2/serve-openai.json" "$results/serve.json"
    echo "serve rc $rc"; exit $rc ;;
  single)
    # the two mixed pairs (vLLM's attention with our indexer and the reverse) tell which part a
    # difference comes from
    lanes "one ref-bf16 0 --model $m $ref; one ref-fp8 0 --model $m $ref --kv fp8_ds_mla; one ref-gguf 0 --model $m $ref --gguf; one mix-flashmla-free 0 --model $m --backend FLASHMLA_SPARSE --indexer fallback" \
          "one ours-bf16 1 --model $m $ours; one ours-fp8 1 --model $m $ours --kv fp8_ds_mla; one ours-gguf 1 --model $m $ours --gguf; one mix-triton-deepgemm 1 --model $m --backend TRITON_MLA_SPARSE --indexer deepgemm"
    finish single "$2" ref-bf16 ref-fp8 ref-gguf ours-bf16 ours-fp8 ours-gguf mix-flashmla-free mix-triton-deepgemm ;;
  heads8)
    lanes "one ref8-bf16 0 --model $m8 $ref; one ref8-fp8 0 --model $m8 $ref --kv fp8_ds_mla" \
          "one ours8-bf16 1 --model $m8 $ours; one ours8-fp8 1 --model $m8 $ours --kv fp8_ds_mla"
    finish heads8 "$2" ref8-bf16 ref8-fp8 ours8-bf16 ours8-fp8 ;;
  control)  # vLLM against itself: its own path with the prefills cut into 2048-token chunks
    lanes "one refchunk-bf16 0 --model $m $ref --chunk 2048" "one ref8chunk-bf16 1 --model $m8 $ref --chunk 2048"
    finish control "$2" refchunk-bf16 ref8chunk-bf16 ;;
  graphs)  # vLLM's default mode (torch.compile + CUDA graphs) instead of eager, bf16
    lanes "one refgraphs-bf16 0 --model $m $ref --graphs" "one oursgraphs-bf16 1 --model $m $ours --graphs"
    finish graphs "$2" refgraphs-bf16 oursgraphs-bf16 ;;
  heads8-graphs-fp8)  # one GPU: 8 heads (GLM-5's rank at TP8), fp8_ds_mla, compiled + CUDA graphs
    one ref8graphs-fp8 0 --model "$m8" $ref --graphs --kv fp8_ds_mla
    one ours8graphs-fp8 0 --model "$m8" $ours --graphs --kv fp8_ds_mla
    finish heads8-graphs-fp8 "$2" ref8graphs-fp8 ours8graphs-fp8 ;;
  heads8-gluon-fp8)  # ours, 8 heads, fp8_ds_mla, compiled + CUDA graphs: the Triton fp8 kernel (the
    # launcher's choice here) against the Gluon one forced (SM12x's choice, MLAFLEET_SPARSE_MLA_FP8_KERNEL); resumable
    step ours8graphs-fp8 --model "$m8" $ours --graphs --kv fp8_ds_mla
    MLAFLEET_SPARSE_MLA_FP8_KERNEL=gluon step ours8gluon-fp8 --model "$m8" $ours --graphs --kv fp8_ds_mla
    finish heads8-gluon-fp8 "$2" ours8graphs-fp8 ours8gluon-fp8 ;;
  prefill-ws)  # ours, fp8_ds_mla, compiled + CUDA graphs, on the 8-head and the 64-head model: prefill
    # tokens through the bf16 workspace (the backend's rule) against every token on the fp8 kernel
    # (MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE=off); REPEATS=N: N timed runs each; resumable
    export RUN_TIMEOUT=400
    reps=${REPEATS:+--repeats $REPEATS}
    step ours8ws-fp8 --model "$m8" $ours --graphs --kv fp8_ds_mla $reps
    MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE=off step ours8nows-fp8 --model "$m8" $ours --graphs --kv fp8_ds_mla $reps
    step oursws-fp8 --model "$m" $ours --graphs --kv fp8_ds_mla $reps
    MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE=off step oursnows-fp8 --model "$m" $ours --graphs --kv fp8_ds_mla $reps
    finish prefill-ws "$2" ours8nows-fp8 ours8ws-fp8 oursnows-fp8 oursws-fp8 ;;
  heads8-graphs-bf16)  # the same with the bf16 KV cache
    one ref8graphs-bf16 0 --model "$m8" $ref --graphs
    one ours8graphs-bf16 0 --model "$m8" $ours --graphs
    finish heads8-graphs-bf16 "$2" ref8graphs-bf16 ours8graphs-bf16 ;;
  heads8-profile)  # issue 16's regime with a profile of the decode steps at batch 32; resumable
    export RUN_TIMEOUT=400
    for kv in fp8_ds_mla auto; do
      step "ref8prof-$kv" --model "$m8" $ref --graphs --kv $kv --profile "$results/prof-ref8-$kv"
      step "ours8prof-$kv" --model "$m8" $ours --graphs --kv $kv --profile "$results/prof-ours8-$kv"
    done
    finish heads8-profile "$2" ref8prof-fp8_ds_mla ours8prof-fp8_ds_mla ref8prof-auto ours8prof-auto ;;
  heads8-round)  # heads8-profile's four runs, ours with vLLM's own top-k (what SM120 runs on 0.32.0),
    # then the prefill steps profiled (the batch of 32 x 3000 tokens, one output token); resumable
    export RUN_TIMEOUT=400 LOGS="$2"
    for kv in auto fp8_ds_mla; do
      step "ours8prof-$kv" --model "$m8" $ours --graphs --kv $kv --profile "$results/prof-ours8-$kv"
      step "ref8prof-$kv" --model "$m8" $ref --graphs --kv $kv --profile "$results/prof-ref8-$kv"
    done
    for kv in auto fp8_ds_mla; do
      step "ours8vtopk-$kv" --model "$m8" $ours --topk vllm --graphs --kv $kv
    done
    prefill_profiles
    finish heads8-round "$2" ref8prof-auto ours8prof-auto ours8vtopk-auto ref8prof-fp8_ds_mla ours8prof-fp8_ds_mla \
      ours8vtopk-fp8_ds_mla ref8pre-auto ours8pre-auto ref8pre-fp8_ds_mla ours8pre-fp8_ds_mla ;;
  heads8-deep)  # issue 16's regime, 16 layers and the 2-layer model, ours with vLLM's own top-k (SM120's
    # default on 0.32.0), three timed runs each; resumable
    export RUN_TIMEOUT=400 LOGS="$2"
    for kv in auto fp8_ds_mla; do
      step "ours8deep-$kv" --model "$m8deep" $ours --topk vllm --graphs --kv $kv --repeats 3
      step "ref8deep-$kv" --model "$m8deep" $ref --graphs --kv $kv --repeats 3
    done
    for kv in auto fp8_ds_mla; do
      step "ours8two-$kv" --model "$m8" $ours --topk vllm --graphs --kv $kv --repeats 3
      step "ref8two-$kv" --model "$m8" $ref --graphs --kv $kv --repeats 3
    done
    finish heads8-deep "$2" ref8deep-auto ours8deep-auto ref8deep-fp8_ds_mla ours8deep-fp8_ds_mla \
      ref8two-auto ours8two-auto ref8two-fp8_ds_mla ours8two-fp8_ds_mla ;;
  heads8-host)  # the 2-layer model's decode at batch 1, ours against the reference, with a profile of
    # those steps' host side (the fixed per-step cost of docs/e2e-h200.md, fourth round); resumable
    export RUN_TIMEOUT=400 LOGS="$2"
    for kv in auto fp8_ds_mla; do
      step "ours8host-$kv" --model "$m8" $ours --topk vllm --graphs --kv $kv --repeats 3 \
        --profile "$results/host-ours8-$kv" --profile-batch 1
      step "ref8host-$kv" --model "$m8" $ref --graphs --kv $kv --repeats 3 \
        --profile "$results/host-ref8-$kv" --profile-batch 1
    done
    finish heads8-host "$2" ref8host-auto ours8host-auto ref8host-fp8_ds_mla ours8host-fp8_ds_mla ;;
  heads8-prefill)  # heads8-round's prefill profiles alone (bf16 first); resumable
    export RUN_TIMEOUT=400 LOGS="$2"
    prefill_profiles
    finish heads8-prefill "$2" ref8pre-auto ours8pre-auto ref8pre-fp8_ds_mla ours8pre-fp8_ds_mla ;;
  heads8-graphs-fp8-mixed)  # where a difference comes from: each attention with the other's indexer
    one mix8graphs-flashmla-free 0 --model "$m8" --backend FLASHMLA_SPARSE --indexer fallback --graphs --kv fp8_ds_mla
    one mix8graphs-triton-deepgemm 0 --model "$m8" --backend TRITON_MLA_SPARSE --indexer deepgemm --graphs --kv fp8_ds_mla
    finish heads8-graphs-fp8-mixed "$2" ref8graphs-fp8 mix8graphs-flashmla-free mix8graphs-triton-deepgemm ours8graphs-fp8 ;;
  graphs-fp8)
    lanes "one refgraphs-fp8 0 --model $m $ref --graphs --kv fp8_ds_mla" "one oursgraphs-fp8 1 --model $m $ours --graphs --kv fp8_ds_mla"
    finish graphs-fp8 "$2" refgraphs-fp8 oursgraphs-fp8 ;;
  tp2-graphs)
    one reftp2graphs-bf16 0,1 --model "$m" $ref --tp 2 --graphs
    one ourstp2graphs-bf16 0,1 --model "$m" $ours --tp 2 --graphs
    finish tp2-graphs "$2" reftp2graphs-bf16 ourstp2graphs-bf16 ;;
  fp8-block)  # issue 42: the block-FP8 snapshot staged by the weights role, ours against vLLM's own; resumable
    # a run may start until 300 s into the call: 280 s each keeps the call inside 600 s
    export RUN_TIMEOUT=280 LOGS="$2"
    # vLLM's DeepGEMM warm-up JIT-compiles thousands of shapes on a fresh machine (3412, past a run's cap); skipped, only the shapes used compile
    export VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip}
    fp8_stage "$2" || { echo "== the block-FP8 snapshot could not be written"; exit 1; }
    for kv in auto fp8_ds_mla; do
      step "fp8-ours-$kv" --model "$mfp8" $ours --kv $kv --correctness-only
      step "fp8-ref-$kv" --model "$mfp8" $ref --kv $kv --correctness-only
    done
    VLLM_USE_DEEP_GEMM=0 step fp8-oursnodg-auto --model "$mfp8" $ours --correctness-only
    [ "${DRY_RUN:-}" = 1 ] && { echo "== dry run: no engine ran"; exit 0; }
    names=(fp8-ref-auto fp8-ours-auto fp8-oursnodg-auto fp8-ref-fp8_ds_mla fp8-ours-fp8_ds_mla)
    finish fp8-block "$2" "${names[@]}"
    files=(); for n in "${names[@]}"; do [ -f "$results/$n.json" ] && files+=("$results/$n.json"); done
    [ ${#files[@]} -lt 2 ] || "$py" bench/engine_e2e.py tokens "$2/fp8-block-tokens.json" "${files[@]}" ;;
  fp8-alias)  # `--kv-cache-dtype fp8` with TRITON_MLA_SPARSE (the patch set's mla-fp8-kv edit)
    one ours-fp8alias 0 --model "$m" $ours --kv fp8
    tar -C "$results" -czf "$2/fp8-alias-results.tar.gz" . ;;
  tp2)
    for spec in "reftp2-bf16:$ref" "ourstp2-bf16:$ours" "reftp2-fp8:$ref --kv fp8_ds_mla" "ourstp2-fp8:$ours --kv fp8_ds_mla"; do
      # shellcheck disable=SC2086
      one "${spec%%:*}" 0,1 --model $m --tp 2 ${spec#*:}
    done
    finish tp2 "$2" reftp2-bf16 reftp2-fp8 ourstp2-bf16 ourstp2-fp8 ;;
  *) echo "usage: $0 setup PARTS_DIR [--no-models] | fp8-block|line|serve|single|heads8|heads8-profile|heads8-round|heads8-prefill|heads8-deep|heads8-host|heads8-graphs-fp8|heads8-graphs-bf16|heads8-graphs-fp8-mixed|prefill-ws|control|graphs|graphs-fp8|fp8-alias|tp2|tp2-graphs OUT_DIR | vllm-tests OUT_DIR [FIRST] [SHARDS]" >&2; exit 2 ;;
esac
