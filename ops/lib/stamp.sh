# shellcheck shell=bash
# Build stamps for the side environments (ops/contract/setup_vllm_env.sh,
# ops/contract/setup_verl_env.sh, ops/vllm/setup_vllm_cpu.sh), sourced, not run.
#
# A stamp file inside a built environment holds exactly what it was built from (its pins
# and recipe, one per line). A script rebuilds only when the stamp is missing or differs,
# so a second run with the same pins returns at once, and a changed pin rebuilds. The stamp
# is written last, after the import check: an interrupted or broken build leaves no stamp
# and the next run starts over. FORCE=1 rebuilds whatever the stamp says.
#
#   . "$ROOT/ops/lib/stamp.sh"
#   if stamp_matches "$STAMP" "$WANT"; then echo "$TARGET"; exit 0; fi
#   ... build, check it imports ...
#   stamp_write "$STAMP" "$WANT"

# stamp_matches STAMP WANT: true when FORCE is not 1 and the file STAMP holds WANT.
stamp_matches() {
  [[ "${FORCE:-0}" != 1 && -f "$1" && "$(cat "$1")" == "$2" ]]
}

# stamp_write STAMP WANT: record WANT as what the environment at STAMP was built from.
stamp_write() {
  printf '%s' "$2" >"$1"
}
