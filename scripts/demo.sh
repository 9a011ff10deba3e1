#!/usr/bin/env bash
# make demo's steps after set-up, each timed, then where the time went. Stops at the first failing step (its
# exit code is the script's) and still prints the times measured so far.
#
#   scripts/demo.sh            # VENV=.venv by default
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
names=() secs=()
report() {
  local total=0
  echo
  echo "demo: where the time went (after set-up)"
  for i in "${!names[@]}"; do
    printf '  %-44s %7.1f s\n' "${names[$i]}" "${secs[$i]}"
    total=$(awk -v a="$total" -v b="${secs[$i]}" 'BEGIN { print a + b }')
  done
  printf '  %-44s %7.1f s\n' "total" "$total"
}
step() {
  local name=$1; shift
  local t0 t1 rc
  t0=$(date +%s.%N)
  "$@"
  rc=$?
  t1=$(date +%s.%N)
  names+=("$name")
  secs+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')")
  if [ "$rc" -ne 0 ]; then
    report
    echo "demo: '$name' failed (exit $rc)" >&2
    exit "$rc"
  fi
}
step "musa-attn doctor" "$venv/bin/musa-attn" doctor
step "musa-attn demo (kernels against references)" "$venv/bin/musa-attn" demo
step "SGLang serving a tiny Llama (two backends)" "$venv/bin/python" integration_tests/serve_demo.py
step "SGLang serving a tiny DeepSeek-V4" "$venv/bin/python" integration_tests/serve_demo_v4.py
report
