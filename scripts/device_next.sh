#!/usr/bin/env bash
# The next session's device calls, in order, on one machine kept warm between them (each call within 30 s of the
# last). Write .commit first (`git rev-parse --short HEAD > .commit`): the device's git metadata is stale.
#   call1  (cold; carry .device/env.sh .device/tl .device/peers .commit; about 9 minutes) the V4-Flash-sized and
#          tiny models' kernels compiled into the cache (`musa-attn warmup`, 8 processes) beside: the V4 decode
#          bench, Pro and Flash, the token-gated default beside both 128-head forms and FlashMLA; issue 39's
#          persistent contiguous GEMM (built 2026-12-07 without a GPU) through its GPU tests, then the MoE bench's
#          tilings with it beside the default and DeepGEMM
#   call2  (carry .device/env.sh .device/fw; about 9 minutes) the engines: SGLang eager and CUDA graphs, vLLM's
#          eager, graphs and graphs-block64 modes under runner V2 (issue 40, scripts/device_engines_gpu.sh)
#   call3  (no carry) the compiled launch's GPU test (issue 38), then the V4-Flash-sized serving bench
#          (scripts/device_serve_dsv4.sh; its warmup finds call1's kernels in the cache)
#   call4  (no carry) the MoE bench with DeepGEMM beside (issue 39), then the masked program with 64-column
#          panels at decode sizes
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "${1:-}" in
  call1)
    cfg=$(mktemp -d)/v4-flash-sized
    python3 benchmarks/bench_serve_dsv4.py --config-only "$cfg" > /dev/null
    tiny=$(mktemp -d)/tiny-v4
    python3 -c "import sys, pathlib; sys.path.insert(0, 'integration_tests'); from tiny_dsv4 import build; \
build(pathlib.Path('$tiny'))"
    # the V4-Flash-sized model's kernels (call3), then the tiny V4's for both engines (call2: a cold cache cost
    # vLLM's eager test its 200 s on 2026-12-07)
    ((MUSA_ATTN_MOE=on timeout "${T_WARM:-300}" python3 -m musa_attn_backend.cli warmup --model-config "$cfg" \
        --engine vllm --experts fp8 -j 6
      timeout 200 python3 -m musa_attn_backend.cli warmup --model-config "$tiny" --engine vllm -j 6
      MUSA_ATTN_MODEL_KERNELS=on timeout 200 python3 -m musa_attn_backend.cli warmup --model-config "$tiny" \
        --engine sglang --page-size 256 -j 6) > "$out/warmup.txt" 2>&1) &
    timeout 170 python3 benchmarks/bench_dsv4_attention.py --quick --configs pro,flash --ops decode,decode_mtp \
      --no-portable --programs scheduled,cluster,plain --out "$out" > "$out/bench_cluster.txt" 2>&1
    stamp "attention bench rc=$?"; grep -E "^decode" "$out/bench_cluster.txt" | cut -c1-330
    timeout 170 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/moe/test_gpu_moe.py \
      -k "tilings or malformed" > "$out/moe_persistent_tests.txt" 2>&1
    stamp "persistent MoE tests: $(tail -1 "$out/moe_persistent_tests.txt")"
    T3=${T3:-100} TILINGS="policy=FullRow;policy=FullRow,persistent=132" \
      bash scripts/device_moe.sh tilings
    wait
    stamp "warmup: $(grep -E "done in|error" "$out/warmup.txt" | tail -1)" ;;
  call2)
    SGK="eager or cuda_graphs" VLLM_RUNNERS=1 T_SERVE=${T_SERVE:-300} T_VLLM=${T_VLLM:-200} \
      bash scripts/device_engines_gpu.sh ;;
  call3)
    # first the scheduled program's launches through one call into C++ (issue 38, built 2026-12-07 without a GPU)
    timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py -k "through_its_entry" \
      > "$out/entry_tests.txt" 2>&1
    stamp "entry tests: $(tail -1 "$out/entry_tests.txt")"
    BUDGET=${BUDGET:-300} T_BENCH=${T_BENCH:-420} bash scripts/device_serve_dsv4.sh ;;
  call4)
    T2=${T2:-300} bash scripts/device_moe.sh bench
    # the masked program with 64-column weight panels at decode sizes (docs/moe.md: the decode estimate)
    timeout 120 python3 benchmarks/bench_moe.py --models flash --compile-only 8 --masked-tiling block_n=64 \
      > /dev/null 2>&1
    timeout 150 python3 benchmarks/bench_moe.py --models flash --tokens 1,8,64,512 --ops gate_up,down,layer \
      --masked-tiling block_n=64 --out "$out" > "$out/masked_n64.txt" 2>&1
    stamp "masked block_n 64: rc=$?"; grep -E "^moe_" "$out/masked_n64.txt" | cut -c1-160 ;;
  call5)
    # (cold; carry .device/env.sh .device/tl .device/peers .commit) issue 38's host path: where an eager decode
    # call's host time goes, ours (TileLang's launches and the compiled launch) beside FlashMLA's, alone on the GPU
    for c in flash pro; do
      timeout 150 python3 benchmarks/profile_dsv4_entry.py --config $c --tokens 1 --out "$out" 2>&1 | tail -2
    done
    stamp "profiles"
    # then the compiled launch's GPU test (its entry lookup fixed), 32 heads (V4-Flash a rank at TP 2) beside the
    # masked MoE programs at their new 64-column panels
    timeout 240 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "through_its_entry or (sparse_mqa_matches_reference and 32-6 and scheduled)" > "$out/entry_tests.txt" 2>&1 &
    timeout 300 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/moe/test_gpu_moe.py \
      -k "masked_matches_reference or fused_experts_matches_reference or fused_experts_is_captured" \
      > "$out/moe_masked_tests.txt" 2>&1
    wait
    stamp "entry tests: $(tail -1 "$out/entry_tests.txt")"
    stamp "masked MoE tests: $(tail -1 "$out/moe_masked_tests.txt")"
    grep -E "^(FAILED|ERROR)|Error:" "$out/entry_tests.txt" "$out/moe_masked_tests.txt" | head -20 ;;
  call6)
    # (cold; carry .device/env.sh .device/tl .device/peers .commit) issue 38: FlashMLA's entry with the batch's
    # launches recorded in C++ (_ffi_launch.prepare): host time and the bench's eager columns beside FlashMLA's,
    # then its GPU tests beside the masked MoE cases an out-of-memory stopped in call5 (run alone here)
    for c in flash pro; do
      timeout 100 python3 benchmarks/profile_dsv4_entry.py --config $c --tokens 1 --out "$out" 2>&1 | tail -1
    done
    stamp "profiles"
    timeout 150 python3 benchmarks/bench_dsv4_attention.py --quick --configs pro,flash --ops decode \
      --no-portable --programs scheduled --out "$out" > "$out/bench_entry.txt" 2>&1
    stamp "bench rc=$?"
    python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("dsv4-attention-*.json")):
    for r in json.loads(f.read_text())["rows"]:
        if "entry_eager_ms" in r:
            print(r["shape"]["config"], r["shape"]["tokens"], {k: round(r[k] * 1e3, 1) for k in r
                  if k.endswith("eager_ms") or k in ("ours_ms", "flashmla_ms")})
PY
    timeout 150 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "through_its_entry or recorded_launches" > "$out/entry_tests.txt" 2>&1 &
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/moe/test_gpu_moe.py \
      -k "masked_matches_reference and (flash_gate_up-256-64 or flash_down-256-128)" \
      > "$out/moe_masked_tests.txt" 2>&1
    wait
    stamp "entry tests: $(tail -1 "$out/entry_tests.txt")"
    stamp "masked MoE tests: $(tail -1 "$out/moe_masked_tests.txt")"
    grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/entry_tests.txt" "$out/moe_masked_tests.txt" | head -20 ;;
  *) echo "usage: scripts/device_next.sh call1|call2|call3|call4|call5|call6"; exit 2 ;;
esac
