#!/usr/bin/env bash
# Build the vLLM contract-test environment: vLLM's pydantic protocol modules, importable
# without vLLM's 9.4 GB CUDA install, and without touching the project's own venv.
#
# How: `pip install --no-deps --target` puts vllm==0.33.0 and the 15 small packages its
# protocol modules import (found by importing until nothing was missing) into one folder,
# .cache/contract/site (git-ignored). The contract check then runs with the project's venv
# Python and PYTHONPATH=that folder: torch, transformers, pydantic, numpy come from the
# project's venv (vLLM pins torch==2.14.0, but the protocol modules import and validate
# fine with the venv's 2.13; nothing here runs a kernel). Nothing is installed into the
# project's venv.
#
# Idempotent: a stamp file records what was installed; a second run with the same pins
# returns at once. Measured on the 2-core dev machine: about 25 s from an empty pip cache
# (the vLLM wheel is 336 MB), ~0.8 GB on disk.
#
# Usage: ops/contract/setup_vllm_env.sh            (prints the PYTHONPATH folder)
#        FORCE=1 ops/contract/setup_vllm_env.sh    (rebuild from scratch)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TARGET="${CONTRACT_SITE:-$ROOT/.cache/contract/site}"
STAMP="$TARGET/.rolloutbus-contract-stamp"

# vLLM itself, then exactly what `import vllm.entrypoints.openai.completion.protocol` and
# `vllm.entrypoints.scale_out.token_in_token_out.protocol` need beyond the project's venv.
PINS=(
  vllm==0.33.0
  cbor2==6.3.0 pyzmq==27.3.0 oss-harmony==0.0.11 openai==3.57.0 httpx2==2.16.2
  sniffio==1.3.1 fastapi==0.136.3 starlette==1.10.0 pillow==13.0.0 pybase64==1.5.1
  cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0
)
WANT="$(printf '%s\n' "${PINS[@]}")"

# shellcheck source=ops/lib/stamp.sh
. "$ROOT/ops/lib/stamp.sh"
if stamp_matches "$STAMP" "$WANT"; then
  echo "$TARGET"
  exit 0
fi

start=$(date +%s)
rm -rf "$TARGET"
mkdir -p "$TARGET"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
  --target "$TARGET" "${PINS[@]}" >&2
# Prove it imports before stamping it as built.
(cd /tmp && PYTHONPATH="$TARGET" "$PYTHON" -c \
  "import vllm.entrypoints.openai.completion.protocol, vllm.entrypoints.scale_out.token_in_token_out.protocol") >&2
stamp_write "$STAMP" "$WANT"
echo "contract env built in $(( $(date +%s) - start )) s: $TARGET" >&2
echo "$TARGET"
