#!/usr/bin/env bash
# The next session's device calls, in order, on one machine kept warm between them (each call within 30 s of the
# last). Write .commit first (`git rev-parse --short HEAD > .commit`): the device's git metadata is stale.
#   call1  (cold; carry .device/env.sh .device/tl .device/peers .commit; about 9 minutes) issue 37's clustered
#          scheduled program (built 2026-12-07 without a GPU): the st.async probe, its GPU tests (test_gpu_dsv4.py
#          -k cluster), and the Pro decode bench with it beside the unclustered program and FlashMLA; beside them
#          the V4-Flash-sized model's kernels compiled into the cache (`musa-attn warmup`, 8 processes) and the
#          launcher's GPU test (-k entry)
#   call2  (carry .device/env.sh .device/fw; about 8 minutes) the engines: SGLang eager and CUDA graphs, vLLM's
#          eager, graphs and graphs-block64 modes under runner V2 (issue 40, scripts/device_engines_gpu.sh)
#   call3  (no carry) the V4-Flash-sized serving bench (scripts/device_serve_dsv4.sh; its warmup finds call1's
#          kernels in the cache)
#   call4  (no carry) the MoE bench with DeepGEMM beside (issue 39)
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "${1:-}" in
  call1)
    cfg=$(mktemp -d)/v4-flash-sized
    python3 benchmarks/bench_serve_dsv4.py --config-only "$cfg" > /dev/null
    (MUSA_ATTN_MOE=on timeout "${T_WARM:-300}" python3 -m musa_attn_backend.cli warmup --model-config "$cfg" \
       --engine vllm --experts fp8 -j 8 > "$out/warmup.txt" 2>&1) &
    timeout 120 python3 scripts/probe_st_async.py --run > "$out/st_async.txt" 2>&1
    stamp "st.async probe: $(tail -1 "$out/st_async.txt")"
    timeout 240 python3 -m pytest -m gpu -v -n 6 -p no:cacheprovider -rs -o faulthandler_timeout=120 \
      tests/dsv4/test_gpu_dsv4.py -k "cluster or entry" > "$out/cluster_tests.txt" 2>&1
    stamp "cluster + entry tests: $(grep -c " PASSED" "$out/cluster_tests.txt") passed"
    grep -E "FAILED|Error" "$out/cluster_tests.txt" | head -8 | cut -c1-250
    timeout 200 python3 benchmarks/bench_dsv4_attention.py --quick --configs pro --ops decode,decode_mtp \
      --no-portable --programs scheduled,cluster,plain --out "$out" > "$out/bench_cluster.txt" 2>&1
    stamp "bench rc=$?"; grep -E "^decode" "$out/bench_cluster.txt" | cut -c1-330
    wait
    stamp "warmup: $(tail -1 "$out/warmup.txt")" ;;
  call2)
    SGK="eager or cuda_graphs" VLLM_RUNNERS=1 T_SERVE=${T_SERVE:-300} T_VLLM=${T_VLLM:-200} \
      bash scripts/device_engines_gpu.sh ;;
  call3)
    BUDGET=${BUDGET:-330} T_BENCH=${T_BENCH:-450} bash scripts/device_serve_dsv4.sh ;;
  call4)
    T2=${T2:-300} bash scripts/device_moe.sh bench ;;
  *) echo "usage: scripts/device_next.sh call1|call2|call3|call4"; exit 2 ;;
esac
