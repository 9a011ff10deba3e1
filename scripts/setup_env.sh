#!/usr/bin/env bash
# Create (or refresh) the project virtualenv with everything the demo and the tests need, on a CPU machine.
#
#   scripts/setup_env.sh            # -> .venv (skips work when nothing it installs from has changed)
#   VENV=/path scripts/setup_env.sh
#
# What it installs (versions pinned in requirements/constraints.txt):
#   torch 2.14.1 + torchvision 0.29.1 (the CUDA 13 builds; they run on a CPU; pip takes them from local disk
#   where the machine has them), TileLang 0.1.12 (the version SGLang 0.5.23 and vLLM 0.33.0 pin),
#   SGLang 0.5.23 and vLLM 0.33.0 with --no-deps plus the pure-Python packages needed to import their
#   attention APIs and SGLang's test kit (requirements/engines.txt), pytest, and this package (editable, so both
#   engines discover its entry points). Beside it, in $venv/oracles (on PYTHONPATH only for the tests marked
#   tilekernels): tile-kernels 2.1.0 with the TileLang 0.1.15 it needs, its torch references being test oracles
#   (a best-effort step: where it cannot be fetched, those tests skip and say so).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${VENV:-$root/.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
stamp="$venv/.musa_attn_setup"
want=$(cat scripts/setup_env.sh requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "setup: $venv is up to date"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() {
  local log; log=$(mktemp)
  if ! "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; echo "setup: 'pip $*' failed" >&2; exit 1
  fi
  # The engines are installed --no-deps on purpose: pip's complaints about their unmet pins are expected.
  grep -vE "^WARNING: Location|dependency resolver|requires .*which is not installed|but you have .* which is incompatible" "$log" || true
  rm -f "$log"
}
c=(-c requirements/constraints.txt)
echo "setup: torch (this is the slow step: ~5 GB of CUDA 13 wheels)"
pip install "${c[@]}" torch==2.14.1 torchvision==0.29.1
echo "setup: TileLang, test tools"
pip install "${c[@]}" tilelang apache-tvm-ffi filelock pytest hypothesis
echo "setup: SGLang 0.5.23 and vLLM 0.33.0 (--no-deps) and the packages their attention APIs import"
pip install "${c[@]}" --no-deps sglang==0.5.23 vllm==0.33.0 triton xgrammar
pip install "${c[@]}" -r requirements/engines.txt
pip install "${c[@]}" --no-deps -e .
"$venv/bin/python" - <<'PY'
import importlib, sys
for m in ("torch", "tilelang", "sglang", "vllm", "musa_attn_backend"):
    importlib.import_module(m)
print("setup: imports ok (python %s)" % sys.version.split()[0])
PY
echo "setup: tile-kernels 2.1.0 + TileLang 0.1.15 into $venv/oracles (test oracles)"
rm -rf "$venv/oracles"
# --ignore-requires-python: the wheel says Python >= 3.12, but its code (pure Python) imports on 3.11 too
if ! "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --ignore-requires-python \
    --target "$venv/oracles" tile-kernels==2.1.0 tilelang==0.1.15 apache-tvm-ffi==0.1.12 >/dev/null 2>&1; then
  rm -rf "$venv/oracles"
  echo "setup: could not stage tile-kernels 2.1.0: the tests marked tilekernels will skip" >&2
fi
echo "$want" > "$stamp"
