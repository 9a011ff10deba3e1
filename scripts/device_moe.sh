#!/usr/bin/env bash
# device call (with .device/tl carried): the MoE GPU tests and benchmarks, logs and results under $OUT (the device
# tool returns at most 8 files: one log per part, a JSON and a PNG per bench run). Usage:
#   source .device/env.sh && scripts/device_moe.sh [tests] [bench] [tilings]   (default: all three)
#   tests:   pytest -m gpu tests/moe in XDIST processes (default 8: a fresh machine compiles every kernel), then
#            the failures again in 2 processes: each Flash-shape test holds up to 60 GB of GPU memory, so some run
#            out of memory beside the others and pass in the second round (T1 seconds for both, default 420); one log
#   bench:   bench_moe.py on V4-Flash, every op and T, after compiling its kernels in 12 processes (T2 seconds,
#            default 300); SGLang's Triton peer runs where .device/fw was carried, in this call or an earlier one
#            on the same warm machine
#   tilings: the contiguous GEMM under TILINGS ("k=v,...;k=v,..."; default FullRow, FullRow with 3 stages, FullRow
#            in panels of 8) on the prefill shapes (T3 seconds each, default 120)
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench tilings)
for part in "${parts[@]}"; do
  case $part in
    tests)
      end=$((SECONDS + ${T1:-420}))
      timeout "${T1:-420}" python3 -m pytest -q -m gpu tests/moe -n "${XDIST:-8}" --tb=short -o cache_dir=/tmp/moe_cache \
        --durations=10 > "$out/moe_tests.txt" 2>&1
      rc=$?
      if [ $rc -ne 0 ] && [ $((end - SECONDS)) -gt 30 ]; then
        echo "== the failures again, two processes" >> "$out/moe_tests.txt"
        timeout $((end - SECONDS)) python3 -m pytest -q -m gpu tests/moe --lf -n 2 --tb=short \
          -o cache_dir=/tmp/moe_cache >> "$out/moe_tests.txt" 2>&1
        rc=$?
      fi
      echo "moe tests rc=$rc"; grep -E "^FAILED|passed|failed|^== " "$out/moe_tests.txt" | tail -30 ;;
    bench)
      python3 benchmarks/bench_moe.py --models flash --compile-only 12 > "$out/bench.txt" 2>&1
      timeout "${T2:-300}" python3 benchmarks/bench_moe.py --models flash --out "$out" >> "$out/bench.txt" 2>&1
      echo "bench rc=$?"; grep -E "^moe_" "$out/bench.txt" | cut -c1-160 ;;
    tilings)
      IFS=';' read -r -a tilings <<< "${TILINGS:-policy=FullRow;policy=FullRow,num_stages=3;policy=FullRow,swizzle=8}"
      for t in "${tilings[@]}"; do  # compile every tiling's kernels at once
        timeout "${T_COMPILE:-150}" python3 benchmarks/bench_moe.py --models flash --compile-only 4 --tiling "$t" \
          > /dev/null 2>&1 &
      done
      wait
      for t in "${tilings[@]}"; do
        echo "== tiling $t" >> "$out/tilings.txt"
        timeout "${T3:-120}" python3 benchmarks/bench_moe.py --models flash --tokens 4096,16384 --ops gate_up,down \
          --tiling "$t" --out "$out" >> "$out/tilings.txt" 2>&1
        echo "tiling $t: rc=$?"
      done
      grep -E "^== |^moe_" "$out/tilings.txt" | cut -c1-120 ;;
    *) echo "unknown part $part (tests, bench, tilings)"; exit 2 ;;
  esac
done
