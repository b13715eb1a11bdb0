# shellcheck shell=bash
# A disk check before a large build (ops/install.sh's .venv, ops/vllm/setup_vllm_cpu.sh's
# venv), sourced, not run: say how much is needed and free before pip fails halfway with
# "No space left on device". ROLLOUTBUS_NEED_FREE_GIB overrides every figure (tests).
#
#   . "$ROOT/ops/lib/disk.sh"
#   need_free_gib "$DIR" 7 "install: a fresh .venv" || exit 2

# need_free_gib DIR GIB WHAT: true when the disk holding DIR (or its nearest existing
# parent) has GIB GiB free; else says so on stderr, naming WHAT, and returns 1.
need_free_gib() {
  local dir=$1 need=${ROLLOUTBUS_NEED_FREE_GIB:-$2} what=$3 free
  while [[ ! -d "$dir" ]]; do dir=$(dirname "$dir"); done
  free=$(df -Pk "$dir" | awk 'NR == 2 { print int($4 / 1048576) }')
  if [[ "$free" -lt "$need" ]]; then
    echo "$what needs about $need GiB free on the disk of $dir; it has $free GiB" >&2
    return 1
  fi
}
