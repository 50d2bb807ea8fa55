#!/bin/bash
# On the controller: what bench/patchset_engine_h200.sh needs on the H200 machine, in parts
# of at most 61 MiB (one device call carries at most 64 MiB), under .dev/gpu/p1..pN.
#   bench/patchset_engine_bundle.sh          (after `mlafleet patchset build --vllm 0.20.2`)
# Then, in consecutive device calls (files stay while the machine is warm), carry .dev/gpu/pK
# and copy it to /tmp/mb; in the last one:
#   cd /tmp/mb && cat all.tar.part-* | tar -xf - && cd - &&
#   bench/patchset_engine_h200.sh /tmp/mb/bundle /tmp/mb/bundle/tiny-glm5 $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${MLAFLEET_CACHE:-$HOME/.cache/mlafleet}/dl/vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl
built=build/patchset/0.20.2/files
model=${MLAFLEET_TINY_GLM5:-../shared/notes/tiny-glm5}
[ -d "$built" ] || { echo "run: mlafleet patchset build --vllm 0.20.2" >&2; exit 1; }
[ -f "$model/config.json" ] || { echo "no tiny GLM-5 config at $model (set MLAFLEET_TINY_GLM5)" >&2; exit 1; }
out=.dev/gpu && rm -rf "$out" && mkdir -p "$out/bundle/site" "$out/bundle/tiny-glm5"
# vLLM itself, patched; the FA2 binary is left out (the MLA layer needs only one of FA2/FA3).
unzip -q "$wheel" -d "$out/bundle/site" -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
cp -r "$built/vllm/." "$out/bundle/site/vllm/"
tar -C "$out/bundle/site" -cf - . | xz -T2 -6 > "$out/bundle/vllm-site.tar.xz" && rm -rf "$out/bundle/site"
cp "$model/config.json" "$out/bundle/tiny-glm5/"
# vLLM's requirements that the H200 image (Python 3.12, torch 2.11.0+cu130) lacks, at versions
# whose own requirements the image satisfies (checked 2026-11-29).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out/bundle/wheels" \
  "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection msgspec "pyzmq>=25" \
  cbor2 cachetools pybase64 setproctitle partial-json-parser "openai>=2,<3" jiter distro sniffio \
  "fastapi>=0.115,<0.130" "starlette<1" tqdm "gguf>=0.17" "xgrammar>=0.1.32,<0.2" \
  "apache-tvm-ffi==0.1.9" "llguidance>=1.3,<1.4" "openai-harmony>=0.0.3"
(cd "$out" && tar -cf - bundle | split -b 61M -d - all.tar.part- && rm -rf bundle)
for part in "$out"/all.tar.part-*; do d="$out/p$((10#${part##*-} + 1))"; mkdir -p "$d" && mv "$part" "$d/"; done
du -sh "$out"/p*
