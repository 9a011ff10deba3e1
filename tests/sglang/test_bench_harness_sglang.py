"""CPU checks of benchmarks/bench_sglang_backend.py (ours vs SGLang backends through SGLang's attention kit).

The smoke mode runs end to end in-process (tiny fp32 shapes, ``torch_native`` as the peer, perf_counter
timing) and must write the JSON the GPU run writes, with both backends agreeing. The vectorised
``ForwardBatch`` builder is checked field by field against the kit's own ``_make_forward_batch``, and the
GPU configuration (32/8 heads, head dim 128, bf16, page 64) is built as far as a CPU allows, including
SGLang's ``TritonAttnBackend`` on the kit runner.
"""

import sys
import types

import pytest
import torch

try:
    import sglang  # noqa: F401
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention  # noqa: F401
except Exception as e:  # pragma: no cover - environment without SGLang
    pytest.skip(f"SGLang or its attention test kit does not import ({type(e).__name__}: {e})",
                allow_module_level=True)


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("bench_sglang_backend")


@pytest.fixture(scope="module")
def kit(bench):
    return bench.import_sglang(["torch_native"], "cpu")


SHAPE_KEYS = {"batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "page_size", "dtype"}


def test_smoke_run_writes_the_json(bench, smoke_doc, capsys):
    doc = smoke_doc(bench, "sglang-backend", ("device", "commit", "date", "torch", "tilelang", "sglang", "timing",
                                              "rows"))
    assert doc["timing"] in ("graph", "eager")
    assert doc["timing"] == "eager"  # CPU
    assert doc["commit"] and doc["sglang"] != "unknown"
    rows = doc["rows"]
    assert {r["op"] for r in rows} == {"decode", "extend"}
    assert {r["shape"]["page_size"] for r in rows} == {1, 4}
    for r in rows:
        assert "errors" not in r, r
        assert set(r["shape"]) >= SHAPE_KEYS
        assert r["shape"]["dtype"] == "float32"
        assert r["ours_ms"] > 0
        assert set(r["peers"]) == {"torch_native"} and r["peers"]["torch_native"] > 0
        assert r["ratio"] == pytest.approx(r["peers"]["torch_native"] / r["ours_ms"])
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-4, r
        assert r["agree"] is True
        assert r["timing"] == "eager"
        if r["op"] == "decode":
            assert r["shape"]["seqlen_q"] == 1
    assert "ours ms" in capsys.readouterr().out  # the table


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_forward_batch_matches_the_kits(bench, kit, op, page_size):
    """Our vectorised builder == the kit's per-token ``_make_forward_batch`` for the same slot layout."""
    shape = bench.Shape(op, 3, 6 if op == "decode" else 5, 1 if op == "decode" else 4, 4, 2, 16, page_size,
                        torch.float32)
    case = bench.make_case(kit, shape, bench.OURS)
    max_ctx = bench.context_len_for(case)
    runner = bench.make_runner(kit, case, dtype=torch.float32, device="cpu", head_dim=16, max_context_len=max_ctx)
    try:
        locs = bench.shuffled_page_locs(case, max_ctx, seed=3)
        # a bijection onto whole pages of the kit's slot blocks, never slot 0, pages kept intact
        used = torch.cat([locs[r, :s] for r, s in enumerate(case.seq_lens)])
        assert used.unique().numel() == used.numel() and int(used.min()) >= page_size
        assert bool(((locs[:, 1:] - locs[:, :-1])[:, (torch.arange(locs.shape[1] - 1) + 1) % page_size != 0]
                     == 1).all())
        theirs = kit._make_forward_batch(case, runner, max_context_len=max_ctx, device="cpu",
                                         loc_fn=lambda r, p: int(locs[r, p]))
        r2t_theirs = runner.req_to_token_pool.req_to_token.clone()
        runner.req_to_token_pool.req_to_token.zero_()
        ours = bench.make_forward_batch(case, runner, locs, "cpu")
        assert torch.equal(runner.req_to_token_pool.req_to_token, r2t_theirs)
        assert ours.forward_mode == theirs.forward_mode and ours.batch_size == theirs.batch_size
        assert ours.seq_lens_sum == theirs.seq_lens_sum
        for name in ("input_ids", "req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions",
                     "extend_prefix_lens", "extend_seq_lens"):
            a, b = getattr(ours, name), getattr(theirs, name)
            if b is None:
                assert a is None, name
                continue
            assert a.dtype == b.dtype and torch.equal(a, b), name
        for name in ("extend_prefix_lens_cpu", "extend_seq_lens_cpu", "extend_num_tokens"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert type(ours.kv_loc_plan) is type(theirs.kv_loc_plan)
    finally:
        runner._server_args_override.restore()


def test_gpu_configuration_builds_on_cpu(bench, kit):
    """The GPU run's model configuration (32/8 heads, head dim 128, page 64) with the GPU peer: runner, kit
    layer, batch and both backends (SGLang's TritonAttnBackend included) construct; bf16 -> fp32 on a CPU."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    shapes, skipped = bench.gpu_shapes(["decode", "extend"], [1, 64], 2 * 1024 * 1024)
    assert not skipped and len(shapes) == 2 * (12 + 3)
    assert all(s.dtype == torch.bfloat16 and (s.heads_q, s.heads_kv, s.head_dim) == (32, 8, 128) for s in shapes)
    assert {(s.batch, s.seqlen_k) for s in shapes if s.op == "decode"} == {
        (b, c) for b in (1, 8, 32, 128) for c in (1024, 4096, 16384)}
    _, skipped = bench.gpu_shapes(["decode"], [1], 1024 * 1024)
    assert {(s.batch, s.seqlen_k) for s in skipped} == {(128, 16384)}

    shape = bench.Shape("decode", 2, 100, 1, 32, 8, 128, 64, torch.float32)
    case = bench.make_case(kit, shape, bench.OURS)
    max_ctx = bench.context_len_for(case)
    runner = bench.make_runner(kit, case, dtype=torch.float32, device="cpu", head_dim=128, max_context_len=max_ctx)
    try:
        fb = bench.make_forward_batch(case, runner, bench.shuffled_page_locs(case, max_ctx, 0), "cpu")
        triton_backend = ATTENTION_BACKENDS["triton"](runner)
        assert type(triton_backend).__name__ == "TritonAttnBackend"
        assert triton_backend.page_size == 64 and triton_backend.num_head == 32 and triton_backend.num_kv_head == 8
        ours = ATTENTION_BACKENDS[bench.OURS](runner)
        ours.init_forward_metadata(fb)
    finally:
        runner._server_args_override.restore()
    import bench_attention  # the GPU timer's CUDA-event helper imports here too

    assert callable(bench_attention.bench_ms)


def test_a_failing_backend_is_recorded_and_the_row_still_times_ours(bench, kit):
    shape = bench.Shape("extend", 2, 3, 5, 4, 2, 16, 1, torch.float32)
    with torch.no_grad():
        row = bench.run_row(kit, shape, ["no_such_backend"], device="cpu", timing="eager", warmup=0, rep=1)
    assert "no_such_backend" in row["errors"]
    assert row["ours_ms"] > 0 and row["peers"] == {} and row["ratio"] is None and row["max_abs_diff"] is None


def test_commit_prefers_the_stamp_file(bench, tmp_path, monkeypatch, use_settings):
    import bench_attention

    monkeypatch.setattr(bench_attention, "HERE", tmp_path / "benchmarks")
    use_settings(commit=None)
    (tmp_path / ".commit").write_text("abc1234+wip\n")
    assert bench.git_commit() == "abc1234+wip"
    (tmp_path / ".commit").unlink()
    (tmp_path / "benchmarks").mkdir()
    assert bench.git_commit() == "unknown"  # tmp_path is no git checkout


def _fake_capture(fail_for=None):
    """Stand-in for ``capture_graph`` on a CPU: "replay" re-runs the call in the backend's forward context
    (a real graph needs none); raises for the backend class named ``fail_for``."""
    from sglang.srt.model_executor.forward_context import forward_context, get_forward_context

    def capture(fn):
        ctx = get_forward_context()
        if fail_for and type(ctx.attn_backend).__name__ == fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")

        def replay():
            with forward_context(ctx):
                fn()

        return types.SimpleNamespace(replay=replay)

    return capture


def test_graph_timing_when_every_capture_works(bench, kit, monkeypatch):
    monkeypatch.setattr(bench, "capture_graph", _fake_capture())
    shape = bench.Shape("decode", 2, 7, 1, 4, 2, 16, 1, torch.float32)
    with torch.no_grad():
        row = bench.run_row(kit, shape, ["torch_native"], device="cpu", timing="graph", warmup=0, rep=1)
    assert row["timing"] == "graph" and "errors" not in row and "notes" not in row
    assert row["ours_ms"] > 0 and row["peers"]["torch_native"] > 0


def test_one_failed_capture_times_the_whole_row_eagerly(bench, kit, monkeypatch):
    monkeypatch.setattr(bench, "capture_graph", _fake_capture(fail_for="TorchNativeAttnBackend"))
    shape = bench.Shape("extend", 2, 3, 4, 4, 2, 16, 4, torch.float32)
    with torch.no_grad():
        row = bench.run_row(kit, shape, ["torch_native"], device="cpu", timing="graph", warmup=0, rep=1)
    assert row["timing"] == "eager" and "errors" not in row
    assert any("torch_native: CUDA graph capture failed" in n for n in row["notes"]), row["notes"]
    assert row["ours_ms"] > 0 and row["peers"]["torch_native"] > 0


def test_pdl_helper_shim_for_an_import_only_sgl_kernel_stub(bench, monkeypatch):
    from sglang.kernels.jit.utils import is_arch_support_pdl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.delitem(sys.modules, "sgl_kernel.utils", raising=False)
    notes = []
    try:
        bench.ensure_sgl_kernel_pdl_helper(notes)
        from sgl_kernel.utils import is_arch_support_pdl as shimmed

        assert shimmed is is_arch_support_pdl and notes
    finally:
        sys.modules.pop("sgl_kernel.utils", None)
