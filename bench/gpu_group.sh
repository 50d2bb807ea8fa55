#!/bin/bash
# A serving group on the GPU machine (issue 44), every process launched with the serve script,
# environment and launcher that the vllm_server role renders for it (bench/gpu_group.yml renders
# them from the role's templates; the members' view comes from preflight's serving_groups filter).
# Needs `bench/engine_gpu.sh setup` of the 0.32.0 bundle first (the patched venv with Ray, the tiny
# GLM-5 models and Ansible under /tmp/e2e; docs/e2e-h200.md says how the bundle travels).
#
#   bench/gpu_group.sh one OUT        one GPU: the single-host unit at TP 1 (the reference), a
#                                     native group of one node (--nnodes 1) and a one-node Ray
#                                     cluster at TP 1 (vLLM's Ray executor)
#   bench/gpu_group.sh two OUT        two GPUs, two "nodes" on the host (a GPU, a port and a node
#                                     rank each, NCCL between them over the loopback): the single-host
#                                     unit at TP 2 in one process (the reference); a native group at
#                                     TP 2, the same on two Ray nodes, pipeline parallel 2 (native);
#                                     then the worker of a native TP 2 group killed under a stream
#   bench/gpu_group.sh render OUT one|two    the files only, no GPU (what the controller checks)
#
# Every case: time to ready, greedy tokens of fixed prompts against the reference (equal, or a near tie
# at the first difference: bench/group_tokens.py), the smoke test the smoke_test role renders, the role's check of the
# attention backend on the head's log, and output tokens/s with the perf gate's client. NVLink
# multicast stays off (NCCL_NVLS_ENABLE=0 and the other switches, set in vllm_server_env as an
# operator sets them). Results: OUT/gpu-group.md (the tables), OUT/*.json, OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${E2E_WORK:-/tmp/e2e}
venv=$work/venv g=$work/group id=0.32.0-gpu
model=${GPU_GROUP_MODEL:-$work/models/tiny-glm5}  # 64 heads: 32 a rank at TP 2
ansible=(python3 "$work/ansible/bin/ansible-playbook")
[ -z "${E2E_ANSIBLE_PLAYBOOK:-}" ] || ansible=("$E2E_ANSIBLE_PLAYBOOK")
PY=${E2E_PYTHON:-$venv/bin/python}
# The script's own check on the controller runs it against vLLM's CPU build with the lab's tiny
# Llama: GPU_GROUP_MODEL, GPU_GROUP_ARGS (a JSON list: the server arguments), GPU_GROUP_ENV (a
# JSON object added to vllm_server_env) and GPU_GROUP_BACKEND (the backend the check expects).
expect=${GPU_GROUP_BACKEND:-TRITON_MLA_SPARSE}

mode=${1:-} out=${2:-} only=${GPU_GROUP_CASES:-}
[ -n "$out" ] || { sed -n 2,22p "$0" >&2; exit 2; }
mkdir -p "$out" && out=$(cd "$out" && pwd)
shape=$mode; [ "$mode" != render ] || shape=${3:?render OUT one|two}
case $shape in one|two) ;; *) echo "usage: $0 one|two OUT, or $0 render OUT one|two" >&2; exit 2 ;; esac

playbook() {
  LC_ALL=C.UTF-8 PYTHONPATH="$work/ansible${PYTHONPATH:+:$PYTHONPATH}" ANSIBLE_CONFIG="$PWD/ansible.cfg" \
    ANSIBLE_LOCALHOST_WARNING=False ANSIBLE_NOCOLOR=1 MLAFLEET_REPORT_ROOT="$g/reports" \
    "${ansible[@]}" -i "$g/inventory.yml" bench/gpu_group.yml "$@"
}

# The processes of each case: NAME GROUP LAUNCH TP PP GPUS PORT (GROUP "-": a single host).
if [ "$shape" = one ]; then
  cases=(ref native ray)
  procs=("ref-0 - native 1 1 0 8200" "native-0 native native 1 1 0 8100" "ray-0 ray ray 1 1 0 8300")
