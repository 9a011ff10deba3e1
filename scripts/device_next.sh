#!/usr/bin/env bash
# The device calls, in order, on one machine kept warm between them (each call within 30 s of the last). Write
# .commit first (`git rev-parse --short HEAD > .commit`): the device's git metadata is stale.
# Calls (33rd and 34th sessions, 2026-12-07: `variants`, `next1b` and `next2` ran on an H100, docs/device-runs.md):
#   variants (cold; carry .device/env.sh .device/tl .device/peers .commit; about 4 minutes) issue 37: the scheduled
#          program's build variants beside FlashMLA (scripts/sched_variants.py), the GPU tests of one, ncu at Flash 64
#   next1b (carry as variants plus .device/before.tar.gz .device/after.tar.gz) issue 39's routing-program GPU tests
#          (SKIP_ROUTE=1 skips them), issue 41's before/after bench of the trees at 480b749^ and ef0e8a9
#          (`git archive 480b749^ musa_attn_backend benchmarks | gzip > .device/before.tar.gz`, the same of ef0e8a9)
#   next2, next3 (carry .device/env.sh .device/fw; each about 4-7 minutes, the kernels compiled cold) the vLLM
#          layer's and the SGLang backend's V4 benches (34th session: next2's vLLM bench ran on an H100; the SGLang
#          bench found no backend: the entry points' dist-info was not written, now it is)
#   ws     (carry .device/env.sh .device/tl .device/peers .commit; cold, about 8 minutes) issue 37: the workspace
#          programs' GPU tests (34th session: built after the device time was spent; paired_ws's first form ran
#          correct in a smoke run, docs/dsv4.md); ws2 (carry .device/env.sh .commit, warm) scripts/ws_smoke.py
#          timing paired_ws in both orders and portable_ws in both forms beside the scheduled program; then
#          `scripts/device_v4_attention.sh suite prefill --sample 150` (carry .flashmla): FlashMLA's prefill tests
#          now run our kernel
#          (35th session: ws, ws2 and ws3 ran on an H100, docs/device-runs.md; the suite then ran on the plain build)
#   ws4    (carry .device/env.sh .device/tl .device/peers .flashmla .commit; cold, about 5 minutes) issue 37: the new
#          default build of paired_ws through FlashMLA's whole prefill suite, the default beside +rowcopy and
#          FlashMLA, rowcopy's tests (staged: no device time was left in the 35th session)
#   ws5    (carry as ws4, warm after it) issue 37: the MUSA form's register prefetch (portable_ws PREFETCH): its GPU
#          cases and every workspace form's timing (scripts/ws_smoke.py)
#   ws6    (carry as ws4; warm after ws4/ws5 or cold, about 5 minutes) issue 37: the staged_ws program (MUSA's form
#          with a producer warp group): its GPU cases, FlashMLA's prefill suite on it, its kernel beside FlashMLA
#   ws7    (carry as ws4; cold, about 8 minutes) issue 37, 36th session: the new defaults (paired_ws's ROW_COPY and
#          GROUP_COPY, portable_ws's PREFETCH) and staged_ws: GPU cases, FlashMLA's prefill suite, timings
#   ws8    (carry as ws4; cold, about 7 minutes) issue 37: the grids with tokens on x (FlashMLA's 70,000-token
#          prefill cases), staged_ws's OVERLAP build: GPU cases, FlashMLA's prefill suite, timing beside FlashMLA
#   ws9    (carry as ws4) issue 37: paired_ws's ADJACENT_HEADS at Pro beside the default and FlashMLA, its GPU cases
#   ws10   (carry as ws4; cold, about 4 minutes) issue 37: ws8 and ws9 in one short call (the grid fix checked by
#          FlashMLA's 70,000-token prefill cases, the moved programs' GPU cases, OVERLAP and ADJACENT_HEADS timed)
#   ws3    (carry .device/env.sh .device/tl .device/peers .commit; cold, about 5 minutes) issue 37: paired_ws's build
#          variants (copy hints, the output through shared memory, FlashMLA's order) against FlashMLA's prefill on its
#          own inputs (scripts/ws_variants.py), then ncu of FlashMLA's kernel and two variants
source .device/env.sh
export MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache} PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "${1:-}" in
  next1b)  # next1 without the V4 tests (run by `variants` with its variant): issue 39's route tests, issue 41's bench
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
  variants)
    # issue 37: the scheduled program's variants (PDL trigger place, hinted loads) beside FlashMLA, the GPU tests of
    # hint+end (the combine's grid needs no build), ncu of both kernels at Flash 64 tokens
    timeout 360 python3 scripts/sched_variants.py --out "$out" --variants base,groups,hint,hint+groups,end+groups \
      --tests hint+end+groups > "$out/variants.txt" 2>&1
    stamp "variants rc=$?"
    PROFILE_PROGRAMS=scheduled timeout 90 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section InstructionStats --section ComputeWorkloadAnalysis \
      python3 scripts/profile_dsv4_attention.py --ncu --cases flash:64:1 > "$out/ncu.txt" 2>&1
    stamp "ncu rc=$?"
    grep -E "^\{|rc |passed|failed" "$out/variants.txt" | cut -c1-600 | tail -20 ;;
  ws)  # issue 37: the workspace programs' GPU tests (paired_ws in both orders of its math groups, portable_ws in
    # both forms, the rows' gather, FlashMLA's prefill entry), their kernels compiled in parallel first
    timeout 200 python3 scripts/ws_smoke.py --precompile-tests > "$out/ws_precompile.txt" 2>&1
    stamp "$(tail -1 "$out/ws_precompile.txt")"
    timeout 330 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "paired_ws or portable_ws or workspace_rows or sparse_fwd_kernel" > "$out/ws_tests.txt" 2>&1
    stamp "workspace program tests: $(tail -1 "$out/ws_tests.txt")"
    grep -E "passed|failed|FAILED|Error" "$out/ws_tests.txt" | cut -c1-300 | tail -15 ;;
  ws2)  # then Flash and Pro prefill of 4096 tokens: every workspace form beside the scheduled program
    timeout 400 python3 scripts/ws_smoke.py --configs flash,pro --tokens 4096 --out "$out" > "$out/ws_smoke.txt" 2>&1
    stamp "ws smoke rc=$?"
    grep -E "^\{" "$out/ws_smoke.txt" | cut -c1-1500 ;;
  ws3)  # issue 37: paired_ws's build variants (scripts/ws_variants.py) beside FlashMLA's prefill on its own inputs,
    # then ncu of FlashMLA's kernel and two variants at Flash 4096
    timeout 220 python3 scripts/ws_variants.py --out "$out" ${WS_VARIANTS:+--variants $WS_VARIANTS} \
      > "$out/ws_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    timeout 100 python3 scripts/ws_smoke.py --precompile-tests > "$out/ws_precompile.txt" 2>&1
    timeout 90 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "switches or sparse_fwd_kernel" > "$out/ws_tests.txt" 2>&1
    stamp "variant tests: $(tail -1 "$out/ws_tests.txt")"
    timeout 120 ncu --clock-control none --profile-from-start off --kernel-name regex:"sparse_attn_fwd|paired_ws" \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section InstructionStats --section ComputeWorkloadAnalysis \
      python3 scripts/ws_variants.py --ncu --configs flash --variants ${NCU_VARIANTS:-base,hint+smem_out} \
      > "$out/ncu_ws.txt" 2>&1
    stamp "ncu rc=$?"
    grep -E "^\{|precompiled|rror" "$out/ws_variants.txt" | cut -c1-2500
    grep -E "passed|failed|FAILED" "$out/ws_tests.txt" | cut -c1-300 | tail -8 ;;
  ws4)  # issue 37: paired_ws's new default build (pipelined+hint+smem_out+qasync) through FlashMLA's whole prefill
    # suite, then the default beside +rowcopy (+groupcopy) and FlashMLA (kernels alone, graphs), then their GPU cases
    d=pipelined+hint+smem_out+qasync; v=$d,$d+rowcopy,$d+rowcopy+groupcopy
    timeout 80 python3 scripts/ws_variants.py --precompile-only --configs flash,pro --variants $v \
      > "$out/ws4_precompile.txt" 2>&1
    stamp "$(tail -1 "$out/ws4_precompile.txt")"
    timeout 60 bash scripts/device_v4_attention.sh suite prefill --all > "$out/suite_prefill.txt" 2>&1
    stamp "$(grep -E "^prefill:" "$out/suite_prefill.txt")"
    timeout 120 python3 scripts/ws_variants.py --out "$out" --configs flash,pro --variants $v > "$out/ws_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    grep -E "^\{" "$out/ws_variants.txt" | cut -c1-3000
    timeout 150 python3 scripts/ws_smoke.py --precompile-tests > "$out/ws_precompile.txt" 2>&1
    timeout 150 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "rowcopy or paired_ws" > "$out/ws_tests.txt" 2>&1
    stamp "paired_ws (default build) and rowcopy/groupcopy tests: $(tail -1 "$out/ws_tests.txt")" ;;
  ws5)  # issue 37, the MUSA form: portable_ws with its rows prefetched into registers (PREFETCH), its GPU cases,
    # then every workspace form's timing at 4k tokens beside the scheduled program (ws_smoke)
    timeout 150 python3 scripts/ws_smoke.py --precompile-tests > "$out/ws_precompile.txt" 2>&1
    timeout 200 python3 -m pytest -m gpu -q -n 2 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "prefetch" > "$out/prefetch_tests.txt" 2>&1
    stamp "prefetch tests: $(tail -1 "$out/prefetch_tests.txt")"
    timeout 300 python3 scripts/ws_smoke.py --configs flash,pro --tokens 4096 --out "$out" > "$out/ws_smoke.txt" 2>&1
    stamp "ws smoke rc=$?"
    grep -E "^\{" "$out/ws_smoke.txt" | cut -c1-2500 ;;
  ws6)  # issue 37, the MUSA form's new program: staged_ws (a producer warp group staging 32-row tiles beside two
    # math groups, within MP31's rules): its GPU cases, FlashMLA's prefill suite on it, then its kernel and
    # portable_ws's MUSA form beside FlashMLA on FlashMLA's own inputs (kernels alone, graphs)
    d=pipelined+hint+smem_out+qasync
    timeout 100 python3 scripts/ws_variants.py --precompile-only --configs flash,pro --variants $d \
      --programs staged_ws,portable_ws:musa > "$out/ws6_precompile.txt" 2>&1
    stamp "$(tail -1 "$out/ws6_precompile.txt")"
    timeout 100 python3 scripts/ws_smoke.py --precompile-tests --forms staged >> "$out/ws6_precompile.txt" 2>&1
    stamp "$(tail -1 "$out/ws6_precompile.txt")"
    timeout 150 python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs -o faulthandler_timeout=100 \
      tests/dsv4/test_gpu_dsv4.py -k "staged" > "$out/staged_tests.txt" 2>&1
    stamp "staged_ws tests: $(tail -1 "$out/staged_tests.txt")"
    grep -E "FAILED|Error|assert" "$out/staged_tests.txt" | cut -c1-300 | head -12
    timeout 90 bash scripts/device_v4_attention.sh suite prefill --all --program staged_ws > "$out/suite_staged.txt" 2>&1
    stamp "$(grep -E "^prefill:" "$out/suite_staged.txt")"
    timeout 120 python3 scripts/ws_variants.py --out "$out" --configs flash,pro --variants $d \
      --programs staged_ws,portable_ws:musa > "$out/ws6_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    grep -E "^\{" "$out/ws6_variants.txt" | cut -c1-3000 ;;
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
  ws8)  # issue 37: the grids with tokens on x (workspace programs, the portable program, MoE combine, mHC post),
    # checked where FlashMLA's prefill suite found tokens on y (70,000 tokens); staged_ws's OVERLAP build: GPU cases
    # and both builds beside FlashMLA and paired_ws's default on FlashMLA's own inputs
    d=pipelined+hint+smem_out+qasync+rowcopy+groupcopy
    timeout 60 python3 scripts/ws_variants.py --precompile-only --configs flash,pro --variants $d \
      --programs staged_ws,staged_ws:overlap,portable_ws:musa > "$out/ws8_precompile.txt" 2>&1
    timeout 100 python3 scripts/ws_smoke.py --precompile-tests \
      --forms rows,staged,staged_overlap,portable,portable_musa,portable_prefetch,portable_musa_prefetch \
      >> "$out/ws8_precompile.txt" 2>&1
    stamp "$(grep -E "^precompiled" "$out/ws8_precompile.txt" | tr '\n' ' ')"
    timeout 45 bash scripts/device_v4_attention.sh suite prefill --all --program staged_ws > "$out/suite_staged.txt" 2>&1
    mv "$out/flashmla_prefill.json" "$out/flashmla-suite-prefill-staged_ws.json" 2>/dev/null; rm -f "$out/flashmla_prefill.log"
    stamp "suite staged_ws: $(grep -E "^prefill:" "$out/suite_staged.txt")"
    timeout 200 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -rs -o faulthandler_timeout=150 \
      tests/dsv4/test_gpu_dsv4.py tests/moe/test_gpu_moe.py tests/dsv4/test_gpu_dsv4_model_ops.py \
      -k "staged or portable or combine_experts or mhc_post" > "$out/ws8_tests.txt" 2>&1
    stamp "tests: $(tail -1 "$out/ws8_tests.txt")"
    grep -E "^FAILED|^ERROR" "$out/ws8_tests.txt" | cut -c1-250 | head -12
    timeout 100 python3 scripts/ws_variants.py --out "$out" --configs flash,pro --variants $d \
      --programs staged_ws,staged_ws:overlap,portable_ws:musa > "$out/ws8_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    grep -E "^\{" "$out/ws8_variants.txt" | cut -c1-2500 ;;
  ws9)  # issue 37: paired_ws's ADJACENT_HEADS (a token's two head blocks adjacent in launch order) beside the
    # default and FlashMLA at Pro, its GPU cases (128 heads among them)
    d=pipelined+hint+smem_out+qasync+rowcopy+groupcopy
    timeout 60 python3 scripts/ws_variants.py --precompile-only --configs pro --variants $d,$d+adjacent \
      > "$out/ws9_precompile.txt" 2>&1
    stamp "$(tail -1 "$out/ws9_precompile.txt")"
    timeout 120 python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs tests/dsv4/test_gpu_dsv4.py \
      -k "adjacent" > "$out/ws9_tests.txt" 2>&1
    stamp "adjacent tests: $(tail -1 "$out/ws9_tests.txt")"
    timeout 90 python3 scripts/ws_variants.py --out "$out" --configs pro --variants $d+adjacent,$d \
      > "$out/ws9_variants.txt" 2>&1
    stamp "ws variants rc=$?"
    grep -E "^\{" "$out/ws9_variants.txt" | cut -c1-2500 ;;
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
  *) echo "usage: scripts/device_next.sh ws|ws2|ws3|ws4|ws5|ws6|ws7|ws8|ws9|ws10|variants|next1b|next2|next3"; exit 2 ;;
esac
