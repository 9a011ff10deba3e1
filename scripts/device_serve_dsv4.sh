#!/usr/bin/env bash
# Issue 40 on the lent GPU (a warm machine with .device/tl and then .device/fw installed): the V4-Flash-sized model
# served by vLLM (benchmarks/bench_serve_dsv4.py), the MUSA situation (integration_tests/vllm_gpu_harness first on
# PYTHONPATH), our MoE experts on (MUSA_ATTN_MOE=on). First every kernel the model needs is compiled in parallel
# (`musa-attn warmup --model-config`, JOBS processes), then the bench runs for BUDGET seconds; BENCH_ARGS go to it
# (e.g. "--batches 1,8 --contexts 4096"). Logs and the JSON under $OUT.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-} MUSA_ATTN_MOE=on
source scripts/device_entry_points.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
cfg=$(mktemp -d)/v4-flash-sized
t0=$SECONDS
python3 benchmarks/bench_serve_dsv4.py --config-only "$cfg" ${BENCH_ARGS:-} > /dev/null  # the model the bench builds
timeout "${T_WARM:-240}" python3 -m musa_attn_backend.cli warmup --model-config "$cfg" --engine vllm --experts fp8 \
  -j "${JOBS:-12}" > "$out/warmup.txt" 2>&1
echo "[$((SECONDS - t0)) s] warmup rc=$? ($(grep -c . "$out/warmup.txt") lines)"; tail -3 "$out/warmup.txt"
PYTHONPATH=$PWD/integration_tests/vllm_gpu_harness:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  timeout "${T_BENCH:-480}" python3 benchmarks/bench_serve_dsv4.py --out "$out" --budget-s "${BUDGET:-360}" \
  ${BENCH_ARGS:-} > "$out/serve.txt" 2>&1
echo "[$((SECONDS - t0)) s] bench rc=$?"
grep -E "^B |results in|Error|error|Traceback" "$out/serve.txt" | tail -${TAILN:-30} | cut -c1-400
