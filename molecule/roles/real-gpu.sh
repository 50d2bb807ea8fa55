#!/bin/bash
# The gpu-stack roles' validation and verification on a real GPU host, read-only
# (ansible-playbook -c local against localhost). From the repository root:
#   molecule/roles/real-gpu.sh WHEEL_DIR
# WHEEL_DIR holds ansible-core 2.19.14 and what the host's Python lacks of its requirements
# (on the H200 image: resolvelib, cryptography, cffi, pycparser); pass "" when ansible-playbook exists.
set -u
whl="${1:-}"
if [ -n "$whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$whl"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
    playbook=(python3 /tmp/site/bin/ansible-playbook)
else
    playbook=(ansible-playbook)
fi
export LC_ALL=C.UTF-8 ANSIBLE_ROLES_PATH=$PWD/roles ANSIBLE_LOCALHOST_WARNING=False \
       ANSIBLE_NOCOLOR=1 ANSIBLE_CALLBACK_RESULT_FORMAT=yaml ANSIBLE_DEPRECATION_WARNINGS=False
echo "== the machine, read directly"
nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
head -1 /proc/driver/nvidia/version
echo "modinfo: $(command -v modinfo || echo absent)"; command -v modinfo >/dev/null && modinfo -F license nvidia
echo "nvcc: $(command -v nvcc) -> $(readlink -f "$(command -v nvcc)")"; nvcc --version | tail -2
nvcc --list-gpu-code | tr '\n' ' '; echo
echo "mokutil: $(command -v mokutil || echo absent)"; grep PRETTY /etc/os-release; uname -r
count=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
ver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
flavour=proprietary; grep -q "Open Kernel Module" /proc/driver/nvidia/version && flavour=open
home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
# Typed extra vars (JSON): preflight compares preflight_min_free_gb as a number.
vars="{\"ansible_python_interpreter\": \"$(command -v python3)\", \"preflight_min_free_gb\": 1,
  \"nvidia_driver_version\": \"$ver\", \"nvidia_driver_expected_gpu_count\": $count,
  \"nvidia_driver_expected_compute_capability\": \"$cc\", \"cuda_toolkit_home\": \"$home\"}"
run() { "${playbook[@]}" -c local -i localhost, -e "$vars" "$@"; }
echo "== playbooks/gpu_stack_verify.yml (flavour $flavour, driver $ver, $count GPUs, cc $cc, CUDA home $home)"
run playbooks/gpu_stack_verify.yml -e nvidia_driver_flavour="$flavour"; echo "rc=$?"
other=open; [ "$flavour" = open ] && other=proprietary
echo "== validation with nvidia_driver_flavour=$other"
run molecule/roles/validate-only.yml -e nvidia_driver_flavour="$other"; echo "rc=$?"