else
  cases=(ref native ray pp fault)
  procs=("ref-0 - native 2 1 0,1 8200"
         "native-0 native native 2 1 0 8100" "native-1 native native 2 1 1 8101"
         "ray-0 ray ray 2 1 0 8300" "ray-1 ray ray 2 1 1 8301"
         "pp-0 pp native 1 2 0 8400" "pp-1 pp native 1 2 1 8401"
         "fault-0 fault native 2 1 0 8500" "fault-1 fault native 2 1 1 8501")
fi

render() {
  rm -rf "$g" && mkdir -p "$g"
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  PY="$PY" G="$g" ID="$id" MODEL="$model" GPU="${gpu:-no GPU (render only)}" python3 - "${procs[@]}" > "$g/inventory.yml" <<'PY'
import json, os, sys
hosts, children = {}, {}
for spec in sys.argv[1:]:
    name, group, launch, tp, pp, gpus, port = spec.split()
    root = f"{os.environ['G']}/{name}"
    args = json.loads(os.environ.get("GPU_GROUP_ARGS") or "null") or [
        "--max-model-len=8192", "--gpu-memory-utilization=0.4", "--kv-cache-dtype=fp8_ds_mla",
        "--attention-backend=TRITON_MLA_SPARSE", "--enforce-eager"]
    hosts[name] = {
        "vllm_server_root": root, "vllm_server_home": f"{root}/home", "vllm_server_port": int(port),
        # a single host states its parallel layout in its arguments; a group's come from its view
        "vllm_server_args": args + ([f"--tensor-parallel-size={tp}"] if group == "-" and tp != "1" else []),
        "gpu_group_name": "" if group == "-" else group, "gpu_group_launch": launch,
        "gpu_group_tensor": int(tp), "gpu_group_pipeline": int(pp), "gpu_group_gpus": gpus}
    if group != "-":
        children.setdefault(group, {"hosts": {}})["hosts"][name] = {}
common = {
    "vllm_server_release_id": os.environ["ID"], "vllm_server_model": os.environ["MODEL"],
    "vllm_server_served_model_name": "tiny-glm5", "vllm_server_cuda_home": "/usr/local/cuda",
    "vllm_server_start_timeout": 600, "vllm_server_triton_sparse_mla": True,
    "vllm_server_env": {
        # SM90 here: ours is named by --attention-backend, the indexer's DeepGEMM-free path by this
        "MLAFLEET_INDEXER_FALLBACK": "1",
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
        # the bundle's torch 2.13.0 beside the image's cuDNN 9.19 (bench/engine_bundle.sh)
        "PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK": "1",
        # one set of compile caches for every process (the role keeps them per host, under its home)
        **{key: f"{os.environ['G']}/cache/{sub}" for key, sub in (
            ("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
            ("FLASHINFER_WORKSPACE_BASE", "flashinfer"), ("CUDA_CACHE_PATH", "nv"))},
        # greedy only: vLLM's own sampler, not FlashInfer's (built at run time: 2 minutes of a first start)
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        **json.loads(os.environ.get("GPU_GROUP_ENV") or "{}")},
    "gpu_group_gpu": os.environ["GPU"], "gpu_group_master_port": 29511, "gpu_group_ray_port": 6390}
# Settings go in as one variable per host that the playbook sets as facts: above the roles' defaults
# (which it reads as vars_files, as an inventory's variables would be above a role's defaults).
hosts = {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                "gpu_group_settings": {**common, **mine}} for name, mine in hosts.items()}
json.dump({"all": {"hosts": hosts, "children": children}}, sys.stdout, indent=1)
PY
  playbook > "$out/render.log" 2>&1 || { tail -40 "$out/render.log"; return 1; }
  grep -E '"msg"|ok=|failed=' "$out/render.log" | sed 's/^/  /'
  for spec in "${procs[@]}"; do
    set -- $spec
    mkdir -p "$g/$1/run" "$g/$1/home"
    ln -sfn "$venv" "$g/$1/releases/$id/venv"
    cp "$g/$1/releases/$id/server/serve" "$out/$1.serve"
    cp "$g/$1/releases/$id/server/vllm.env" "$out/$1.env"
  done
  # pip --target puts Ray's console script outside the venv: the one the Ray units run is this
  if [ ! -x "$venv/bin/ray" ] && "$venv/bin/python" -c 'import ray' 2>/dev/null; then
    printf '#!%s\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' "$venv/bin/python" > "$venv/bin/ray"
    chmod +x "$venv/bin/ray"
  fi
}

