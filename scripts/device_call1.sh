#!/usr/bin/env bash
# One device call (about 9 minutes, cold machine): the GPU tests still unrun (MUSA's program forms built for sm_90a,
# the MoE routing program, DeepGEMM's grouped-GEMM cases through ours, the V4 sparse MQA tests) in parallel with
# the attention benchmark's compiles; then where the V4 sparse MQA's time goes (scripts/profile_dsv4_attention.py:
# torch.profiler per kernel, then ncu on the scheduled program's kernels) and the attention benchmark.
# Carry .device/env.sh .device/tl .device/peers. Logs and results under $OUT.
source .device/env.sh
# PROGRAMS: the V4 programs tested, profiled and benched (a comma list; scheduled,paired by default)
progs=${PROGRAMS:-scheduled,paired}; export PROFILE_PROGRAMS=$progs
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
stamp "phase 1"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
[ "${FORMS:-0}" = 1 ] && (JOBS=4 timeout "${P1:-125}" scripts/device_mp31.sh forms > "$out/p1_forms.txt" 2>&1) &
(JOBS=4 timeout "${P1:-125}" scripts/device_v4_attention.sh tests "${progs//,/ or }" > "$out/p1_tests.txt" 2>&1) &
(timeout "${P1:-125}" python3 -m pytest -q -m gpu tests/moe/test_gpu_moe.py -k "route" -p no:cacheprovider \
   > "$out/p1_route.txt" 2>&1) &
(timeout "${T_DG:-200}" python3 scripts/deepgemm_suite.py --out "$out/deepgemm_suite.json" > "$out/p1_deepgemm.txt" 2>&1) &
(timeout "${P1:-125}" python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); import bench_dsv4_attention as b
b.precompile(['flash', 'pro'], False, '', workers=4, programs='$progs'.split(','))" \
  > "$out/p1_attn_compile.txt" 2>&1) &
wait
stamp "phase 1 done"
for f in tests route deepgemm attn_compile; do echo "== $f"; tail -${TAILN:-8} "$out/p1_$f.txt" | cut -c1-300; done
stamp "profile"
timeout "${T_PROF:-30}" python3 scripts/profile_dsv4_attention.py --out "$out" --cases flash:1:1,flash:64:1,flash:4096:1 > "$out/profile.txt" 2>&1; echo "rc=$?"
cut -c1-400 "$out/profile.txt" | tail -20
stamp "ncu"
[ "${NCU:-0}" = 1 ] && timeout 45 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  python3 scripts/profile_dsv4_attention.py --ncu --cases flash:4096:1 > "$out/ncu.txt" 2>&1
echo "rc=$?"; grep -E "^  [a-z_]|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occ|Block Size|Grid Size|Warp Cycles Per Issued|No Eligible|Dynamic Shared" "$out/ncu.txt" | head -150 | cut -c1-160
stamp "attention bench"
timeout "${T_ATTN:-80}" python3 benchmarks/bench_dsv4_attention.py --quick --programs $progs --no-portable --ops decode,prefill --out "$out" \
  > "$out/bench_attn.txt" 2>&1
echo "rc=$?"; grep -vE "^precompile|^ *$" "$out/bench_attn.txt" | tail -8 | cut -c1-220
stamp "end"
