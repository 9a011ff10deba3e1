#!/usr/bin/env bash
# A device call on a warm machine (.device/tl installed by an earlier call): carry .device/env.sh .device/fw.
# In parallel: issue 36's warmup completeness test (a fresh kernel cache: the V4 warmup of SGLang's kit model and
# vLLM's layer model, then their cases; nothing may compile after it) and issue 38's vLLM V4 layer tests on the GPU
# (the reference check and the CUDA-graph capture/replay); then bench_vllm_dsv4 (FlashMLA beside) if time is left.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/device_entry_points.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
stamp "tests"
(timeout "${T_TESTS:-230}" python3 -m pytest -m gpu -v -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4_warmup.py \
   > "$out/warmup.txt" 2>&1) &
(timeout "${T_TESTS:-230}" python3 -m pytest -m gpu -v -n 2 -p no:cacheprovider -rs tests/vllm/test_gpu_vllm_dsv4.py \
   -k "reference or graph" > "$out/vllm_gpu.txt" 2>&1) &
wait
stamp "tests done"
for f in warmup vllm_gpu; do echo "== $f"; grep -E "PASS|FAIL|SKIP|Error|error|assert" "$out/$f.txt" | tail -${TAILN:-25} | cut -c1-400; done
if [ "${BENCH:-0}" = 1 ]; then
  stamp "vllm bench"
  timeout "${T_BENCH:-150}" python3 benchmarks/bench_vllm_dsv4.py --quick --out "$out" > "$out/bench_vllm.txt" 2>&1
  echo "rc=$?"; tail -20 "$out/bench_vllm.txt" | cut -c1-250
fi
stamp "end"
