#!/bin/sh
# Ansible managed
# The vLLM server of release 0.20.2-abcdef0123, one revision of its server configuration
# (releases/<id>/server.d/<revision>/): vllm.service runs /srv/mlafleet/current/server/serve,
# so switching `current` and the release's `server` link (rollout, rollback) switches the venv,
# these arguments and the environment file beside them at once. The state served is written as
# <release>@<revision> for the rollout to compare.
revision=$(basename "$(dirname "$(readlink -f "$0")")")
echo 0.20.2-abcdef0123"@$revision" > "${RUNTIME_DIRECTORY:-/run/vllm}/release"
exec /srv/mlafleet/releases/0.20.2-abcdef0123/venv/bin/python -m vllm.entrypoints.openai.api_server \
    --model=/opt/mlafleet/models/glm-5/GLM-5-Q4_K_M-00001-of-00010.gguf \
    --served-model-name=glm-5 \
    --hf-config-path=/opt/mlafleet/models/glm-5/config \
    --tokenizer=/opt/mlafleet/models/glm-5/config \
    --tensor-parallel-size=8 \
    --max-model-len=65536 \
    --enforce-eager \
    --shutdown-timeout=600 \
    --host=0.0.0.0 \
    --port=8100
