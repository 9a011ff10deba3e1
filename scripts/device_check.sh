#!/usr/bin/env bash
# On the lent GPU machine (after `source .device/env.sh`): GPU tests, then a benchmark. Logs go to $OUT.
#   scripts/device_check.sh [tests|bench|quick-bench|all] [pytest args...]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache}
what=${1:-all}; shift || true
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__, torch.cuda.get_device_name())"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -m gpu tests -q -n "${JOBS:-12}" -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_attention.py --out "$out" 2>&1 | tee "$out/bench.log" | tail -60
fi
if [ "$what" = quick-bench ]; then
  python3 benchmarks/bench_attention.py --quick --out "$out" 2>&1 | tee "$out/bench.log" | tail -40
fi