spec_of() { local s; for s in "${procs[@]}"; do [ "${s%% *}" = "$1" ] && echo "$s"; done; }
members() { local s; for s in "${procs[@]}"; do case $s in "$1"-*) echo "${s%% *}";; esac; done; }

# Start one process as vllm.service starts it: its environment file, then its serve script
# (its own process group, so that stopping it stops everything it started).
start() {
  local name=$1 gpus
  gpus=$(spec_of "$name" | awk '{print $6}')
  CUDA_VISIBLE_DEVICES=$gpus RUNTIME_DIRECTORY=$g/$name/run setsid bash -c \
    'set -a; . "$1/server/vllm.env"; set +a; exec "$1/server/serve"' _ "$g/$name/releases/$id" \
    > "$out/$name.log" 2>&1 < /dev/null &
  echo $! > "$g/$name/pid"
}

alive() { kill -0 "$(cat "$g/$1/pid")" 2>/dev/null; }

stop() {
  local name pid t
  for name in "$@"; do pid=$(cat "$g/$name/pid" 2>/dev/null) && kill -TERM -- "-$pid" 2>/dev/null; done
  for t in $(seq 90); do
    local any=0
    for name in "$@"; do ! alive "$name" || any=1; done
    [ $any = 1 ] || break; sleep 1
  done
  for name in "$@"; do pid=$(cat "$g/$name/pid" 2>/dev/null) && kill -KILL -- "-$pid" 2>/dev/null; done
  "$venv/bin/ray" stop --force > /dev/null 2>&1 || true
}

url() { echo "http://127.0.0.1:$(spec_of "$1" | awk '{print $7}')"; }

healthy() { "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$(url "$1")/health" 2>/dev/null; }

# Wait for the head's /health while every member lives; echo the seconds it took.
ready() {
  local head=$1 t0=$SECONDS; shift
  until healthy "$head"; do
    local name
    for name in "$head" "$@"; do alive "$name" || { echo "died: $name" >&2; return 1; }; done
    [ $((SECONDS - t0)) -lt 600 ] || { echo "not ready in 600 s" >&2; return 1; }
    sleep 2
  done
  echo $((SECONDS - t0))
}

table=$out/gpu-group.md
row() { echo "$*" | tee -a "$table"; }

