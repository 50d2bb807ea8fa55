#!/bin/sh
# Ansible managed
# The vLLM server of release 0.32.0-5f268df039, one revision of its server configuration
# (releases/<id>/server.d/<revision>/): vllm.service runs /opt/mlafleet/current/server/serve,
# so switching `current` and the release's `server` link (rollout, rollback) switches the venv,
# these arguments and the environment file beside them at once. The state served is written as
# <release>@<revision> for the rollout to compare.
revision=$(basename "$(dirname "$(readlink -f "$0")")")
echo 0.32.0-5f268df039"@$revision" > "${RUNTIME_DIRECTORY:-/run/vllm}/release"
exec /opt/mlafleet/releases/0.32.0-5f268df039/venv/bin/python -m vllm.entrypoints.openai.api_server \
    --model=/opt/mlafleet/models/model \
    --served-model-name=model \
    --shutdown-timeout=120 \
    --host=127.0.0.1 \
    --port=8000
