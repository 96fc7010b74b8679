#!/usr/bin/env bash
# On a GPU machine without network: unpack the payload and the trees that scripts/gpu-payload
# built (docs/gpu-machine.md), then run `sm12x-bundle engine-check --compare` on vLLM 0.21.0's
# wheel with any further engine-check options.
#
#   scripts/gpu-engine.sh PAYLOAD_DIR TREES_DIR OUT [ENGINE-CHECK OPTIONS...]
#
# The lanes' sources are the unpacked pristine trees (a configuration written into
# $SM12X_GPU_HOME names them as each lane's `source`), because the machine cannot fetch the
# pinned sdists: --compare builds the patched copy's cumem extension from the lane's tree.
# OUT receives env.txt, engine.json, gpu-engine.log and logs.tgz (every engine's and server's log).
set -uo pipefail
cd "$(dirname "$0")/.."

payload=$1 trees=$2 out=$3
shift 3
home=${SM12X_GPU_HOME:-/tmp/sm12x-gpu}
mkdir -p "$out" "$home"
exec > >(tee "$out/gpu-engine.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src

unpacked() {  # unpacked PARTS DEST: unpack unless DEST holds an unpack of the same archive
  local sha
  sha=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["archive"]["sha256"])' "$1/manifest.json") || return 1
  if [ "$(cat "$2/.archive-sha256" 2>/dev/null)" = "$sha" ]; then echo "== $2: already unpacked"; return 0; fi
  python3 scripts/gpu-payload -q unpack "$1" "$2" && echo "$sha" > "$2/.archive-sha256"
}

{ date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  nproc; free -g | head -2
} | tee "$out/env.txt"

unpacked "$payload" "$home/site" && unpacked "$trees" "$home/trees" || exit 12
cat > "$home/lanes.yaml" <<EOF
# The lanes with their pristine trees as local sources (the machine has no network).
lanes:
  - version: "0.21.0"
    source: $home/trees/0.21.0/pristine
  - version: "0.33.0"
    source: $home/trees/0.33.0/pristine
EOF

# Where this Python has no Python.h, PYTHON_INCLUDE names a folder that holds one.
[ -n "${PYTHON_INCLUDE:-}" ] && export SM12X_PYTHON_INCLUDE=$PYTHON_INCLUDE
timeout "${ENGINE_TIMEOUT:-570}" python3 -m sm12x_bundle engine-check --config "$home/lanes.yaml" --compare \
  --vllm-path "$home/site" --work "$home/engine-work" --json-out "$out/engine.json" "$@"
rc=$?
echo "== engine-check exit $rc"
tar czf "$out/logs.tgz" -C "$home/engine-work" logs 2>/dev/null
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
nvidia-smi --query-gpu=memory.used --format=csv
exit $rc
