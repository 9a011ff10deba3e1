"""benchmarks/bench_moe.py --smoke on a CPU: the harness routes, lays out, runs both layouts (references) and
writes the documented JSON."""


def test_smoke_writes_json(smoke_doc):
    doc = smoke_doc("bench_moe", "moe-smoke")
    assert {r["op"] for r in doc["rows"]} == {"moe_gate_up", "moe_down", "moe_layer"}
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert "ours_ms" in r and "ours_fp4_ms" in r
        if r["op"] == "moe_layer":
            assert set(r["ours_paths_ms"]) == {"torch", "pass", "fused"} and set(r["ours_glue_ms"]) == {"kernels", "torch"}
            assert set(r["ours_route_ms"]) == ({"kernel", "torch"} if r["shape"]["T"] <= 64 else set()), r
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


def test_deepgemm_peer_is_checked_against_our_fp8_answer(load_bench, monkeypatch):
    """The DeepGEMM rows compare DeepGEMM's output with our FP8 GEMM's, computed afresh: on the H200 run of
    2026-12-06 the comparison read buffers the FP4 programs had overwritten and reported calc_diff ~1. A stand-in
    ``deep_gemm`` computing the true products must agree (calc_diff ~0), and one that scales its answer must not."""
    import sys
    import types

    import torch

    from musa_attn_backend.kernels import moe

    bench = load_bench("bench_moe")
    E, N, K, T = 4, 256, 256, 9
    b, sb = bench.random_fp8_weights(E, N, K, "cpu")
    ids = torch.rand(T, E).topk(bench.TOPK if E >= bench.TOPK else 2, dim=1).indices.to(torch.int32)
    row_src, layout = moe.align_routing(ids, E)
    a, sa = moe.quantize_groups(torch.randn(T, K).to(torch.bfloat16)[(row_src.clamp(min=0) // ids.shape[1]).long()])
    counts = torch.bincount(ids.flatten().long(), minlength=E).to(torch.int32)
    am = torch.randn(E, 32, K).to(torch.float8_e4m3fn)
    sam = torch.rand(E, 32, K // 128) + 0.5
    masked = (am, sam, counts, torch.full((E, 32, N), float("nan"), dtype=torch.bfloat16))

    def stand_in(scale):
        def contiguous(aa, bb, d, lay):
            d.copy_(moe.grouped_gemm_fp8(*aa, *bb, lay) * scale)

        def masked_gemm(aa, bb, d, m, expected):
            d.copy_(moe.grouped_gemm_fp8_masked(*aa, *bb, m).nan_to_num() * scale)
        return types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=contiguous,
                                     m_grouped_fp8_gemm_nt_masked=masked_gemm)

    for scale, agrees in ((1.0, True), (-1.0, False)):
        monkeypatch.setitem(sys.modules, "deep_gemm", stand_in(scale))
        row = {"peers": {}}
        bench.deepgemm_peers(row, a, sa, b, sb, layout, masked, T, E, lambda fn: (fn(), 0.0)[1])
        for name in ("deepgemm", "deepgemm_masked"):
            peer = row["peers"][name]
            assert "error" not in peer, peer
            assert (peer["calc_diff"] < 1e-6) == agrees, (name, scale, peer)


def test_tilings_are_applied_and_recorded(load_bench, tmp_path, monkeypatch):
    """``--tiling`` / ``--masked-tiling``: the programs' tilings for the run, in the JSON as the run used them
    (restored afterwards: they are module state)."""
    import json

    from musa_attn_backend.kernels.moe import tilelang_impl

    monkeypatch.setattr(tilelang_impl, "CONTIGUOUS", dict(tilelang_impl.CONTIGUOUS))
    monkeypatch.setattr(tilelang_impl, "MASKED", dict(tilelang_impl.MASKED))
    monkeypatch.setattr(tilelang_impl, "LARGE_M_STAGES", tilelang_impl.LARGE_M_STAGES)
    bench = load_bench("bench_moe")
    assert bench.main(["--smoke", "--out", str(tmp_path), "--masked-tiling", "block_n=64",
                       "--tiling", "policy=FullRow,swizzle=8"]) == 0
    (path,) = tmp_path.glob("moe-smoke-*.json")
    doc = json.loads(path.read_text())
    assert doc["masked_tiling"]["block_n"] == 64 and doc["tiling"]["swizzle"] == 8
    assert doc["tiling"]["policy"] == "FullRow"
