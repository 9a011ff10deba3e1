#!/usr/bin/env bash
# A cold-machine device call (about 9 minutes; carry .device/env.sh .device/tl .device/peers .commit), the 28th
# session's first: the paired program's GPU tests at its register split 200/104 beside the dense attention GPU
# tests after their programs took one shared signature (tl_common.paged_program); then the V4 decode bench's
# eager rows (entry_eager_ms: flash_mla_with_kvcache with the planned fast path, FlashMLA's eager call beside).
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
(JOBS=4 timeout "${T_PAIRED:-240}" scripts/device_v4_attention.sh tests paired > "$out/paired_tests.txt" 2>&1) &
if [ "${DENSE:-1}" = 1 ]; then
  (OUT=$out/dense JOBS=8 timeout "${T_DENSE:-300}" scripts/device_check.sh attention > "$out/dense_tests.txt" 2>&1) &
fi
wait
stamp "tests done"
grep -E "FAILED|Error|passed" "$out/paired_tests.txt" | tail -12 | cut -c1-300
[ -f "$out/dense_tests.txt" ] && grep -E "FAILED|Error|passed" "$out/dense_tests.txt" | tail -12 | cut -c1-300
# alone on the GPU (timings)
timeout "${T_BENCH:-150}" python3 benchmarks/bench_dsv4_attention.py --quick --configs ${BENCH_CONFIGS:-flash,pro} \
  --programs scheduled --no-portable --ops decode --out "$out" > "$out/bench_attn.txt" 2>&1
stamp "bench rc=$?"; grep -vE "^precompile|^ *$|TileLang" "$out/bench_attn.txt" | tail -12 | cut -c1-300
