#!/usr/bin/env bash
# device call (with .device/tl carried): the MoE GPU tests, then the contiguous program's tilings on the prefill
# shapes (bench_moe --tiling), each run's JSON and PNG under $OUT. Usage:
#   source .device/env.sh && scripts/device_moe.sh ["tiling;tiling;..."]   (default: the three below)
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}
mkdir -p "$out"
timeout "${T1:-300}" python3 -m pytest -q -m gpu tests/moe --tb=line -p no:cacheprovider > "$out/moe_tests.txt" 2>&1
echo "moe tests rc=$?"; grep -E "passed|failed|^E |Error" "$out/moe_tests.txt" | tail -15
IFS=';' read -r -a tilings <<< "${1:-policy=Square;policy=FullRow;policy=FullRow,num_stages=3}"
for t in "${tilings[@]}"; do
  timeout "${T2:-150}" python3 benchmarks/bench_moe.py --models flash --tokens 4096,16384 --tiling "$t" \
    --out "$out" > "$out/bench_${t//[=,]/_}.txt" 2>&1
  echo "tiling $t: rc=$?"; grep -E "^moe_" "$out/bench_${t//[=,]/_}.txt" | cut -c1-110
done
