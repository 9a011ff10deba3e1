#!/usr/bin/env bash
# device call: the SGLang V4 GPU tests, then the V4 backend bench
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=/tmp/musa_attn_cache
mkdir -p $OUT
timeout ${T1:-330} scripts/device_check.sh sglang -k "dsv4" > $OUT/tests.txt 2>&1
tail -45 $OUT/tests.txt
cp $OUT/gpu_tests.log $OUT/gpu_tests_full.log 2>/dev/null
export PYTHONPATH=$PWD:/tmp/musa_attn_ep:${PYTHONPATH:-}
timeout ${T2:-240} python3 benchmarks/bench_sglang_dsv4.py --out $OUT ${BENCH_ARGS:-} > $OUT/bench.txt 2>&1
grep -E "sglang_dsv4|results in|Error" $OUT/bench.txt | tail -45
