"""benchmarks/bench_vllm_backend.py --smoke in-process on a CPU: vLLM config objects, our builder + impl on the
benchmark's own batches and KV caches, against a plain-torch SDPA reference; JSON written as documented."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable here")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm_backend.py"


def test_smoke_writes_json_and_matches_reference(smoke_doc, capsys):
    doc = smoke_doc("bench_vllm_backend", "vllm-backend", ("device", "commit", "date", "torch", "tilelang", "vllm",
                                                           "timing", "rows"))
    assert doc["commit"] and doc["timing"]["statistic"] == "median"
    # TRITON_ATTN cannot run on a CPU, but its builder and impl construct and build metadata here
    assert doc["checks"]["TRITON_ATTN_cpu_construct"].startswith("ok"), doc["checks"]
    rows = doc["rows"]
    assert {r["op"] for r in rows} == {"decode", "prefill", "mixed"}
    assert {r["shape"]["page_size"] for r in rows} == {16, 64}
    for r in rows:
        assert "errors" not in r, r
        assert set(r["shape"]) == {"batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "page_size",
                                   "dtype"}
        assert r["ours_ms"] > 0 and r["peers"]["sdpa_reference"] > 0
        assert r["ratio"] == pytest.approx(r["peers"]["sdpa_reference"] / r["ours_ms"])
        assert r["timing_mode"] == "eager"
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-4 and r["close"], r
    mixed = next(r for r in rows if r["op"] == "mixed")
    assert mixed["shape"]["seqlen_q"] > 1 and mixed["shape"]["batch"] == 4
    assert "max|diff|" in capsys.readouterr().out  # the table


def test_batches_put_decodes_first_and_skip_large_decodes(load_bench):
    bench = load_bench("bench_vllm_backend")
    cases = bench.gpu_cases(["decode", "prefill", "mixed"])
    decodes = [c for c in cases if c.op == "decode"]
    assert all(len(c.reqs) * (c.reqs[0][1] + 1) <= bench.MAX_DECODE_TOKENS for c in decodes)
    assert len(decodes) == 11  # 4 batches x 3 contexts, 128 x 16k skipped
    mixed = next(c for c in cases if c.op == "mixed")
    b = bench.layout_batch(mixed, 16, seed=0)
    assert b.q_lens[:16] == [1] * 16 and b.q_lens[16:] == [512, 512]
    # blocks shuffled, unique, block 0 (vLLM's null block) unused
    used = [int(x) for row, s in zip(b.block_table, b.seq_lens) for x in row[: -(-s // 16)]]
    assert len(used) == len(set(used)) and 0 not in used and used != sorted(used)
    assert b.slot_mapping.numel() == b.num_tokens == 16 + 1024


def test_smoke_with_triton_attn_in_the_triton_interpreter(tmp_path):
    """TRITON_ATTN's real kernels (Triton's CPU interpreter) on the benchmark's caches and metadata agree with
    ours: the peer path of the GPU run (its layout, builder, impl and cache fill) checked without a GPU."""
    import importlib.util
    import os
    import subprocess

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    cmd = [sys.executable, str(BENCH), "--smoke", "--interpret-triton", "--ops", "decode,mixed", "--page-sizes", "16",
           "--warmup", "0", "--rep", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("vllm-backend-*.json")).read_text())
    assert doc["mode"] == "smoke+triton_interpreter" and len(doc["rows"]) == 2
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert r["max_abs_diff_by_peer"]["TRITON_ATTN"] < 1e-4, r
        assert r["max_abs_diff_by_peer"]["sdpa_reference"] < 1e-4, r
        assert r["kv_layout"] == {"TILELANG_MUSA": "LBNHC", "TRITON_ATTN": "LBNHC"}