run_case() {
  local case=$1 head rest secs rc=0
  mapfile -t names < <(members "$case"); head=${names[0]}; rest=("${names[@]:1}")
  echo "== $case: ${names[*]} (GPUs $(for n in "${names[@]}"; do spec_of "$n" | awk '{printf "%s ", $6}'; done))"
  local t0=$SECONDS
  for name in "${names[@]}"; do start "$name"; done
  if ! secs=$(ready "$head" "${rest[@]}"); then
    for name in "${names[@]}"; do echo "-- $name"; tail -25 "$out/$name.log"; done
    stop "${names[@]}"; row "| $case | not ready | | | | |"; return 1
  fi
  "$PY" bench/group_tokens.py tokens "$(url "$head")" tiny-glm5 "$out/$case.json" || rc=1
  echo '""' | "$PY" "$g/$head/smoke.py" > "$out/$case-smoke.json" 2> "$out/$case-smoke.err" || rc=1
  local backend
  backend=$(playbook --limit "$head" -e gpu_group_log="$out/$head.log" -e gpu_group_expected_backend="$expect" 2>&1 | tee "$out/$case-backend.log" |
            sed -n "s/^ *msg: '[^:]*: \(.*\)'\$/\1/p" | tail -1)
  grep -q 'failed=0' "$out/$case-backend.log" || rc=1
  "$PY" roles/perf_gate/files/mlafleet-perf-bench --base-url "$(url "$head")" --model tiny-glm5 \
    --workload '{"input_len": 512, "output_len": 128, "num_prompts": 32, "concurrency": 16, "warmup": 4, "seed": 0}' \
    --repeats 1 > "$out/$case-perf.json" 2> "$out/$case-perf.err" || rc=1
  local tps smoke
  tps=$("$PY" -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["runs"][0]["output_throughput"], 1))' "$out/$case-perf.json" 2>/dev/null)
  smoke=$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d.get("completion", d))' "$out/$case-smoke.json" 2>/dev/null | cut -c1-80)
  [ "$case" != fault ] || fault "$head" "${rest[@]}" || rc=1
  stop "${names[@]}"
  row "| $case | ${#names[@]} | $secs | ${tps:-?} | ${backend:-?} | rc $rc |"
  echo "   smoke: $smoke"
  return $rc
}

# The worker killed while the head serves a stream: what the head does, and when.
fault() {
  local head=$1 worker=$2 t0 line
  "$PY" - "$(url "$head")" > "$out/fault-stream.log" 2>&1 <<'PY' &
import json, sys, time, urllib.request
body = {"model": "tiny-glm5", "prompt": "The fleet", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
req = urllib.request.Request(sys.argv[1] + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
t0, n = time.time(), 0
try:
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            if raw.startswith(b"data: {"):
                n += 1
                if n % 100 == 0:
                    print(f"{time.time() - t0:.1f} s: {n} chunks", flush=True)
    print(f"stream ended after {n} chunks, {time.time() - t0:.1f} s", flush=True)
except Exception as e:  # noqa: BLE001 - what the client saw is the result
    print(f"stream failed after {n} chunks, {time.time() - t0:.1f} s: {type(e).__name__}: {e}", flush=True)
PY
  local streamer=$!
  sleep 3
  t0=$SECONDS
  kill -KILL -- "-$(cat "$g/$worker/pid")"
  echo "   killed $worker's process group at stream t+3 s"
  local health="" ended=""
  while [ $((SECONDS - t0)) -lt 120 ]; do
    [ -n "$health" ] || healthy "$head" || health=$((SECONDS - t0))
    [ -n "$ended" ] || alive "$head" || ended=$((SECONDS - t0))
    [ -z "$health" ] || [ -z "$ended" ] || break
    sleep 1
  done
  wait $streamer
  line=$(tail -1 "$out/fault-stream.log")
  row "| fault: worker killed | head /health failing after ${health:-never (120 s)} s | head ended after ${ended:-never (120 s)} s | stream: $line | | |"
  tail -15 "$out/$head.log" > "$out/fault-head-tail.log"
}

render || exit 1
[ "$mode" != render ] || { echo "rendered under $g; copies of each serve script and vllm.env in $out"; exit 0; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
if [ ! -s "$table" ]; then
  row "| case | processes | ready (s) | output tok/s | backend in use (the role's check) | result |"
  row "| --- | ---: | ---: | ---: | --- | --- |"
fi
status=0
for c in "${cases[@]}"; do
  # GPU_GROUP_CASES="ref native": these cases only (a call's time limit; the table and tokens add up in OUT)
  [ -z "$only" ] || [[ " $only " == *" $c "* ]] || continue
  run_case "$c" || status=1
done
echo "== greedy tokens against the reference"
"$PY" bench/group_tokens.py compare "$out/ref.json" $(for c in "${cases[@]}"; do [ "$c" = ref ] || [ ! -f "$out/$c.json" ] || echo "$out/$c.json"; done) |
  tee -a "$table" || status=1
echo "gpu_group $mode: rc $status"
exit $status
