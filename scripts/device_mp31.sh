#!/usr/bin/env bash
# On the lent H200 (after `source .device/env.sh`), issue 36's GPU runs; logs under $OUT.
#   scripts/device_mp31.sh forms    the GPU tests of MUSA's program forms built for sm_90a (MUSA_ATTN_MUSA_FORMS):
#                                   V4 sparse MQA with K and V tiles apart, head dim 192 as 128 + 64, masked FP8 at
#                                   256 threads, FP4 on FP8 one span a step (needs .device/tl)
#   scripts/device_mp31.sh warmup   the V4 warmup leaves nothing to compile (tests/dsv4/test_gpu_dsv4_warmup.py;
#                                   needs .device/fw too)
#   scripts/device_mp31.sh bench    sparse MQA with the MUSA form's column (benchmarks/bench_dsv4_attention.py)
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache}
source "$(dirname "$0")/device_entry_points.sh"  # our entry points, for the engines' plugin loaders
case "${1:-}" in
  forms)  # the MoE tests in fewer processes: their V4-shape references take GiBs each
    python3 -m pytest -m gpu -v -n "${JOBS:-12}" -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      tests/attention/test_gpu_attention.py -k "musa or 192" 2>&1 | tee "$out/forms.log" | grep -v " PASSED " \
      | tail -30
    python3 -m pytest -m gpu -v -n 4 -p no:cacheprovider -rs tests/moe/test_gpu_moe.py \
      -k "masked_matches_reference or fp4_matches_reference" 2>&1 | tee "$out/forms_moe.log" \
      | grep -v " PASSED " | tail -30
    echo "passed: $(cat "$out"/forms*.log | grep -c ' PASSED ')" ;;
  warmup)
    python3 -m pytest -m gpu -v -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4_warmup.py 2>&1 \
      | tee "$out/warmup.log" | tail -40 ;;
  bench)
    shift
    python3 benchmarks/bench_dsv4_attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -40 ;;
  *) echo "usage: scripts/device_mp31.sh forms|warmup|bench [args]"; exit 2 ;;
esac
