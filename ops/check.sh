#!/usr/bin/env bash
# The quality gate: formatting, lint, types. Needs no broker; run `bash ops/install.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi

PATHS=(schemas streams producers consumers replica rolloutbus tests benchmarks ops examples)

ruff format --check "${PATHS[@]}"
ruff check "${PATHS[@]}"

# `rolloutbus` spans six folders ([tool.setuptools.package-dir] in pyproject.toml); the
# editable install maps them with an import hook that mypy does not run. So mypy finds the
# whole package through this link tree (mypy_path in [tool.mypy]): every module and
# subpackage of rolloutbus/ and the five mapped folders, rebuilt each run so a moved module
# leaves no stale link. The sed turns the tree's paths in mypy's report back into the real
# files'. Strictness per folder is set in pyproject.toml ([[tool.mypy.overrides]]).
LINKS=.cache/mypy/path/rolloutbus
rm -rf "$LINKS"
mkdir -p "$LINKS"
for module in rolloutbus/*.py; do
  ln -sfn "../../../../$module" "$LINKS/$(basename "$module")"
done
for init in rolloutbus/*/__init__.py; do
  folder=$(dirname "$init")
  ln -sfn "../../../../$folder" "$LINKS/$(basename "$folder")"
done
for folder in schemas streams producers consumers replica; do
  ln -sfn "../../../../$folder" "$LINKS/$folder"
done
mypy -p rolloutbus | sed -e 's#^\.cache/mypy/path/rolloutbus/##'
