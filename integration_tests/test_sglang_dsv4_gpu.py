"""The tiny DeepSeek-V4 (``tiny_dsv4.py``) served by a real ``python -m sglang.launch_server --attention-backend
tilelang_musa`` on a CUDA GPU in the MUSA situation (issue 40): SGLang's compiled ``sgl_kernel``, FlashMLA,
DeepGEMM and JIT CUDA kernels absent (on the lent H200, ``sgl_kernel`` is an import-only stub whose functions
raise), so attention, the compressors, the indexer (ours through the backend) and the V4 model-side kernels
(``MUSA_ATTN_MODEL_KERNELS=on``) come from this package and the rest of SGLang runs in torch or Triton
(``--sampling-backend pytorch``). Greedy tokens and log-probabilities checked against ``dsv4_reference`` by the CPU
server test's teacher-forced criterion, eager and under CUDA graphs.

``-m gpu`` (``scripts/device_engines_gpu.sh``); the server's log is kept under ``MUSA_ATTN_SERVE_LOGS`` (default: the test's temporary folder)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dsv4_reference import Reference, agreement, load, served_logprobs  # noqa: E402
from sglang_server import post, sglang_server  # noqa: E402
from tiny_dsv4 import SERVER, build, prompts  # noqa: E402

MAX_NEW = 32
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_tiny_deepseek_v4_on_a_gpu_agrees_with_the_reference(tmp_path, monkeypatch, graphs):
    logs = Path(os.environ.get("MUSA_ATTN_SERVE_LOGS", tmp_path))
    logs.mkdir(parents=True, exist_ok=True)
    # the MUSA situation: our V4 model-side kernels; every other fused op of SGLang's in torch (its AOT/JIT CUDA
    # forms are absent), the radix tree in Python, no DeepGEMM JIT; Triton MoE runner (SGLang's V4 override picks
    # FlashInfer's MXFP4 runner on sm_90 otherwise); the bf16 routed experts are ours (model_hooks)
    for name, value in (("MUSA_ATTN_MODEL_KERNELS", "on"), ("SGLANG_FORCE_FUSED_OP_BACKEND", "torch"),
                        ("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python"), ("SGLANG_ENABLE_JIT_DEEPGEMM", "0")):
        monkeypatch.setenv(name, value)
    model = build(tmp_path / "tiny-v4", weights=True)
    config = json.loads((model / "config.json").read_text())
    ref = Reference(config, load(model))
    asks = prompts(config["vocab_size"])
    log = logs / f"sglang-gpu-{'graphs' if graphs else 'eager'}.log"
    extra = [*SERVER["extra"], "--sampling-backend", "pytorch", "--moe-runner-backend", "triton", "--skip-tokenizer-init",
             *(["--cuda-graph-max-bs-decode", "4"] if graphs else ["--disable-cuda-graph"])]
    with sglang_server(model, "tilelang_musa", log=log, shim_log=logs / "shim.log", device="cuda", shim=None,
                       page_size=SERVER["page_size"], max_total_tokens=SERVER["max_total_tokens"],
                       startup_timeout=SERVER["startup_timeout"], extra=extra) as base:
        names = ["short", "long", "shared"]
        batch = post(base + "/generate", {"input_ids": [asks[n] for n in names], "sampling_params": GREEDY,
                                          "return_logprob": True, "logprob_start_len": 0}, timeout=600)
    results = {}
    for name, out in zip(names, batch):
        ids = out["output_ids"]
        assert len(ids) == MAX_NEW, f"{name}: {len(ids)} tokens"
        res = agreement(ref, asks[name] + ids, served_logprobs(out), len(asks[name]))
        results[name] = {k: v for k, v in res.items() if k != "failures"}
        assert not res["failures"], f"{name} disagrees with the reference V4 forward: {res}"
    (logs / f"sglang-gpu-{'graphs' if graphs else 'eager'}.json").write_text(json.dumps(results, indent=1))
    text = log.read_text(errors="replace")
    assert "TileLangMusaDSV4Backend" in text and "DeepSeek-V4 model kernels replaced on cuda" in text
