"""On a GPU, ``musa-attn warmup`` of a DeepSeek-V4 model leaves nothing to compile: into a fresh kernel cache, the
warmup of the model SGLang's V4 kit describes (``--engine sglang``) and of vLLM's V4 layer driver's model
(``--engine vllm``), then SGLang's kit cases on the GPU with our compressor and indexer tests, and vLLM's layer
through its steps; every kernel they ask ``compile_cached`` for is found in the cache (``_tilelang.cold_compiles``
stays empty). The CPU form of this test compares the kernels the same cases ask for with the plan
(``tests/sglang/test_sglang_dsv4_warmup_plan.py``, ``tests/vllm/test_vllm_dsv4_layer.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_compiles_after_the_v4_warmup(tmp_path):
    pytest.importorskip("sglang")
    pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    sys.path.insert(0, str(ROOT / "integration_tests"))
    from test_sglang_dsv4_warmup_plan import KIT_MODEL
    from tiny_dsv4 import CONFIG

    from musa_attn_backend.testing.vllm_dsv4_layer import TOPK

    env = dict(os.environ, MUSA_ATTN_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MUSA_ATTN_TARGET", None)
    for name, cfg, engine in (("kit", KIT_MODEL, "sglang"), ("tiny", dict(CONFIG, index_topk=TOPK), "vllm")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        jobs = str(min(os.cpu_count() or 1, 16))
        run = subprocess.run([sys.executable, "-m", "musa_attn_backend.cli", "warmup", "--model-config", str(path),
                              "--engine", engine, "--quiet", "-j", jobs], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=1200)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = tmp_path / "cold.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "musa_attn_backend.testing.trace_plugin",
                          "-p", "no:cacheprovider", "tests/sglang/test_gpu_sglang_dsv4_kit.py",
                          "tests/sglang/test_sglang_dsv4_compressor.py"], cwd=ROOT,
                         env=dict(env, KERNEL_TRACE_OUT=str(out), KERNEL_TRACE_TARGETS="cold"), capture_output=True,
                         text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(out.read_text())["cold"] == [], "SGLang's V4 cases compiled kernels the warmup missed"
    report = tmp_path / "layer.json"
    run = subprocess.run([sys.executable, "-m", "musa_attn_backend.testing.vllm_dsv4_layer", str(report), "cuda"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(report.read_text())["cold_compiles"] == [], "vLLM's V4 layer compiled kernels the warmup missed"
