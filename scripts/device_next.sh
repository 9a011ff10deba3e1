#!/usr/bin/env bash
# The next session's first device call (about 9 minutes, cold machine; carry .device/env.sh .device/tl
# .device/peers): every V4 GPU test after the kernels/dsv4 sub-package move (tests/dsv4, each test under a 240 s
# limit), then the paired program's register splits timed beside the scheduled one, then the attention bench (both
# configs, FlashMLA's decode and bf16 prefill and, on prefill rows, its FP8 decode kernel beside ours). Write
# .commit here first (`git rev-parse --short HEAD > .commit`) and carry it: the device's git metadata is stale.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
(JOBS=10 timeout "${T_TESTS:-300}" scripts/device_check.sh dsv4 -o faulthandler_timeout=240 > "$out/dsv4_tests.txt" 2>&1) &
(timeout "${T_PRE:-200}" python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); import bench_dsv4_attention as b
b.precompile(['flash', 'pro'], False, '', workers=4, programs=['scheduled'])" > "$out/precompile.txt" 2>&1) &
wait
stamp "tests"; tail -"${TAILN:-25}" "$out/dsv4_tests.txt" | cut -c1-250
timeout "${T_TUNE:-120}" python3 scripts/tune_paired_regs.py --out "$out" > "$out/tune_paired.txt" 2>&1
stamp "tune rc=$?"; grep -E "T=|compile" "$out/tune_paired.txt" | cut -c1-200
timeout "${T_ATTN:-150}" python3 benchmarks/bench_dsv4_attention.py --no-precompile --programs scheduled --no-portable \
  --ops decode,prefill --out "$out" > "$out/bench_attn.txt" 2>&1
stamp "bench rc=$?"; grep -vE "^precompile|^ *$|TileLang" "$out/bench_attn.txt" | tail -16 | cut -c1-250
