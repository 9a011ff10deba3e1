#!/usr/bin/env bash
# The device calls, in order, on one machine kept warm between them (each call within 30 s of the last). Write
# .commit first (`git rev-parse --short HEAD > .commit`): the device's git metadata is stale. The calls that ran are
# in docs/device-runs.md (the script at each session's commits holds them); what is left:
#   ws10   (carry .device/env.sh .device/tl .device/peers .flashmla .commit; cold, about 4 minutes) issue 37: the
#          grids with tokens on x checked by FlashMLA's 70,000-token prefill cases (staged_ws), the moved programs'
#          GPU cases (workspace programs, MoE's combine, mHC post), staged_ws's OVERLAP and paired_ws's
#          ADJACENT_HEADS beside FlashMLA (staged: the 36th session's device time ran out)
#   ws7    (carry as ws10; cold, about 4 minutes) issue 37: every workspace program's GPU cases, FlashMLA's prefill
#          suite on paired_ws and staged_ws, the kernels beside FlashMLA on its own inputs (ran at 65b3dc4)
#   next1b (carry .device/env.sh .device/tl .device/peers .commit .device/before.tar.gz .device/after.tar.gz)
#          issue 39's routing-program GPU tests (SKIP_ROUTE=1 skips them), issue 41's before/after bench of the trees
#          at 480b749^ and ef0e8a9 (`git archive 480b749^ musa_attn_backend benchmarks | gzip >
#          .device/before.tar.gz`, the same of ef0e8a9); on an H200, with more than 240 s for the MoE down projection
#   next2, next3 (carry .device/env.sh .device/fw; each about 4-7 minutes, the kernels compiled cold) the vLLM
#          layer's and the SGLang backend's V4 benches
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "${1:-}" in
  next1b)  # issue 39's route tests, issue 41's before/after bench
    [ -z "${SKIP_ROUTE:-}" ] && timeout 120 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs \
      tests/moe/test_gpu_moe.py -k "route" > "$out/route_tests.txt" 2>&1
    stamp "route tests: $(tail -1 "$out/route_tests.txt" 2>/dev/null)"
    trees=$(mktemp -d)
    for t in before after; do mkdir -p "$trees/$t" && tar -xzf ".device/$t.tar.gz" -C "$trees/$t"; done
    for tree in "$trees/before" "$trees/after"; do
      export MUSA_ATTN_COMMIT=$([ "$(basename "$tree")" = before ] && echo 480b749^ || echo ef0e8a9)
      (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH timeout 240 python3 benchmarks/bench_moe.py --models flash --tokens 64,4096 \
        --ops gate_up,down --out "$out" > "$out/moe_$(basename "$tree").txt" 2>&1)
      (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH timeout 110 python3 benchmarks/bench_dsv4_attention.py --quick \
        --configs flash --ops decode --no-portable --out "$out" > "$out/dsv4_$(basename "$tree").txt" 2>&1)
      stamp "bench from $tree"
    done
    grep -h -E "^(moe_|decode)" "$out"/moe_*.txt "$out"/dsv4_*.txt | cut -c1-140 ;;
  ws7)  # issue 37 (36th session): the new defaults (paired_ws with ROW_COPY + GROUP_COPY, portable_ws with PREFETCH)
    # and the staged_ws program: their kernels compiled in parallel, FlashMLA's prefill suite on paired_ws and
    # staged_ws, every workspace program's GPU cases, then the kernels beside FlashMLA on its own inputs
    d=pipelined+hint+smem_out+qasync+rowcopy+groupcopy
    timeout 90 python3 scripts/ws_variants.py --precompile-only --configs flash,pro --variants $d \
      --programs staged_ws,portable_ws:musa > "$out/ws7_precompile.txt" 2>&1
    timeout 170 python3 scripts/ws_smoke.py --precompile-tests >> "$out/ws7_precompile.txt" 2>&1
    stamp "$(grep -E "^precompiled" "$out/ws7_precompile.txt" | tr '\n' ' ')"
    for p in auto staged_ws; do
      timeout 45 bash scripts/device_v4_attention.sh suite prefill --all \
        $([ $p = auto ] || echo --program $p) > "$out/suite_$p.txt" 2>&1
      cp "$out/flashmla_prefill.json" "$out/flashmla-suite-prefill-$p.json" 2>/dev/null
      stamp "suite $p: $(grep -E "^prefill:" "$out/suite_$p.txt")"
    done
    rm -f "$out/flashmla_prefill.json" "$out/flashmla_prefill.log"
    timeout 200 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -rs -o faulthandler_timeout=150 \
      tests/dsv4/test_gpu_dsv4.py -k "paired_ws or portable_ws or staged or sparse_fwd or workspace_rows" \
      > "$out/ws7_tests.txt" 2>&1
    stamp "workspace program tests: $(tail -1 "$out/ws7_tests.txt")"
    grep -E "^FAILED|^ERROR" "$out/ws7_tests.txt" | cut -c1-250 | head -12
    timeout 100 python3 scripts/ws_variants.py --out "$out" --configs flash,pro --variants $d \
      --programs staged_ws,portable_ws:musa > "$out/ws7_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    grep -E "^\{" "$out/ws7_variants.txt" | cut -c1-2500 ;;
  ws10)  # issue 37, one short call: the grids with tokens on x checked (FlashMLA's prefill suite on staged_ws, its
    # 70,000-token cases; the GPU cases of the moved programs), then staged_ws's OVERLAP and paired_ws's
    # ADJACENT_HEADS beside FlashMLA
    d=pipelined+hint+smem_out+qasync+rowcopy+groupcopy
    timeout 100 python3 scripts/ws_smoke.py --precompile-tests \
      --forms rows,staged,staged_overlap,portable_prefetch,portable_musa_prefetch > "$out/ws10_precompile.txt" 2>&1 &
    timeout 100 python3 scripts/ws_variants.py --precompile-only --configs flash,pro --variants $d,$d+adjacent \
      --programs staged_ws,staged_ws:overlap >> "$out/ws10_precompile2.txt" 2>&1
    wait
    stamp "$(grep -h -E "^precompiled" "$out"/ws10_precompile*.txt | tr '\n' ' ')"
    timeout 40 bash scripts/device_v4_attention.sh suite prefill --all --program staged_ws > "$out/suite_staged.txt" 2>&1
    mv "$out/flashmla_prefill.json" "$out/flashmla-suite-prefill-staged_ws.json" 2>/dev/null; rm -f "$out/flashmla_prefill.log"
    stamp "suite staged_ws: $(grep -E "^prefill:" "$out/suite_staged.txt")"
    timeout 100 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -rs -o faulthandler_timeout=90 \
      tests/dsv4/test_gpu_dsv4.py tests/moe/test_gpu_moe.py tests/dsv4/test_gpu_dsv4_model_ops.py \
      -k "staged or (portable_ws and not gather) or combine_experts or mhc_post or adjacent" > "$out/ws10_tests.txt" 2>&1
    stamp "tests: $(tail -1 "$out/ws10_tests.txt")"
    grep -E "^FAILED|^ERROR" "$out/ws10_tests.txt" | cut -c1-250 | head -12
    timeout 60 python3 scripts/ws_variants.py --out "$out" --configs flash,pro --variants $d,$d+adjacent \
      --programs staged_ws,staged_ws:overlap > "$out/ws10_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    grep -E "^\{" "$out/ws10_variants.txt" | cut -c1-2500 ;;
  next2|next3)  # the engines' plugin loaders find us by entry points: the package's dist-info, onto PYTHONPATH
    source scripts/device_entry_points.sh
    engine=$([ "$1" = next2 ] && echo vllm || echo sglang)
    timeout 420 python3 benchmarks/bench_${engine}_dsv4.py --quick --out "$out" > "$out/${engine}_dsv4.txt" 2>&1
    stamp "$engine V4 bench rc=$?"
    grep -h -E "^${engine}_dsv4" "$out/${engine}_dsv4.txt" | cut -c1-220 ;;
  *) echo "usage: scripts/device_next.sh ws7|ws10|next1b|next2|next3"; exit 2 ;;
esac
