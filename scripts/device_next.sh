#!/usr/bin/env bash
# The next session's device calls, in order, on one machine kept warm between them (each call within 30 s of the
# last). Write .commit first (`git rev-parse --short HEAD > .commit`): the device's git metadata is stale.
#   call1  (cold; carry .device/env.sh .device/tl .device/peers .commit; about 8 minutes)
#          the V4-Flash-sized model's kernels compiled into the cache (`musa-attn warmup`, 12 processes) beside the
#          launcher's GPU test (test_gpu_dsv4.py -k entry) and the st.async probe (issue 37), then the MoE bench
#          with DeepGEMM beside (issue 39)
#   call2  (carry .device/env.sh .device/fw; about 8 minutes) the engines: SGLang eager and CUDA graphs, vLLM's
#          eager, graphs and graphs-block64 modes under runner V2 (issue 40, scripts/device_engines_gpu.sh)
#   call3  (no carry) the V4-Flash-sized serving bench (scripts/device_serve_dsv4.sh; its warmup finds call1's
#          kernels in the cache)
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "${1:-}" in
  call1)
    cfg=$(mktemp -d)/v4-flash-sized
    python3 benchmarks/bench_serve_dsv4.py --config-only "$cfg" > /dev/null
    (MUSA_ATTN_MOE=on timeout "${T_WARM:-240}" python3 -m musa_attn_backend.cli warmup --model-config "$cfg" \
       --engine vllm --experts fp8 -j 12 > "$out/warmup.txt" 2>&1) &
    (timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py -k entry \
       > "$out/entry_test.txt" 2>&1) &
    (timeout 120 python3 scripts/probe_st_async.py --run > "$out/st_async.txt" 2>&1) &
    wait
    stamp "warmup + entry test + st.async probe"; tail -2 "$out/warmup.txt"; tail -3 "$out/entry_test.txt"
    tail -1 "$out/st_async.txt"
    T2=${T2:-240} bash scripts/device_moe.sh bench
    stamp "moe bench" ;;
  call2)
    SGK="eager or cuda_graphs" VLLM_RUNNERS=1 T_SERVE=${T_SERVE:-300} T_VLLM=${T_VLLM:-200} \
      bash scripts/device_engines_gpu.sh ;;
  call3)
    BUDGET=${BUDGET:-330} T_BENCH=${T_BENCH:-450} bash scripts/device_serve_dsv4.sh ;;
  *) echo "usage: scripts/device_next.sh call1|call2|call3"; exit 2 ;;
esac
