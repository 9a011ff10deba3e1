#!/usr/bin/env bash
# Issue 40 on the lent GPU (a warm machine with .device/tl installed; carry .device/env.sh .device/fw): the tiny V4
# served in the MUSA situation by both engines, one after the other: SGLang's real server (integration_tests/
# test_sglang_dsv4_gpu.py, SGK: eager first, "eager or cuda_graphs" for both) and vLLM's LLM() with
# integration_tests/vllm_gpu_harness first on PYTHONPATH (test_vllm_dsv4_engine.py; VLLM_MODES picks its modes:
# eager, graphs, graphs-block64, and tp2 on a two-GPU kind). Logs under $OUT.
# Stage .device/fw with the packages SGLang's server imports that the default staging leaves out:
#   FW_EXTRA="setproctitle jsonschema referencing rpds-py jsonschema-specifications python-multipart soundfile cffi
#   pycparser" ../shared/device/prepare.sh --frameworks
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/device_entry_points.sh
out=${OUT:-/tmp/out}; mkdir -p "$out/serve"
export MUSA_ATTN_SERVE_LOGS=$out/serve
t0=$SECONDS
# SGLang's server checks on CUDA that the package sglang-kernel (its compiled kernels) is at least 0.4.9
# (entrypoints/engine.py, _set_envs_and_config); the staged sgl_kernel is an import stub without package metadata,
# so the SGLang run gets metadata of that version on its path: the MUSA situation has no sglang-kernel either
meta=$(mktemp -d)/sgl_kernel_meta; mkdir -p "$meta/sglang_kernel-0.4.9.dist-info"
printf 'Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.9\n' > "$meta/sglang_kernel-0.4.9.dist-info/METADATA"
: > "$meta/sglang_kernel-0.4.9.dist-info/RECORD"
if [ "${SGLANG:-1}" = 1 ]; then
  (PYTHONPATH=$PYTHONPATH:$meta timeout "${T_SERVE:-330}" python3 -m pytest -m gpu -v -p no:cacheprovider -rs -x \
     integration_tests/test_sglang_dsv4_gpu.py -k "${SGK:-eager}" > "$out/sglang.txt" 2>&1)
fi
# one engine at a time (an engine sizes its KV cache from the GPU memory it finds free, so one beside another
# finds too little: vLLM's second runner found 0 GiB on 2026-12-07); vLLM under both model runners: V2 (its default where Triton is, as on this GPU) and V1 (VLLM_RUNNERS)
if [ "${VLLM:-1}" = 1 ]; then
  for v2 in ${VLLM_RUNNERS:-1 0}; do
    for mode in ${VLLM_MODES:-eager graphs graphs-block64}; do  # one process a mode: a fresh engine and GPU
      (PYTHONPATH=$PWD/integration_tests/vllm_gpu_harness:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 \
         VLLM_USE_V2_MODEL_RUNNER=$v2 timeout "${T_VLLM:-330}" python3 -m pytest -m gpu -v -s -p no:cacheprovider -rs \
         "integration_tests/test_vllm_dsv4_engine.py::test_tiny_deepseek_v4_through_vllm_agrees_with_the_reference[$mode]" > "$out/vllm_runner_v$((2 - (1 - v2)))_$mode.txt" 2>&1)
    done
  done
fi
wait
echo "[$((SECONDS - t0)) s] done"
for f in "$out"/sglang.txt "$out"/vllm_runner_*.txt; do
  [ -f "$f" ] || continue
  echo "== $f"; grep -E "PASS|FAIL|SKIP|Error|error|raise" "$f" | tail -${TAILN:-14} | cut -c1-400
done
for f in "$out"/serve/*.log; do [ -f "$f" ] && { echo "== $f"; grep -vE "server_args=" "$f" | tail -${TAILN:-25} | cut -c1-300; }; done
