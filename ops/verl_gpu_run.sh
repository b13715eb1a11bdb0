#!/usr/bin/env bash
# Two GRPO steps of verl 0.9.1's own trainer (main_ppo, V0) rolling out through the bus, on
# one GPU: the run examples/verl/README.md describes, as one command. Not part of CI (CI has
# no GPU), and not yet run: see "Not supported yet" in docs/verl-trainer.md.
#
# Needs, in the active Python: verl 0.9.1 with its GPU stack (vLLM, CUDA torch, Ray) and this
# repository (pip install -e .); Java 17 and Maven for the embedded broker; a local Hugging
# Face model folder (verl's actor trains it, the bus's replica serves it).
#
# Usage: ops/verl_gpu_run.sh [MODEL_DIR]      (default: models/SmolLM2-135M-Instruct)
# Exit codes: 0 the two steps ran; 1 a step or a service failed (logs named on stderr);
# 2 something this script needs is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-models/SmolLM2-135M-Instruct}
CFG=$PWD/examples/verl/bus/grpo_v0.yaml
LOGS=$(mktemp -d -t rolloutbus-verl-gpu.XXXXXX)
BUS=(-c "$CFG" "actor_rollout_ref.model.path=$MODEL")
say() { echo "verl-gpu: $*" >&2; }

[ -d "$MODEL" ] || { say "no model folder at $MODEL (examples/verl/README.md says how to get one)"; exit 2; }
python - <<'EOF' || exit 2
import importlib.util, sys
missing = [m for m in ("verl", "vllm", "ray", "rolloutbus") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"verl-gpu: not installed in this Python: {', '.join(missing)}")
import torch
if not torch.cuda.is_available():
    sys.exit("verl-gpu: torch sees no CUDA GPU")
EOF

PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rolloutbus broker stop "${BUS[@]}" >/dev/null 2>&1 || true
}
trap stop_all EXIT
start() {  # start NAME ARGS...: a bus service in the background, its log in $LOGS/NAME.log
  local name=$1; shift
  rolloutbus "$@" "${BUS[@]}" >"$LOGS/$name.log" 2>&1 &
  PIDS+=($!)
  say "started $name (log: $LOGS/$name.log)"
}
wait_for() {  # wait_for URL WHAT: until URL answers, at most 10 minutes (a first model load)
  for _ in $(seq 600); do
    curl -sf -o /dev/null "$1" && return 0
    sleep 1
  done
  say "$2 did not answer at $1 within 10 minutes"; exit 1
}

mkdir -p data
[ -f data/train.jsonl ] || rolloutbus dataset data/train.jsonl --count 256 --tool-fraction 0
[ -f data/val.jsonl ] || rolloutbus dataset data/val.jsonl --count 32 --seed 1 --tool-fraction 0
rolloutbus broker start "${BUS[@]}"
rolloutbus topics "${BUS[@]}"
REPLICA=$(rolloutbus config "${BUS[@]}" 2>/dev/null \
  | python -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["replicas"]["urls"][0])')
start replica replica serve
wait_for "$REPLICA/health" "the replica"
start sessions sessions run
start replay-buffer replay-buffer run

say "verl's main_ppo, two steps (log: $LOGS/main_ppo.log)"
if ! python -m verl.trainer.main_ppo --config-dir examples/verl +bus=grpo_v0 \
    "actor_rollout_ref.model.path=$MODEL" trainer.total_training_steps=2 \
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=rolloutbus.verl.BusAgentLoopManagerV0 \
    "+rolloutbus.config=$CFG" >"$LOGS/main_ppo.log" 2>&1; then
  say "main_ppo failed: tail of $LOGS/main_ppo.log:"; tail -n 40 "$LOGS/main_ppo.log" >&2; exit 1
fi
grep -q "step:2" "$LOGS/main_ppo.log" || { say "main_ppo exited 0 without logging step 2"; exit 1; }
say "two steps trained from the bus; logs in $LOGS"
