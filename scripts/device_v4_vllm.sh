#!/usr/bin/env bash
# device call (with .device/fw carried, after .device/tl): our vLLM V4 layer on the GPU against the float32
# reference, then the V4 layer bench (forward_mqa against its kernel alone)
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=/tmp/musa_attn_cache PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p $OUT
timeout ${T1:-300} python3 -m musa_attn_backend.testing.vllm_dsv4_layer $OUT/layer_gpu.json cuda > $OUT/layer.txt 2>&1
echo "layer rc=$?"; grep -v "^W12\|Warning\|warn(" $OUT/layer.txt | tail -25
python3 -c "import json;r=json.load(open('$OUT/layer_gpu.json'));[print(l,[(round(x['mean_err'],4),round(x['max_err'],3),x.get('topk_overlap_mean')) for x in v]) for l,v in r['layers'].items()]" 2>&1 | tail -5
timeout ${T2:-240} python3 benchmarks/bench_vllm_dsv4.py --out $OUT ${BENCH_ARGS:-} > $OUT/bench.txt 2>&1
grep -E "vllm_dsv4|results in|Error" $OUT/bench.txt | tail -45
