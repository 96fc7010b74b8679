#!/usr/bin/env bash
# On a GPU machine without network: unpack the payload and the trees that scripts/gpu-payload
# built (docs/gpu-machine.md), then run vLLM's own allocator tests of each lane against
# pristine and patched vLLM (scripts/upstream-tests), each test in its own process.
#
#   scripts/gpu-upstream.sh PAYLOAD_DIR TREES_DIR OUT [LANE[/SIDE]...]
#
# LANE: 0.21.0 or 0.33.0 (default: both); LANE/SIDE runs one side (pristine or patched) and
# compares it with the other side's results from an earlier run on the same machine, kept in
# $SM12X_GPU_HOME (for a call that cannot hold both sides in its time limit).
#
# PAYLOAD_DIR and TREES_DIR are the folders 'gpu-payload build' and 'gpu-payload trees' wrote
# (parts and manifest.json). They are unpacked into $SM12X_GPU_HOME (default /tmp/sm12x-gpu):
# site/ (vLLM 0.21.0's slimmed wheel and its dependencies) and trees/ (each lane's pristine and
# patched trees); an earlier unpack there is reused.
#   0.21.0: pristine is the wheel as unpacked (installed:site); patched is a copy of its vllm/
#           with the files the lane's series changes taken from trees/0.21.0/patched and the
#           cumem extension rebuilt from that tree (native.py): installed:site-0.21.0-patched.
#   0.33.0: its wheel needs torch 2.14, so its source trees run (tree:trees/0.33.0/...), each
#           with the extension built from it alone, site/ giving the dependencies.
# OUT receives env.txt, upstream-<lane>[-<side>].json and gpu-upstream.log (everything printed).
# Set PYTHON_INCLUDE to a folder holding Python.h where this Python has none.
set -uo pipefail
cd "$(dirname "$0")/.."

payload=$1 trees=$2 out=$3
shift 3
if [ $# -gt 0 ]; then lanes=("$@"); else lanes=(0.21.0 0.33.0); fi
home=${SM12X_GPU_HOME:-/tmp/sm12x-gpu}
mkdir -p "$out" "$home"
exec > >(tee "$out/gpu-upstream.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
include=()
[ -n "${PYTHON_INCLUDE:-}" ] && include=(--python-include "$PYTHON_INCLUDE")

unpacked() {  # unpacked PARTS DEST: unpack unless DEST holds an unpack of the same archive
  local sha
  sha=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["archive"]["sha256"])' "$1/manifest.json") || return 1
  if [ "$(cat "$2/.archive-sha256" 2>/dev/null)" = "$sha" ]; then echo "== $2: already unpacked ($sha)"; return 0; fi
  python3 scripts/gpu-payload -q unpack "$1" "$2" && echo "$sha" > "$2/.archive-sha256"
}

patched_site_0_21_0() {  # the wheel's vllm/ with the lane's changed files and a rebuilt extension
  local site=$home/site dest=$home/site-0.21.0-patched tree=$home/trees/0.21.0/patched
  rm -rf "$dest" && mkdir -p "$dest" && cp -a "$site/vllm" "$site"/vllm-0.21.0.dist-info "$dest/" || return 1
  python3 - "$trees/manifest.json" "$tree" "$dest" <<'EOF' || return 1
import json, shutil, sys
from pathlib import Path
manifest, tree, dest = json.load(open(sys.argv[1])), Path(sys.argv[2]), Path(sys.argv[3])
changed = next(t["changed"] for t in manifest["trees"] if t["lane"] == "0.21.0")
for rel in (c for c in changed if c.startswith("vllm/")):
    target = dest / rel
    if (tree / rel).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, target)
    else:
        target.unlink(missing_ok=True)
    print("patched", rel)
EOF
  python3 - "$tree" "$dest" ${PYTHON_INCLUDE:+"$PYTHON_INCLUDE"} <<'EOF'
import sys
from pathlib import Path
from sm12x_bundle import native
from sm12x_bundle.errors import BundleError
try:
    native.build_cumem_extension(Path(sys.argv[1]), Path(sys.argv[2]) / "vllm",
                                 python_include=Path(sys.argv[3]) if len(sys.argv) > 3 else None)
except BundleError as exc:
    sys.exit(f"gpu-upstream: the cumem extension of {sys.argv[1]} could not be built: {exc}")
EOF
}

echo "== environment"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$out/env.txt"

echo "== unpack"
unpacked "$payload" "$home/site" && unpacked "$trees" "$home/trees" || exit 12
timeout 60 python3 scripts/gpu-payload check "$home/site" || echo "(requirements above are unmet: see docs/gpu-machine.md)"

targets_of() {  # targets_of LANE SIDE...: the upstream-tests arguments of each side
  local lane=$1 side
  shift
  for side in "$@"; do
    if [ "$lane" = 0.21.0 ] && [ "$side" = pristine ]; then echo "--pristine installed:$home/site"
    elif [ "$lane" = 0.21.0 ]; then echo "--patched installed:$home/site-0.21.0-patched"
    else echo "--$side tree:$home/trees/$lane/$side"; fi
  done
}

status=0
for spec in "${lanes[@]}"; do
  lane=${spec%%/*} sides=(pristine patched) name=$lane
  if [ "$spec" != "$lane" ]; then sides=("${spec#*/}"); name=$lane-${spec#*/}; fi
  echo "== vLLM $spec: upstream allocator tests"
  if [ "$lane" = 0.21.0 ] && [[ " ${sides[*]} " == *" patched "* ]]; then
    patched_site_0_21_0 || { status=7; continue; }
  fi
  earlier=()
  if [ ${#sides[@]} -eq 1 ]; then
    other=$([ "${sides[0]}" = pristine ] && echo patched || echo pristine)
    [ -f "$home/upstream-$lane-$other.json" ] && earlier=(--results-from "$home/upstream-$lane-$other.json")
  fi
  # shellcheck disable=SC2046 # one option and its value per line
  timeout 540 python3 scripts/upstream-tests --lane "$lane" $(targets_of "$lane" "${sides[@]}") \
    --python-path "$home/site" --tests-from "$home/trees/$lane/pristine" --work "$home/work-$name" \
    --json "$out/upstream-$name.json" --timeout 240 "${earlier[@]}" "${include[@]}"
  rc=$?
  cp "$out/upstream-$name.json" "$home/" 2>/dev/null
  echo "== vLLM $spec: exit $rc"
  [ $rc -gt $status ] && status=$rc
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
exit $status
