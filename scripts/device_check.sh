#!/usr/bin/env bash
# On the lent GPU machine (after `source .device/env.sh`): GPU tests, then a benchmark. Logs go to $OUT.
#   scripts/device_check.sh [tests|tests-1|tests-2|tests-new-kv|bench|quick-bench|all] [pytest args...]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} MUSA_ATTN_CACHE_DIR=${MUSA_ATTN_CACHE_DIR:-/tmp/musa_attn_cache}
# The device cannot pip-install the checkout, so the engines would not find our entry points: write the
# package's dist-info (metadata + entry_points.txt from pyproject.toml) onto the path.
ep=/tmp/musa_attn_ep
python3 - "$ep" <<'PY'
import pathlib, sys, tomllib
proj = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
d = pathlib.Path(sys.argv[1]) / f"musa_attn_backend-{proj.get('version', '0.0.0')}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: musa-attn-backend\nVersion: {proj.get('version', '0.0.0')}\n")
lines = []
for group, eps in proj.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{k} = {v}" for k, v in eps.items()]
(d / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
export PYTHONPATH=$ep:$PYTHONPATH
what=${1:-all}; shift || true
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__, torch.cuda.get_device_name())"
# The whole GPU suite no longer fits one 600 s device call: tests-1 (the kernel-tiling sweep, compile-heavy) and
# tests-2 (everything else) split it. -v logs each test's outcome as it finishes, so a run cut off by the time
# limit still says which tests passed.
gpu_tests() {
  python3 -m pytest -m gpu "$@" -v -n "${JOBS:-12}" -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.log" \
    | grep -v " PASSED " | tail -40
  echo "passed: $(grep -c ' PASSED ' "$out/gpu_tests.log")"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  gpu_tests ${TESTS:-tests} "$@"
fi
if [ "$what" = tests-1 ]; then
  gpu_tests tests/test_gpu_attention.py -k "every_tiling or chunked_combine" "$@"
fi
if [ "$what" = tests-new-kv ]; then  # the new-K/V prefill's GPU tests (kernel, SGLang kit, vLLM builder/impl)
  gpu_tests tests -k "new_kv" "$@"
fi
if [ "$what" = tests-2 ]; then
  gpu_tests tests -k "not every_tiling and not chunked_combine" "$@"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_attention.py --out "$out" 2>&1 | tee "$out/bench.log" | tail -60
fi
if [ "$what" = quick-bench ]; then
  python3 benchmarks/bench_attention.py --quick --out "$out" 2>&1 | tee "$out/bench.log" | tail -40
fi
