#!/usr/bin/env bash
# On a GPU machine without network and with torch 2.11: run vLLM 0.33.0's own engine from its
# source tree (its wheel pins torch 2.14), pristine against patched, in one device call
# (docs/records/engine-0.33.0-route-study-2026-11-27.md says why each step is needed).
#
#   scripts/gpu-engine-033.sh WHEELS_DIR TREES_DIR OUT
#
# WHEELS_DIR: the third-party wheels 0.33.0's offline LLM(...) path imports that the machine
#   lacks: the 0.21.0 payload's `dependencies` (data/gpu-payload.json) and two that 0.33.0's
#   model loader adds (compressed-tensors, loguru), 42 wheels, 33.6 MB, without vLLM 0.21.0's
#   wheel (the two 50 MB parts of the full payload do not fit one call). Gather them here, from the cache that `scripts/gpu-payload build` filled:
#     python3 scripts/engine033/wheels.py .gpu-carry/wheels-0.33.0
#   (it copies each pinned file and checks its sha256; none is missing from the cache once
#   the payload has been built).
# TREES_DIR: the folder `scripts/gpu-payload trees` wrote (parts and manifest.json), 7.4 MB.
# Carry both folders and nothing else big: about 44 MB with the repository.
# Before spending the call, `scripts/engine033/cpu_check.py` repeats here (no GPU) the import
# and model-build checks the study ran.
#
# Steps (timings are estimates; the call has 10 minutes, this aims at 9):
#   1. the wheels installed into $SM12X_GPU_HOME/deps-0.33.0 (pip --no-index --target), the
#      trees unpacked into $SM12X_GPU_HOME/trees (scripts/gpu-payload unpack);
#   2. each side's tree made an installed vLLM in $SM12X_GPU_HOME/engine-0.33.0/<side>
#      (scripts/engine033/prepare.py: the cumem extension built from the tree, the torch
#      stand-in for _C_stable_libtorch, an empty FlashAttention 2 placeholder, metadata);
#      REAL_C=FILE (the wheel's vllm/_C_stable_libtorch.abi3.so) puts the real module there
#      instead, for a later call that can carry it (64 MB packed: a call of its own);
#   3. probe-pristine.json: one small engine at 0.33.0's defaults (scripts/engine033/probe.py);
#      if it fails, probe-pristine-native.json: the same with custom ops off and the IR norms
#      native, to tell a stand-in op from anything else; the patched side's probe follows
#      only when the pristine one passed;
#   4. engine.json: `sm12x-bundle engine-check --compare --quick` on the pristine install
#      (its patched copy: the lane's series and extension, as for 0.21.0), in what time is left.
# ENGINE033_BUDGET_S (default 535) bounds the whole run in seconds; ENGINE033_CHECK (default
# --quick) is the engine check's scenario options, e.g. "--scenario a,d1,d2 --model-gib 1".
# ENGINE033_MODE: eager (default) or graphs: CUDA graphs without torch.compile
# (compilation_config mode NONE, cudagraph_mode FULL: vLLM's compile passes need vllm._C's
# fp8 ops, capture needs only weak_ref_tensor, which the stand-in has); graphs mode first runs
# scripts/engine033/weakref_check.py (weak-ref.json) and stops if the stand-in fails there.
# ENGINE033_PROBES: both (default), pristine or none: which probes of step 3 run (each is an
# engine start, about a minute).
# Environment for every engine: Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0; ENGINE033_V2=1
# tries V2, whose UVA buffers use the stand-in's host view), FlashInfer's sampler off.
# OUT receives env.txt, prepare-<side>.json, probe-*.json, weak-ref.json (graphs), engine.json,
# gpu-engine-033.log.
# Set PYTHON_INCLUDE to a folder holding Python.h where this Python has none.
set -uo pipefail
cd "$(dirname "$0")/.."

