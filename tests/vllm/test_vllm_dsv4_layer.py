"""Our vLLM 0.33.0 DeepSeek-V4 layer (``musa_attn_backend.vllm.dsv4``) on a CPU, in fresh interpreters.

- Against the independent float32 V4 forward (:mod:`musa_attn_backend.testing.vllm_dsv4_layer`: the tiny V4's four
  layers, ratios 0/4/128/4, built by vLLM's constructors, caches planned and bound by vLLM's functions in one
  buffer of random bytes, three requests through chunked prefill, mixed, decode and two-token verify steps):
  every output finite; per layer and request, the mean |error| under 3% and the largest under 40% of the mean
  |output| (bf16 activations against float32: FP8 rows whose rounding flips on a bf16 difference dominate the
  largest errors, at the first positions where few rows are averaged). Checked on this fixture: dropping the
  sink, the compressed rows or shifting the RoPE table by one position each give mean errors of 4.5-43% or largest
  errors of 0.57-16 (0.57 the smallest: the C128 layer without its compressed rows). The indexer's choices
  (top-16 of up to 84 compressed rows) agree with the reference's own on at least 97% of the rows on average,
  80% at worst (FP8 rounding decides near ties).
- MUSA's vLLM's block rule (``cache_config.block_size`` forced to 64 after the backend is chosen): the main and
  indexer-key caches keep 256-token pages, the layer still matches the reference.
- Settings the layer does not serve are refused when it is built, naming the setting.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
TRACE_TARGETS = ("sm_90a", "mp_31")  # the kernels the layer's TileLang paths ask for on each (report["kernels"])


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                VLLM_TARGET_DEVICE="cpu")


def _run_layer(tmp_path_factory, *args):
    out = tmp_path_factory.mktemp("vllm_v4_layer") / "report.json"
    run = subprocess.run([sys.executable, "-m", "musa_attn_backend.testing.vllm_dsv4_layer", str(out), "cpu", *args],
                         capture_output=True, text=True, env=_env(), timeout=900, cwd=ROOT)
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return _run_layer(tmp_path_factory, ",".join(TRACE_TARGETS))


@pytest.fixture(scope="module")
def report_block64(tmp_path_factory):
    """The same run with MUSA's vLLM's rule applied: ``cache_config.block_size`` forced to 64 after the engine
    config (its platform's ``check_and_update_config`` does this for every model with ``index_topk``)."""
    return _run_layer(tmp_path_factory, "", "64")


def test_layer_matches_the_reference_forward(report):
    check_layers(report)


def test_builders_declare_cuda_graphs_and_keep_their_metadata_in_place(report):
    """Every V4 group's builder declares UNIFORM_BATCH (vLLM's full decode graphs), and the metadata tensors it makes
    stay at one address across the five steps (what a captured graph reads at replay)."""
    assert set(report["cudagraph_support"]) == {"UNIFORM_BATCH"} and len(report["cudagraph_support"]) >= 5, report["groups"]
    assert report["persistent_metadata"]


def test_layer_serves_musas_64_token_blocks(report_block64):
    """With --block-size 64 the main and indexer-key caches keep their 256-token pages (C4 64 rows, C128 2,
    indexer 64), the SWA cache its 64, and the layer still matches the reference."""
    assert report_block64["block_size"] == 64
    views = report_block64["views"]
    assert views["model.layers.1.attn"][0][1:] == [64, 584] and views["model.layers.2.attn"][0][1:] == [2, 584]
    assert views["model.layers.1.attn.indexer.k_cache"][0][1:] == [64, 132]
    assert views["model.layers.0.attn.swa_cache"][0][1:] == [64, 584]
    assert sorted({g[0] for g in report_block64["groups"]}) == [4, 8, 64, 256]
    check_layers(report_block64)


def check_layers(report):
    layers = report["layers"]
    assert sorted(layers) == ["0", "1", "2", "3"]
    for name, rows in layers.items():
        assert len(rows) == 3
        for row in rows:
            assert row["finite"], (name, row)
            assert row["mean_err"] < 0.03 and row["max_err"] < 0.4, (name, row)


@pytest.mark.parametrize("target", TRACE_TARGETS)
def test_the_warmup_plan_holds_every_kernel_the_layer_asks_for(report, target):
    """``musa-attn warmup`` for vLLM is complete: every kernel the V4 layer's steps asked for (chunked prefill,
    mixed, decode, verify; all four layer kinds), recorded by the CPU trace, is in the plan of the layer's model
    (the tiny V4 with the driver's top-k) on ``target``; the plan of another model lacks some."""
    from musa_attn_backend import _tilelang, config, warmup, warmup_dsv4
    from musa_attn_backend.kernels.dsv4.sparse.tilelang_impl import sparse_mqa_program
    from musa_attn_backend.testing.vllm_dsv4_layer import TOPK

    sys.path.insert(0, str(ROOT / "integration_tests"))
    from tiny_dsv4 import CONFIG

    def plan_keys(cfg):
        keys = []
        with config.override(target=target), _tilelang.intercepting(lambda k, b, t, p: keys.append(repr(k))):
            for job in warmup_dsv4.plan(warmup_dsv4.from_hf_config(cfg), engine="vllm",
                                        target_kind="musa" if target.startswith("mp") else "cuda"):
                warmup._build(job)
        return set(keys)

    want = set(report["kernels"][target])
    kinds = {k.split("'")[1] for k in want}
    with config.override(target=target):
        attention = "dsv4_sparse_mqa_sched" if sparse_mqa_program() == "scheduled" else "dsv4_sparse_mqa"
    assert {attention, "dsv4_write_kv", "dsv4_compress_rows", "dsv4_save_state", "dsv4_indexer_q",
            "dsv4_paged_indexer_logits", "dsv4_indexer_topk", "dsv4_norm_rope", "dsv4_attention_slots"} <= kinds
    missing = want - plan_keys(dict(CONFIG, index_topk=TOPK))
    assert not missing, f"kernels vLLM's V4 layer asks for that the warmup plan lacks on {target}: {missing}"
    assert want - plan_keys(dict(CONFIG, index_topk=2 * TOPK))


def test_indexer_chooses_the_references_rows(report):
    for name in ("1", "3"):  # the C4 layers
        rows = report["layers"][name]
        assert sum(r["scored_tokens"] for r in rows) > 300, rows  # the indexer scored, not just filled
        for row in rows:
            assert row["topk_overlap_mean"] >= 0.97 and row["topk_overlap_min"] >= 0.8, (name, row)


REFUSALS = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from tiny_dsv4 import CONFIG
from vllm.config import set_current_vllm_config
from musa_attn_backend.testing import vllm_dsv4 as fx
from musa_attn_backend.vllm.dsv4 import MusaDeepseekV4Attention

cases = {
    "kv bf16": (dict(kv_cache_dtype="bfloat16"), {}),
    "kv e5m2": (dict(kv_cache_dtype="fp8_e5m2"), {}),
    "fp16": (dict(dtype="float16"), {}),
    "index heads": ({}, dict(index_n_heads=8)),
    "topk": ({}, dict(index_topk=4096)),
}
out, first = {}, True
for name, (args, conf) in cases.items():
    try:
        vc = fx.engine_config(dict(CONFIG, **conf), **args)
    except Exception as e:  # vLLM refused it itself
        out[name] = "vllm: " + str(e)[:300]
        continue
    with set_current_vllm_config(vc):
        if first:
            fx.init_distributed()
            first = False
        try:
            MusaDeepseekV4Attention(vc, prefix="model.layers.1.attn")
            out[name] = "built"
        except ValueError as e:
            out[name] = str(e)
print("REFUSALS " + json.dumps(out))
'''


def test_unsupported_settings_are_refused_by_name(tmp_path):
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    run = subprocess.run([sys.executable, str(script), str(ROOT / "integration_tests")], capture_output=True,
                         text=True, env=_env(), timeout=600)
    lines = [x for x in run.stdout.splitlines() if x.startswith("REFUSALS ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("REFUSALS "):])
    want = {"kv bf16": "--kv-cache-dtype", "kv e5m2": "--kv-cache-dtype", "fp16": "--dtype bfloat16", "index heads": "the indexer needs", "topk": "index_topk"}
    for name, phrase in want.items():
        assert got[name].startswith("tilelang_musa:") and phrase in got[name], (name, got[name])
