#!/usr/bin/env bash
# A short device call (about 7 minutes, cold machine; carry .device/env.sh .device/tl .device/peers .commit): the
# V4 GPU tests the first call of 2026-12-06's 27th session did not finish (model ops, with the renamed reader fixed;
# slots) beside the scheduled program's combine as a dependent launch (scripts/pdl_check.py: its GPU tests with
# SCHED_PDL on, then Flash at 1-4096 tokens timed off and on).
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
(timeout "${T_TESTS:-360}" python3 -m pytest -m gpu -v -n 6 -p no:cacheprovider -o faulthandler_timeout=240 \
   tests/dsv4/test_gpu_dsv4_model_ops.py tests/dsv4/test_gpu_dsv4_slots.py > "$out/rest_tests.txt" 2>&1) &
(timeout "${T_PDL:-420}" python3 scripts/pdl_check.py --out "$out" ${PDL_ARGS:-} > "$out/pdl.txt" 2>&1) &
wait
stamp "done"
grep -E "FAILED|Error|passed|failed" "$out/rest_tests.txt" | tail -12 | cut -c1-300
grep -E "rc|'op'|Error|passed|failed" "$out/pdl.txt" | tail -12 | cut -c1-300
