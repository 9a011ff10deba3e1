"""CPU checks of benchmarks/bench_sglang_dsv4.py (our V4 backend through SGLang's V4 kit fixtures): the smoke run
writes the JSON the GPU run writes, and its tensor-op forward batch equals the kit's own, field by field."""


import pytest
import torch

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("bench_sglang_dsv4")


def test_smoke_run_writes_the_json(bench, smoke_doc):
    kit = bench.import_kit()
    before = (kit.DeepSeekV4TokenToKVPool, kit._make_forward_batch)
    doc = smoke_doc(bench, "sglang-dsv4-smoke")
    assert (kit.DeepSeekV4TokenToKVPool, kit._make_forward_batch) == before  # the kit is left as it was
    assert {r["shape"]["compress_ratio"] for r in doc["rows"]} == {0, 4, 128}
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert r["kernel_calls"] >= 1 and r["layer_ms"] > 0 and r["kernel_ms"] > 0
        assert r["peers"]["standalone_kernel"] == r["kernel_ms"]


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_forward_batch_equals_the_kits(bench, mode):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    kit = bench.import_kit()
    original = kit._make_forward_batch
    assert original is not bench.make_forward_batch
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    case = kit.DSV4AttentionCase(name="x", backend=bench.OURS, forward_mode=fm, num_heads=16, page_size=256,
                                 prefix_lens=(5, 300, 0), extend_lens=() if mode == "decode" else (7, 1, 20),
                                 compress_ratio=0)
    batches = []
    for make in (original, bench.make_forward_batch):
        fixture = kit.build_dsv4_attention_fixture(bench._TC(), case, swa_size=2048, max_context_len=512,
                                                   device="cpu")
        runner = fixture.runner
        batches.append((make(case, runner, max_context_len=512, device="cpu"),
                        runner.req_to_token_pool.req_to_token.clone()))
    (a, ta), (b, tb) = batches
    assert torch.equal(ta, tb)
    for field in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions", "input_ids"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.seq_lens_sum == b.seq_lens_sum and a.batch_size == b.batch_size
    if mode == "extend":
        for field in ("extend_prefix_lens", "extend_seq_lens", "extend_start_loc"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert a.extend_prefix_lens_cpu == b.extend_prefix_lens_cpu and a.extend_num_tokens == b.extend_num_tokens
