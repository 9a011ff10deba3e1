#!/usr/bin/env bash
# Issue 40 on the lent GPU (a warm machine with .device/tl installed; carry .device/env.sh .device/fw): the tiny V4
# served in the MUSA situation by both engines at once: SGLang's real server (integration_tests/
# test_sglang_dsv4_gpu.py, SGK: eager first, "eager or cuda_graphs" for both) and vLLM's LLM() with
# integration_tests/vllm_gpu_harness first on PYTHONPATH (test_vllm_dsv4_engine.py). Logs under $OUT.
# Stage .device/fw with the packages SGLang's server imports that the default staging leaves out:
#   FW_EXTRA="setproctitle jsonschema referencing rpds-py jsonschema-specifications python-multipart soundfile cffi
#   pycparser" ../shared/device/prepare.sh --frameworks
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/device_entry_points.sh
out=${OUT:-/tmp/out}; mkdir -p "$out/serve"
export MUSA_ATTN_SERVE_LOGS=$out/serve
t0=$SECONDS
if [ "${SGLANG:-1}" = 1 ]; then
  (timeout "${T_SERVE:-330}" python3 -m pytest -m gpu -v -p no:cacheprovider -rs -x \
     integration_tests/test_sglang_dsv4_gpu.py -k "${SGK:-eager}" > "$out/sglang.txt" 2>&1) &
fi
# vLLM under both model runners at once: V2 (its default where Triton is, as on this GPU) and V1 (VLLM_RUNNERS)
if [ "${VLLM:-1}" = 1 ]; then
  for v2 in ${VLLM_RUNNERS:-1 0}; do
    (PYTHONPATH=$PWD/integration_tests/vllm_gpu_harness:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 \
       VLLM_USE_V2_MODEL_RUNNER=$v2 timeout "${T_VLLM:-330}" python3 -m pytest -m gpu -v -s -p no:cacheprovider -rs \
       integration_tests/test_vllm_dsv4_engine.py > "$out/vllm_runner_v$((2 - (1 - v2))).txt" 2>&1) &
  done
fi
wait
echo "[$((SECONDS - t0)) s] done"
for f in sglang vllm_runner_v2 vllm_runner_v1; do
  [ -f "$out/$f.txt" ] || continue
  echo "== $f"; grep -E "PASS|FAIL|SKIP|Error|error|raise" "$out/$f.txt" | tail -${TAILN:-14} | cut -c1-400
done
for f in "$out"/serve/*.log; do [ -f "$f" ] && { echo "== $f"; grep -vE "server_args=" "$f" | tail -${TAILN:-25} | cut -c1-300; }; done
