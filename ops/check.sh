#!/usr/bin/env bash
# The quality gate: formatting, lint, types. Needs no broker; run `bash ops/install.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi

PATHS=(schemas streams producers consumers rolloutbus tests benchmarks ops examples)

ruff format --check "${PATHS[@]}"
ruff check "${PATHS[@]}"

# `rolloutbus` spans five folders ([tool.setuptools.package-dir] in pyproject.toml); the
# editable install maps them with an import hook that mypy does not run. So mypy finds the
# package through this link tree (mypy_path in [tool.mypy]): the package's __init__ and the
# four mapped folders; the rest of `rolloutbus` is found in the repository root. The sed
# turns the tree's paths in mypy's report back into the real files'.
LINKS=.cache/mypy/path/rolloutbus
mkdir -p "$LINKS"
ln -sfn ../../../../rolloutbus/__init__.py "$LINKS/__init__.py"
for folder in schemas streams producers consumers; do
  ln -sfn "../../../../$folder" "$LINKS/$folder"
done
mypy -p rolloutbus.schemas -p rolloutbus.streams -p rolloutbus.producers -p rolloutbus.consumers \
  | sed -e 's#^\.cache/mypy/path/rolloutbus/##'
