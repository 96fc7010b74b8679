#!/usr/bin/env bash
# Reproduce the runs of the H200 notebook, docs/records/gpu-validation-log-2026-11-21-to-23.md:
# the selftest comparison (pristine vLLM 0.21.0 against the patched tree) and the cumem
# benchmarks, on one CUDA GPU. The notebook's two extra commands (the free bench with --rounds 4,
# the speed scenario alone at 16 GiB) are run by hand.
#
#   scripts/gpu-validation.sh prepare DIR [VERSION]
#                                               # where the tool can fetch (network, cache);
#                                               # VERSION: that lane (default: the first)
#   scripts/gpu-validation.sh run DIR OUT       # on the GPU host; needs no network
#   scripts/gpu-validation.sh followup DIR OUT  # then: scenario 1 again, the wake bench,
#                                               # the first sleep with 64 register threads
#   scripts/gpu-validation.sh transactions DIR OUT [SCENARIOS]
#                                               # the sleep and wake transactions: every scenario (1-10, or the
#                                               # comma-separated list given), fault stress
#                                               # with 10,000 cycles
#   scripts/gpu-validation.sh lane DIR OUT      # scenarios 1-12 on a lane's trees
#                                               # in one run that fits 10 minutes (smaller
#                                               # speed, stress and fault-stress sizes; 13
#                                               # has its own stage, ranks)
#   scripts/gpu-validation.sh wake DIR OUT [GIB] # the wake's order: the new-memory
#                                               # bench, then the lane comparison with the
#                                               # speed scenarios at GIB (default 16)
#   scripts/gpu-validation.sh ranks DIR OUT     # scenario 13 alone (sleep and wake
#                                               # across ranks, one per GPU or 4 on one GPU)
#
# prepare: the pinned tree (sm12x-bundle fetch) and the patched tree (sm12x-bundle apply),
# each cut down to what the selftest uses (csrc/cumem_allocator*, and the vllm packages
# that cumem.py imports: about 3 MB instead of 31 MB), a pyzmq wheel for Python 3.12 (the
# one package of FIELD-NOTES' list that the GPU image lacks), and this Python's headers
# (used on the GPU host only when its Python has none: the extension uses the stable ABI).
# run: installs the wheel when pyzmq is missing, then writes into OUT: env.txt,
# selftest.json (+ selftest-work.tar: each scenario's own JSON), free-bench.json,
# first-sleep.json and run.log (everything printed).
# followup: writes env.txt, inflight.json, wake-bench.json, first-sleep-64.json and
# followup.log.
# transactions: writes env.txt, transactions.json, transactions-work.tar (each scenario's
# own JSON) and transactions.log.
# lane: writes env.txt, lane.json, lane-work.tar (each scenario's own JSON) and lane.log.
# wake: writes env.txt, new-memory.json, wake.json and wake.log.
# ranks: writes env.txt, ranks.json, ranks-work.tar (each scenario's own JSON) and ranks.log.
# The slices of 0.33.0's trees are about 6 MB each: its cumem.py imports vllm.platforms and
# vllm.utils.torch_utils, all inside the same folders as 0.21.0's.
# Each stage has a time limit so that one slow stage cannot starve the others.
set -uo pipefail
cd "$(dirname "$0")/.."

SLICE_DIRS="vllm/utils vllm/platforms vllm/distributed vllm/logging_utils vllm/ray vllm/third_party vllm/plugins vllm/device_allocator"
SLICE_FILES="vllm/v1/__init__.py vllm/v1/attention/__init__.py vllm/v1/attention/backends/__init__.py vllm/v1/attention/backends/registry.py csrc/cumem_allocator.cpp csrc/cumem_allocator_compat.h"

