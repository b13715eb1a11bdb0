#!/usr/bin/env bash
# Install, then run the whole test suite. The tests start their own Kafka broker
# (once per session, on free ports) unless ROLLOUTBUS_TEST_BOOTSTRAP names one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh
. .venv/bin/activate
if [ -f ops/contract/setup_vllm_env.sh ]; then
  bash ops/contract/setup_vllm_env.sh
fi
bash ops/check.sh   # the quality gate: ruff format --check, ruff check, mypy
exec python -m pytest -p no:cacheprovider -ra "$@"
