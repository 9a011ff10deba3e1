#!/usr/bin/env bash
# The clustered 128-head form's first GPU run (carry .device/env.sh .device/tl .device/peers .commit; about 6
# minutes cold): the gate (scripts/probe_program.py cluster, each case in its own process: a hang costs its timeout), then,
# if every case finished, its GPU tests (tests/dsv4/test_gpu_dsv4.py, "scheduled:cluster": the reference cases
# and FlashMLA's entry) and a Pro decode timing against the scheduled program. Logs under $OUT.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
timeout "${T_GATE:-200}" python3 scripts/probe_program.py cluster > "$out/gate.txt" 2>&1
cat "$out/gate.txt" | cut -c1-300
if grep -qE "HANG|rc [1-9]" "$out/gate.txt"; then echo "[$((SECONDS - t0)) s] gate failed: no tests"; exit 1; fi
JOBS=4 timeout "${T_TESTS:-170}" scripts/device_v4_attention.sh tests "cluster" > "$out/tests.txt" 2>&1
echo "[$((SECONDS - t0)) s] tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/tests.txt" | tail -8 | cut -c1-250
if grep -qE "FAILED|failed" "$out/tests.txt"; then echo "tests failed: no timing"; exit 1; fi
# Pro decode (s_q 1 and 2), the clustered form beside the scheduled program and FlashMLA
timeout "${T_BENCH:-220}" scripts/device_v4_attention.sh bench --quick --configs pro --ops decode,decode_mtp \
  --no-portable --programs scheduled,cluster > "$out/bench.txt" 2>&1
echo "[$((SECONDS - t0)) s] bench rc=$?"; tail -16 "$out/bench.txt" | cut -c1-300
