"""SGLang 0.5.23 serving a tiny local Llama over real HTTP with ``--attention-backend tilelang_musa`` (found
only through our installed entry point), token-for-token equal to the same server on ``torch_native``
(float32, greedy). Runs on a CPU (the reference ops); on a GPU machine the same test runs the kernels.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

from sglang_server import post, sglang_server  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

LONG = " ".join(f"token{i} is followed by" for i in range(90))  # several hundred tokens: many 16-slot pages
SHARED = "A shared system prompt that both requests start with, long enough to fill a few pages of the cache. "


def _session(base):
    res = {}
    res["generate"] = post(base + "/generate", {"text": "The attention backend", "sampling_params": {
        "temperature": 0, "max_new_tokens": 16}})["output_ids"]
    batch = post(base + "/generate", {"text": ["Hello", "Paged attention reads", "A much longer prompt " * 5],
                                      "sampling_params": {"temperature": 0, "max_new_tokens": 10}})
    res["batch"] = [b["output_ids"] for b in batch]
    res["long"] = post(base + "/generate", {"text": LONG, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})["output_ids"]
    first = post(base + "/generate", {"text": SHARED + "First question?", "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})
    second = post(base + "/generate", {"text": SHARED + "Second question?", "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})
    res["prefix"] = [first["output_ids"], second["output_ids"]]
    res["prefix_cached_tokens"] = second["meta_info"]["cached_tokens"]
    comp = post(base + "/v1/completions", {"model": "tiny", "prompt": "Kernels written in", "max_tokens": 12,
                                           "temperature": 0})
    res["completions"] = comp["choices"][0]["text"]
    chat = post(base + "/v1/chat/completions", {"model": "tiny", "max_tokens": 12, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Say something."}]})
    res["chat"] = chat["choices"][0]["message"]["content"]
    return res


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_tilelang_musa_server_matches_torch_native(tiny_model, tmp_path):
    shim_log = tmp_path / "sgl_kernel_calls.log"
    outputs = {}
    for backend in ("torch_native", "tilelang_musa"):
        with sglang_server(tiny_model, backend, log=tmp_path / f"{backend}.log", shim_log=shim_log) as base:
            outputs[backend] = _session(base)
    ref, ours = outputs["torch_native"], outputs["tilelang_musa"]
    assert ours["generate"] and len(ours["generate"]) == 16
    assert ours["prefix_cached_tokens"] > 0, "the radix cache was not hit by the shared prefix"
    for key in ("generate", "batch", "long", "prefix", "completions", "chat"):
        assert ours[key] == ref[key], f"{key}: tilelang_musa {ours[key]!r} != torch_native {ref[key]!r}"
    assert not shim_log.exists() or not shim_log.read_text().strip(), \
        f"sgl_kernel shim functions were called: {shim_log.read_text()}"
    log = (tmp_path / "tilelang_musa.log").read_bytes().decode(errors="replace")
    assert "'attention_backend': 'tilelang_musa'" in log


def test_sgl_kernel_shim_stubs_record_and_raise(tmp_path):
    """The shim provides only the listed names, and calling one is recorded and fails loudly."""
    from sglang_server import SHIM

    code = ("import sgl_kernel as k\n"
            "assert k.SHIM and 'assign_req_to_token_pool_cpu' in k.FUNCTIONS\n"
            "try:\n    k.copy_all_layer_kv_cache_cpu(1)\nexcept NotImplementedError:\n    pass\n"
            "else:\n    raise SystemExit('stub did not raise')\n"
            "try:\n    from sgl_kernel import not_a_kernel\nexcept ImportError:\n    print('OK')\n")
    log = tmp_path / "calls.log"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(SHIM), SGL_KERNEL_SHIM_LOG=str(log)))
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr
    assert log.read_text().split() == ["sgl_kernel.copy_all_layer_kv_cache_cpu"]
