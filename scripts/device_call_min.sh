#!/usr/bin/env bash
# The smallest useful V4 attention call (about 3 minutes on a cold machine): the paired program's GPU tests, then
# the quick Flash bench of the scheduled and paired programs beside FlashMLA. Carry .device/env.sh .device/tl
# .device/peers. Logs and results under $OUT.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
JOBS=6 timeout "${T_TESTS:-110}" scripts/device_v4_attention.sh tests "paired" > "$out/tests.txt" 2>&1
echo "[$((SECONDS - t0)) s] tests rc=$?"; tail -15 "$out/tests.txt" | cut -c1-250
timeout "${T_ATTN:-60}" python3 benchmarks/bench_dsv4_attention.py --quick --configs flash --programs scheduled,paired \
  --no-portable --ops decode,prefill --out "$out" > "$out/bench_attn.txt" 2>&1
echo "[$((SECONDS - t0)) s] bench rc=$?"; grep -vE "^precompile|^ *$" "$out/bench_attn.txt" | tail -6 | cut -c1-250
ls "$out"
