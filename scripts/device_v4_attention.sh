#!/usr/bin/env bash
# On the lent H200 (after `source .device/env.sh`), issue 37's GPU runs; logs and results under $OUT.
#   scripts/device_v4_attention.sh tests     the V4 sparse attention GPU tests, every program (the scheduled one
#                                            first), each test under a 240 s limit (a hang is a failure, not a stall)
#   scripts/device_v4_attention.sh suite decode|prefill [--sample N | --all] [--program P]
#                                            FlashMLA's own tests against our entry points (carry .flashmla:
#                                            `scripts/flashmla_suite.py fetch` stages it on the CPU machine)
#   scripts/device_v4_attention.sh bench [args]
#                                            benchmarks/bench_dsv4_attention.py, FlashMLA beside us (carry
#                                            .device/peers), the scheduled program timed on every row
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache}
case "${1:-}" in
  tests)
    shift
    python3 -m pytest -m gpu -v -n "${JOBS:-8}" -p no:cacheprovider -rs -o faulthandler_timeout=240 \
      tests/dsv4/test_gpu_dsv4.py -k "${1:-scheduled or inf or plan}" 2>&1 | tee "$out/v4_tests.log" \
      | grep -v " PASSED " | tail -40
    echo "passed: $(grep -c ' PASSED ' "$out/v4_tests.log")" ;;
  suite)
    kind=${2:-decode}; shift 2
    python3 scripts/flashmla_suite.py run "$kind" --out "$out/flashmla_$kind.json" "$@" 2>&1 \
      | tee "$out/flashmla_$kind.log" | tail -30 ;;
  bench)
    shift
    python3 benchmarks/bench_dsv4_attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -60 ;;
  *) echo "usage: scripts/device_v4_attention.sh tests [-k expr]|suite decode|prefill [args]|bench [args]"; exit 2 ;;
esac
