#!/bin/bash
# Print a digest of a vLLM virtual environment: every file name (the tree) and the sha256 of
# every Python source under site-packages/vllm and of everything in the patch backup.
# Cheap enough to run several times on a 6 GB venv; any change the role makes shows up here.
set -euo pipefail
cd "$(readlink -f "$1")"
find . ! -path '*/__pycache__*' | LC_ALL=C sort
find . \( -path './lib/python3*/site-packages/vllm/*.py' -o -path './mlafleet-patch-backup/*' \) \
  -type f ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum
