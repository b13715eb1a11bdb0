#!/usr/bin/env bash
# Build the verl parity environment: the real verl==0.9.1 package, importable on CPU for
# the parity tests (tests/verl_compat/test_verl_parity.py, marker `verl`), without verl's GPU stack
# and without touching the project's own venv.
#
# How: `pip install --no-deps --target` puts verl==0.9.1 and the small packages that the
# modules the parity tests use import (found by importing until nothing was missing) into
# one folder, .cache/contract/verl (git-ignored). The tests run verl in a subprocess with
# the project's venv Python and PYTHONPATH=that folder: torch, transformers, numpy,
# pydantic, pyarrow, aiohttp, huggingface_hub come from the project's venv. Nothing is
# installed into the project's venv.
#
# Why these pins and not verl's own requirements: verl 0.9.1 declares transformers<5.11
# and the whole training stack (ray[default], wandb, peft, accelerate, vLLM, ...). The
# modules used here (verl.utils.reward_score, verl.experimental.agent_loop.*,
# verl.workers.config and verl/trainer/config/*.yaml) import and run with the venv's
# transformers 5.17; ray is needed only because `import verl` imports verl.protocol,
# which imports ray. Versions chosen where the newest release does not fit:
#   tensordict==0.10.0   verl pins <=0.10.0
#   omegaconf==2.3.0     hydra-core 1.3 needs omegaconf<2.4
#   antlr4-python3-runtime==4.9.3   hydra-core 1.3's grammar is generated for 4.9
#   datasets==5.0.0      5.1+ imports huggingface_hub.utils.httpx, gone from the venv's hub
#   fastapi==0.136.3, starlette==1.10.0   as in the vLLM contract env; newer fastapi
#                        imports opentelemetry
# The V1 trainer's control plane (tests/verl_compat/test_verl_trainer_tq.py) also needs
# transferqueue 0.1.11 (verl's verl-core extra: >=0.1.10; it runs as Ray actors, on CPU
# too) with pyzmq and msgspec, torchdata (verl declares it unpinned; 0.11.0 is the newest)
# and peft (verl.utils.fsdp_utils imports it at module level; newest, 0.21.2).
# math-verify is NOT installed: verl 0.9.1's default_compute_score does not call it (its
# MATH branch uses math_reward; math_verify is a commented-out option), and its
# latex2sympy2 dependency needs antlr4 4.13, which conflicts with hydra's 4.9.
#
# Idempotent: a stamp file records what was installed; a second run with the same pins
# returns at once. Measured on the 2-core dev machine: ~40 s from an empty pip cache
# (the ray wheel is 79 MB), ~300 MB on disk; `import verl` then takes ~13 s of CPU.
#
# Usage: ops/contract/setup_verl_env.sh            (prints the PYTHONPATH folder)
#        FORCE=1 ops/contract/setup_verl_env.sh    (rebuild from scratch)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TARGET="${VERL_SITE:-$ROOT/.cache/contract/verl}"
STAMP="$TARGET/.rolloutbus-verl-stamp"

# verl itself, then exactly what the modules named in the import check below need beyond
# the project's venv.
PINS=(
  verl==0.9.1
  ray==2.60.0 msgpack==1.2.4 protobuf==7.36.2 jsonschema==4.26.0 referencing==0.37.0
  jsonschema-specifications==2025.9.1 rpds-py==2026.9.1 tensordict==0.10.0 pyvers==0.2.3
  cloudpickle==3.1.3 omegaconf==2.3.0 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3
  codetiming==1.4.0 orjson==3.13.0 pillow==13.0.0 datasets==5.0.0 multiprocess==0.70.19
  dill==0.4.1 pandas==3.1.1 xxhash==4.1.0 cachetools==8.0.2 uvicorn==0.54.0
  fastapi==0.136.3 starlette==1.10.0 pylatexenc==2.10 mathruler==0.1.0
  transferqueue==0.1.11 pyzmq==27.3.0 msgspec==0.23.0 torchdata==0.11.0 peft==0.21.2
)
WANT="$(printf '%s\n' "${PINS[@]}")"
# The modules the parity tests import; each must import before the env is stamped.
MODULES="verl.utils.reward_score, verl.utils.reward_score.prime_math, verl.utils.reward_score.geo3k, verl.experimental.agent_loop.tool_parser, verl.experimental.agent_loop.single_turn_agent_loop, verl.experimental.agent_loop.tool_agent_loop, verl.workers.config, transfer_queue, torchdata.stateful_dataloader, verl.trainer.ppo.v1.trainer_base, verl.trainer.ppo.v1.replay_buffer"

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
# Prove it imports before stamping it as built (from /tmp, so the checkout's own
# folders cannot shadow anything). verl warns on import of every engine it cannot load
# (torchtitan, megatron, ...; ray of accelerators): shown only if the import fails.
if ! said=$(cd /tmp && PYTHONPATH="$TARGET" "$PYTHON" -c "import $MODULES" 2>&1); then
  echo "$said" >&2
  echo "verl env: the import check above failed; nothing stamped as built" >&2
  exit 1
fi
stamp_write "$STAMP" "$WANT"
echo "verl env built in $(( $(date +%s) - start )) s: $TARGET" >&2
echo "$TARGET"
