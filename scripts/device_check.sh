#!/usr/bin/env bash
# On the lent GPU machine (after `source .device/env.sh`): GPU tests, then a benchmark. Logs go to $OUT.
#   scripts/device_check.sh <family> [pytest args...]   family: a folder of tests/ (attention, kv_cache, tuning,
#   metadata, dsv4, moe, sglang, vllm, tools, contract), kernels (all but the engines) or engines (sglang + vllm)
#   scripts/device_check.sh bench|quick-bench [bench args...]
set -uo pipefail
# the device site on PYTHONPATH even where the caller's environment did not reach this shell (2026-12-06: a run
# found no tilelang here while the caller's other process had it); idempotent and quiet
[ -f .device/env.sh ] && DEVICE_ENV_CHECK=0 source .device/env.sh >/dev/null
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache}
source "$(dirname "$0")/device_entry_points.sh"  # our entry points, for the engines' plugin loaders
what=${1:-help}; shift || true
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__, torch.cuda.get_device_name())"
# One test family per call: each family's GPU tests fit one 600 s device call. -v logs each test's outcome as it
# finishes, so a run cut off by the time limit still says which tests passed.
gpu_tests() {
  python3 -m pytest -m gpu "$@" -v -n "${JOBS:-12}" -p no:cacheprovider -rs 2>&1 | tee -a "$out/gpu_tests.log" \
    | grep -v " PASSED " | tail -40
  echo "passed so far: $(grep -c ' PASSED ' "$out/gpu_tests.log")"
}
case "$what" in
  attention|kv_cache|tuning|metadata|sglang|vllm|tools|dsv4|moe|contract)
    gpu_tests "tests/$what" "$@" ;;
  kernels)  # the families that need only .device/tl (the engine families need .device/fw too)
    gpu_tests tests/attention tests/kv_cache tests/tuning tests/tools tests/dsv4 tests/moe tests/contract "$@" ;;
  engines)
    gpu_tests tests/sglang tests/vllm "$@" ;;
  bench)
    python3 benchmarks/bench_attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -60 ;;
  quick-bench)
    python3 benchmarks/bench_attention.py --quick --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -40 ;;
  *)
    echo "usage: scripts/device_check.sh {attention|kv_cache|tuning|metadata|dsv4|moe|sglang|vllm|tools|kernels|engines|bench|quick-bench} [args]"
    exit 2 ;;
esac
