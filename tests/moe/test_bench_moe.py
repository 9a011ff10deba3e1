"""benchmarks/bench_moe.py --smoke on a CPU: the harness routes, lays out, runs both layouts (references) and
writes the documented JSON."""

import json


def test_smoke_writes_json(tmp_path, load_bench):
    bench = load_bench("bench_moe")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe-smoke-*.json")
    doc = json.loads(path.read_text())
    for key in ("device", "commit", "date", "versions", "rows"):
        assert key in doc, key
    assert {r["op"] for r in doc["rows"]} == {"moe_gate_up", "moe_down", "moe_layer"}
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert "ours_ms" in r and "ours_fp4_ms" in r
        if r["op"] == "moe_layer":
            assert set(r["ours_paths_ms"]) == {"torch", "pass", "fused"} and set(r["ours_glue_ms"]) == {"kernels", "torch"}
            continue
        assert ("ours_gemm_swiglu_ms" in r and "ours_swiglu_quant_ms" in r) == (r["op"] == "moe_gate_up"), r
        assert "ours_ms" in r and "ours_masked_ms" in r and r["shape"]["rows"] == r["shape"]["T"] * 6
        forms = {"bytes", "words", "fp8", "fp8_spans2", "fp8_spans4"}
        assert set(r["ours_fp4_masked_forms_ms"]) == forms and set(r["ours_fp4_forms_ms"]) == forms
        assert r["shape"]["layout_rows"] % 128 == 0 and r["flops"] > 0


def test_triton_alignment_is_sglangs_layout(load_bench):
    """The peer's token alignment (SGLang's ``moe_align_block_size`` contract): every choice once, in its expert's
    blocks, padding marked ``T * k``, one expert id a block."""
    import torch

    bench = load_bench("bench_moe")
    ids = torch.randint(0, 8, (37, 3), dtype=torch.int32)
    sorted_ids, expert_ids, post = bench.triton_alignment(ids, 8, 16)
    assert int(post) == sorted_ids.numel() == expert_ids.numel() * 16
    real = sorted_ids[sorted_ids < ids.numel()].long()
    assert torch.equal(real.sort().values, torch.arange(ids.numel()))
    block_of = torch.nonzero(sorted_ids < ids.numel()).flatten() // 16
    assert torch.equal(ids.flatten()[real].long(), expert_ids[block_of].long())
