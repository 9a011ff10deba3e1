#!/usr/bin/env bash
# The paired program's first working run and the scheduled combine's walk bound (about 6 minutes, cold machine):
# one paired launch as a gate (a hang costs its timeout, not the call); then the V4 GPU tests of the paired and
# scheduled programs, the per-kernel profile and the quick Flash bench, paired left out where the gate failed.
# Carry .device/env.sh .device/tl .device/peers. Logs and results under $OUT.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
progs=scheduled,paired; sel="paired or scheduled"
# the gate, beside the scheduled program's compiles for the tests
(timeout 100 python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); import bench_dsv4_attention as b
b.precompile(['flash'], False, '', workers=4, programs=['scheduled'])" > "$out/compile.txt" 2>&1) &
if timeout "${T_GATE:-110}" python3 scripts/probe_program.py paired 1 64 128 > "$out/gate.txt" 2>&1; then
  stamp "gate passed"; cat "$out/gate.txt" | grep finished
else
  stamp "gate FAILED rc=$?"; tail -5 "$out/gate.txt"; progs=scheduled; sel="scheduled"
fi
wait
JOBS=6 timeout "${T_TESTS:-150}" scripts/device_v4_attention.sh tests "$sel" > "$out/tests.txt" 2>&1
stamp "tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/tests.txt" | tail -12 | cut -c1-250
PROFILE_PROGRAMS=$progs timeout "${T_PROF:-60}" python3 scripts/profile_dsv4_attention.py --out "$out" \
  --cases flash:1:1,flash:2:2,flash:64:1,flash:4096:1 > "$out/profile.txt" 2>&1
stamp "profile rc=$?"; grep -E "^ +(flash|pro)" "$out/profile.txt" | cut -c1-330
timeout "${T_ATTN:-120}" python3 benchmarks/bench_dsv4_attention.py --quick --configs flash --programs $progs \
  --no-portable --ops decode,prefill --out "$out" > "$out/bench_attn.txt" 2>&1
stamp "bench rc=$?"; grep -vE "^precompile|^ *$|TileLang" "$out/bench_attn.txt" | tail -8 | cut -c1-250
