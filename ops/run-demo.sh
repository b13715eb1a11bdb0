#!/usr/bin/env bash
# The main job on the embedded defaults: install, then `rolloutbus demo` (starts the
# broker, the replica and the workers, publishes the bundled arithmetic rows, prints the
# trajectories the trainer client received, writes out/trajectories.arrow, stops all).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh
. .venv/bin/activate
exec rolloutbus demo "$@"
