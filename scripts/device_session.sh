#!/usr/bin/env bash
# One device call for a short lease (about 10 minutes): correctness and compilation first, all at once, then the
# timed benchmarks one after another on a quiet GPU. Carry .device/env.sh .device/tl .device/peers .flashmla.
#   phase 1 (P1 s, default 220): the V4 sparse attention GPU tests, the MoE routing program's GPU tests,
#            FlashMLA's decode suite against our entry
#            points, the compilation of every kernel the benchmarks launch (attention, MoE) and then DeepGEMM's
#            grouped-GEMM cases (scripts/deepgemm_suite.py), in parallel
#   phase 2: bench_dsv4_attention (FlashMLA beside), bench_moe V4-Flash (DeepGEMM beside), bench_dsv4_indexer
#            --quick (DeepGEMM beside), each under its own limit; logs and results JSON under $OUT
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
stamp "phase 1"
(JOBS=6 timeout "${P1:-220}" scripts/device_v4_attention.sh tests > "$out/p1_tests.txt" 2>&1) &
(timeout "${P1:-220}" python3 scripts/flashmla_suite.py run decode --sample "${SAMPLE:-150}" --program scheduled \
   --out "$out/flashmla_decode.json" > "$out/p1_suite.txt" 2>&1) &
(timeout "${P1:-220}" python3 -m pytest -q -m gpu tests/moe/test_gpu_moe.py -k "route" -p no:cacheprovider \
   > "$out/p1_route.txt" 2>&1) &
(timeout "${P1:-220}" python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); import bench_dsv4_attention as b
b.precompile(['flash', 'pro'], True, '', workers=4, programs=['scheduled'])" > "$out/p1_attn_compile.txt" 2>&1) &
(timeout "${P1:-220}" python3 benchmarks/bench_moe.py --models flash --compile-only 4 > "$out/p1_moe_compile.txt" 2>&1
 timeout 120 python3 scripts/deepgemm_suite.py --out "$out/deepgemm_suite.json" > "$out/p1_deepgemm.txt" 2>&1) &
wait
stamp "phase 1 done"; tail -12 "$out/p1_tests.txt"; tail -8 "$out/p1_suite.txt"; tail -3 "$out/p1_attn_compile.txt"
tail -3 "$out/p1_moe_compile.txt"; tail -4 "$out/p1_deepgemm.txt"; tail -3 "$out/p1_route.txt"
stamp "attention bench"
timeout "${T_ATTN:-170}" python3 benchmarks/bench_dsv4_attention.py --out "$out" > "$out/bench_attn.txt" 2>&1
echo "rc=$?"; grep -vE "^precompile|^ *$" "$out/bench_attn.txt" | tail -30 | cut -c1-220
stamp "moe bench"
timeout "${T_MOE:-100}" python3 benchmarks/bench_moe.py --models flash --tokens 1,64,512,4096,16384 --ops gate_up,down,layer \
  --out "$out" > "$out/bench_moe.txt" 2>&1
echo "rc=$?"; grep -E "^moe_|Error|error" "$out/bench_moe.txt" | tail -24 | cut -c1-220
stamp "indexer bench"
timeout "${T_IDX:-70}" python3 benchmarks/bench_dsv4_indexer.py --quick --ops prefill,paged --out "$out" \
  > "$out/bench_idx.txt" 2>&1
echo "rc=$?"; tail -20 "$out/bench_idx.txt" | cut -c1-220
stamp "end"