wheels=$1 trees=$2 out=$3
home=${SM12X_GPU_HOME:-/tmp/sm12x-gpu}
deps=$home/deps-0.33.0 installs=$home/engine-0.33.0
mkdir -p "$out" "$home"
exec > >(tee "$out/gpu-engine-033.log") 2>&1
export PYTHONUNBUFFERED=1
include=()
[ -n "${PYTHON_INCLUDE:-}" ] && include=(--python-include "$PYTHON_INCLUDE") && export SM12X_PYTHON_INCLUDE=$PYTHON_INCLUDE

{ date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} | tee "$out/env.txt"

echo "== 1. dependencies and trees ($SECONDS s)"
if [ ! -f "$deps/.done" ]; then
  rm -rf "$deps"
  python3 -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --target "$deps" "$wheels"/*.whl \
    && touch "$deps/.done" || exit 12
fi
sha=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["archive"]["sha256"])' "$trees/manifest.json") || exit 12
if [ "$(cat "$home/trees/.archive-sha256" 2>/dev/null)" != "$sha" ]; then
  PYTHONPATH=$PWD/src python3 scripts/gpu-payload -q unpack "$trees" "$home/trees" && echo "$sha" > "$home/trees/.archive-sha256" || exit 12
fi

echo "== 2. installs ($SECONDS s)"
for side in pristine patched; do
  python3 scripts/engine033/prepare.py "$home/trees/0.33.0/$side" "$installs/$side" ${REAL_C:+--real-c "$REAL_C"} \
    "${include[@]}" > "$out/prepare-$side.json" || { cat "$out/prepare-$side.json"; exit 7; }
  cat "$out/prepare-$side.json"
done

export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=${ENGINE033_V2:-0} VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 TOKENIZERS_PARALLELISM=false
mode=${ENGINE033_MODE:-eager} probes=${ENGINE033_PROBES:-both}
case $mode in
  eager) engine_mode=(--eager) probe_mode=() ;;
  graphs) engine_mode=('--vllm-arg=--compilation-config={"mode":"NONE","cudagraph_mode":"FULL"}') probe_mode=(--graphs)
    echo "== graphs: the stand-in's weak_ref_tensor in a capture ($SECONDS s)"
    PYTHONPATH=$installs/pristine:$deps:$PWD/src timeout 120 python3 scripts/engine033/weakref_check.py "$out/weak-ref.json" || exit 9 ;;
  *) echo "ENGINE033_MODE=$mode: eager or graphs"; exit 2 ;;
esac
probe() {  # probe SIDE NAME [--native]: one engine of that install; 0 when its tokens held
  echo "== 3. probe $2 ($SECONDS s)"
  PYTHONPATH=$installs/$1:$deps:$PWD/src timeout 240 python3 scripts/engine033/probe.py "$out/probe-$2.json" "${probe_mode[@]}" "${@:3}"
  local rc=$?
  echo "== probe $2: exit $rc"
  return $rc
}
if [ "$probes" != none ] && ! probe pristine pristine; then
  probe pristine pristine-native --native
  echo "== the pristine engine did not run at 0.33.0's defaults: engine check skipped"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  exit 9
fi
[ "$probes" = both ] && probe patched patched

left=$((${ENGINE033_BUDGET_S:-535} - SECONDS))  # the call's 10 minutes, less a margin
echo "== 4. engine check, ${left} s left ($SECONDS s)"
cat > "$home/lanes-0.33.0.yaml" <<EOF
# The lanes with their pristine trees as local sources (the machine has no network).
lanes:
  - version: "0.21.0"
    source: $home/trees/0.21.0/pristine
  - version: "0.33.0"
    source: $home/trees/0.33.0/pristine
EOF
if [ "$left" -lt 150 ]; then echo "== too little time left for the engine check"; exit 0; fi
PYTHONPATH=$PWD/src:$deps timeout "$left" python3 -m sm12x_bundle engine-check --config "$home/lanes-0.33.0.yaml" \
  --compare ${ENGINE033_CHECK:---quick} --vllm-path "$installs/pristine" --work "$home/engine-work-0.33.0" --timeout 120 \
  --driver api "${engine_mode[@]}" --json-out "$out/engine.json"  # route 1 runs through vllm.LLM (the study)
rc=$?
echo "== engine-check exit $rc ($SECONDS s)"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
exit $rc