slice_tree() {  # slice_tree SRC DEST
  rm -rf "$2" && mkdir -p "$2"
  (cd "$1" && { ls vllm/*.py; find $SLICE_DIRS -name '*.py'; printf '%s\n' $SLICE_FILES; } | tar -cf - -T -) | tar -xf - -C "$2"
}

prepare() {
  local dir=$1 version=${2:-}
  set -e
  mkdir -p "$dir"
  local pinned patched
  pinned=$(sm12x-bundle fetch -q ${version:+--vllm "$version"})
  patched=$(mktemp -d)/vllm-patched
  sm12x-bundle apply -q ${version:+--lane "$version"} --out "$patched"
  slice_tree "$pinned" "$dir/pristine"
  slice_tree "$patched" "$dir/patched"
  rm -rf "$(dirname "$patched")"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$dir/whl" pyzmq==27.3.0
  rm -rf "$dir/python-include"
  cp -r "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" "$dir/python-include"
  du -sh "$dir"
}

setup() {  # setup DIR OUT LOG: pyzmq when missing, our package, Python.h; sets include
  local dir=$1 out=$2
  mkdir -p "$out"
  exec > >(tee "$out/$3") 2>&1
  export PYTHONUNBUFFERED=1
  if ! python3 -c 'import zmq' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/selftest-site "$dir"/whl/*.whl
    export PYTHONPATH=/tmp/selftest-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  include=()
  python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || include=(--python-include "$dir/python-include")
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    g++ --version | head -1
    nproc; free -g | head -2
  } | tee "$out/env.txt"
}

run() {
  local dir=$1 out=$2
  setup "$dir" "$out" run.log

  echo "== selftest --compare (pristine against patched)"
  timeout 330 python3 -m sm12x_bundle selftest --compare "$dir/pristine" "$dir/patched" "${include[@]}" \
    --scenario 1,2,3,4,5 --timeout 200 --work /tmp/selftest-work --json-out "$out/selftest.json"
  echo "selftest exit code: $?"
  tar -cf "$out/selftest-work.tar" -C /tmp selftest-work 2>/dev/null

  echo "== bench/cumem_free_bench.py (pool sweep of 2,000 segments)"
  timeout 120 python3 bench/cumem_free_bench.py "$dir/pristine" "$dir/patched" --rounds 2 --reps 5 \
    "${include[@]}" --json-out "$out/free-bench.json"
  echo "free bench exit code: $?"

  echo "== bench/cumem_first_sleep_bench.py (the first sleep, by pinned-memory setting)"
  timeout 100 python3 bench/cumem_first_sleep_bench.py "$dir/patched" --size-gib 8 \
    --conf '' --conf 'pinned_use_cuda_host_register:True,pinned_num_register_threads:16' \
    "${include[@]}" --json-out "$out/first-sleep.json"
  echo "first-sleep bench exit code: $?"
}

followup() {
  local dir=$1 out=$2
  setup "$dir" "$out" followup.log

  echo "== selftest --compare --scenario inflight-free (where each tree's fault surfaces)"
  timeout 120 python3 -m sm12x_bundle selftest --compare "$dir/pristine" "$dir/patched" "${include[@]}" \
    --scenario inflight-free --timeout 100 --work /tmp/selftest-work --json-out "$out/inflight.json"
  echo "selftest exit code: $?"

  echo "== bench/cumem_wake_bench.py (where wake_up's time goes)"
  timeout 120 python3 bench/cumem_wake_bench.py "$dir/patched" --size-gib 8 "${include[@]}" \
    --json-out "$out/wake-bench.json"
  echo "wake bench exit code: $?"

  echo "== bench/cumem_first_sleep_bench.py (default, 64 register threads)"
  timeout 100 python3 bench/cumem_first_sleep_bench.py "$dir/patched" --size-gib 8 \
    --conf '' --conf 'pinned_use_cuda_host_register:True,pinned_num_register_threads:64' \
    "${include[@]}" --json-out "$out/first-sleep-64.json"
  echo "first-sleep bench exit code: $?"
}

transactions() {
  local dir=$1 out=$2 which=${3:-1,2,3,4,5,6,7,8,9,10}
  setup "$dir" "$out" transactions.log

  echo "== selftest --compare, scenarios $which (fault stress: 10,000 cycles, seed 1)"
  timeout 560 python3 -m sm12x_bundle selftest --compare "$dir/pristine" "$dir/patched" "${include[@]}" \
    --scenario "$which" --fault-cycles 10000 --seed 1 --timeout 300 --work /tmp/selftest-work \
    --json-out "$out/transactions.json"
  echo "selftest exit code: $?"
  tar -cf "$out/transactions-work.tar" -C /tmp selftest-work 2>/dev/null
}

lane() {
  local dir=$1 out=$2
  setup "$dir" "$out" lane.log

  echo "== selftest --compare, scenarios 1-12 (speed 16 GiB, stress 300 cycles, fault stress 2,000 cycles, seed 1)"
  timeout 540 python3 -m sm12x_bundle selftest --compare "$dir/pristine" "$dir/patched" "${include[@]}" \
    --scenario 1,2,3,4,5,6,7,8,9,10,11,12 \
    --speed-gib 16 --cycles 300 --fault-cycles 2000 --seed 1 --timeout 150 --work /tmp/selftest-work \
    --json-out "$out/lane.json"
  echo "selftest exit code: $?"
  tar -cf "$out/lane-work.tar" -C /tmp selftest-work 2>/dev/null
}

wake() {
  local dir=$1 out=$2 gib=${3:-16}
  setup "$dir" "$out" wake.log

  echo "== bench/cumem_new_memory_bench.py (what new and released memory cost a copy)"
  timeout 100 python3 bench/cumem_new_memory_bench.py "$dir/patched" "${include[@]}" \
    --json-out "$out/new-memory.json"
  echo "new-memory bench exit code: $?"

  echo "== selftest --compare, scenarios 1-12 (speed $gib GiB, stress 300 cycles, fault stress 2,000 cycles, seed 1)"
  timeout 500 python3 -m sm12x_bundle selftest --compare "$dir/pristine" "$dir/patched" "${include[@]}" \
    --scenario 1,2,3,4,5,6,7,8,9,10,11,12 \
    --speed-gib "$gib" --cycles 300 --fault-cycles 2000 --seed 1 --timeout 150 --work /tmp/selftest-work \
    --json-out "$out/wake.json"
  echo "selftest exit code: $?"
}

ranks() {
  local dir=$1 out=$2
  setup "$dir" "$out" ranks.log

  echo "== selftest --compare --scenario ranks (sleep and wake across ranks, all or none)"
  timeout 560 python3 -m sm12x_bundle selftest --compare "$dir/pristine" "$dir/patched" "${include[@]}" \
    --scenario ranks --timeout 500 --work /tmp/selftest-work --json-out "$out/ranks.json"
  echo "selftest exit code: $?"
  tar -cf "$out/ranks-work.tar" -C /tmp selftest-work 2>/dev/null
}

case "${1:-}" in
  prepare) prepare "${2:?DIR}" "${3:-}" ;;
  run) run "${2:?DIR}" "${3:?OUT}" ;;
  followup) followup "${2:?DIR}" "${3:?OUT}" ;;
  transactions) transactions "${2:?DIR}" "${3:?OUT}" "${4:-}" ;;
  lane) lane "${2:?DIR}" "${3:?OUT}" ;;
  wake) wake "${2:?DIR}" "${3:?OUT}" "${4:-}" ;;
  ranks) ranks "${2:?DIR}" "${3:?OUT}" ;;
  *) echo "usage: $0 prepare DIR [VERSION] | run DIR OUT | followup DIR OUT | transactions DIR OUT [SCENARIOS] | lane DIR OUT | wake DIR OUT [GIB] | ranks DIR OUT" >&2; exit 2 ;;
esac
