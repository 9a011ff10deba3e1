#!/usr/bin/env bash
# Issue 40 on the lent GPU (a warm machine with .device/tl installed; carry .device/env.sh .device/fw): the tiny V4
# served by SGLang's real server on CUDA in the MUSA situation (integration_tests/test_sglang_dsv4_gpu.py), eager
# first (K=eager) or both (K="eager or cuda_graphs"). Server logs and agreement figures under $OUT/serve.
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
source scripts/device_entry_points.sh
out=${OUT:-/tmp/out}; mkdir -p "$out/serve"
export MUSA_ATTN_SERVE_LOGS=$out/serve
t0=$SECONDS
timeout "${T_SERVE:-420}" python3 -m pytest -m gpu -v -p no:cacheprovider -rs -x integration_tests/test_sglang_dsv4_gpu.py \
  -k "${K:-eager}" > "$out/serve.txt" 2>&1
echo "[$((SECONDS - t0)) s] rc=$?"
grep -E "PASS|FAIL|SKIP|Error|error" "$out/serve.txt" | tail -15 | cut -c1-400
for f in "$out"/serve/*.log; do echo "== $f"; grep -vE "server_args=" "$f" | tail -${TAILN:-30} | cut -c1-300; done
