"""A tiny DeepSeek-V4 (``tiny_dsv4.py``, random weights) served by a real SGLang engine on the CPU with
``attention_backend="tilelang_musa"``: the V4 backend, both compressors, the C4 indexer and this package's model
kernels in SGLang's own scheduler processes. A batch of a short prompt, one of 2,600 tokens (the window wraps, and
the C4 indexer chooses 512 of its 650 compressed rows) and one sharing 1,300 of them, then the short and the shared
ones again (the shared prefix a radix-cache hit), greedy: their tokens must not depend on the batch or on the cache,
and every prompt must decode. Its agreement with an independent V4 forward is the next test to come."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SCRIPT = r"""
import json, sys

def main():
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang as sgl
    llm = sgl.Engine(model_path=sys.argv[1], device="cpu", load_format="dummy", skip_tokenizer_init=True,
                     attention_backend="tilelang_musa", max_total_tokens=16384, swa_full_tokens_ratio=0.5,
                     disable_cuda_graph=True, mem_fraction_static=0.3, random_seed=0, log_level="info")
    short = list(range(5, 40))
    long = [(7 + 37 * i) % 1000 + 2 for i in range(2600)]
    params = {"max_new_tokens": 6, "temperature": 0}
    shared = long[:1300] + [3, 4, 5]  # shares five 256-token pages with the long prompt
    batch = llm.generate(input_ids=[short, long, shared], sampling_params=params)
    again = llm.generate(input_ids=[short, shared], sampling_params=params)
    print("RESULT " + json.dumps({"batch": [o["output_ids"] for o in batch], "again": [o["output_ids"] for o in again],
                                  "cached": [o["meta_info"].get("cached_tokens", 0) for o in again]}))
    llm.shutdown()

if __name__ == "__main__":
    main()
"""


def test_tiny_deepseek_v4_generates_through_our_backend(tmp_path):
    sys.path.insert(0, str(HERE))
    from tiny_dsv4 import build

    model = build(tmp_path / "tiny-v4")
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE / "sgl_kernel_shim"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), str(model)], capture_output=True, text=True, env=env,
                         timeout=900)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    short, long, shared = res["batch"]
    assert all(len(x) == 6 and all(0 <= t < 1024 for t in x) for x in (short, long, shared))
    # the same greedy tokens in another batch, and with the shared prefix read from the radix cache
    assert res["again"] == [short, shared]
    assert res["cached"][1] >= 1280
    assert "Prefill shared-read-done fastpath active (TileLangMusaDSV4Backend)" in out.stderr + out.stdout
