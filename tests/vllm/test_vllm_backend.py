"""vLLM 0.33 ``TILELANG_MUSA``: registration (incl. fork/spawn workers) and builder + impl on CPU vs SDPA,
following vLLM's own backend-test pattern (mixed decode/prefill/extend batch, shuffled blocks, NHD cache)."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from musa_attn_backend.testing import dense_attention, random_batch  # noqa: E402
from musa_attn_backend.testing.numeric import assert_close  # noqa: E402

REGISTER = """
from vllm.plugins import load_general_plugins
load_general_plugins()
"""


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_selection_survives_fork_and_spawn_workers(method, tmp_path):
    """The parent selects tilelang_musa; a worker started with ``method`` unpickles the config (before any
    plugin loads there) and gets the same backend class."""
    # Plugins load only in the parent (inside the main guard): a spawned child re-imports this file as
    # __mp_main__ and must unpickle the config without having loaded any plugin, as vLLM's workers do.
    code = f"""
import multiprocessing as mp

def worker(cfg, q):
    q.put((cfg.backend.name, cfg.backend.get_class().__name__))

if __name__ == "__main__":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config.attention import AttentionConfig
    cfg = AttentionConfig(backend="tilelang_musa")
    ctx = mp.get_context("{method}")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(cfg, q))
    p.start()
    print("RESULT", q.get(timeout=240))
    p.join(60)
    assert p.exitcode == 0, p.exitcode
"""
    # spawn re-imports __main__, so the parent runs from a file
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(code))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "RESULT ('TILELANG_MUSA', 'TileLangMusaBackend')" in res.stdout, res.stdout[-1500:] + res.stderr[-3000:]


def test_names_resolve_after_plugin_load():
    res = _run(REGISTER + """
from vllm.config.attention import AttentionConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
for name in ("tilelang_musa", "TILELANG_MUSA"):
    assert AttentionConfig(backend=name).backend is AttentionBackendEnum.TILELANG_MUSA
cls = AttentionBackendEnum.TILELANG_MUSA.get_class()
import torch
ok = cls.validate_configuration(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
    use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
    device_capability=None, attn_type="decoder")
bad = cls.validate_configuration(head_size=72, dtype=torch.int8, kv_cache_dtype="fp8_e5m2", block_size=16,
    use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
    device_capability=None, attn_type="decoder")
print("OK", ok, len(bad))
""")
    assert "OK [] " in res.stdout, res.stdout[-1500:] + res.stderr[-3000:]
    assert int(res.stdout.split("OK [] ")[1].split()[0]) >= 3  # head size, dtype, kv dtype, MLA refused


def _common_metadata(batch, device="cpu"):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    v = batch.vllm_view()
    return CommonAttentionMetadata(
        query_start_loc=v["query_start_loc"], query_start_loc_cpu=v["query_start_loc"].cpu(),
        seq_lens=v["seq_lens"], num_reqs=batch.batch_size, num_actual_tokens=batch.num_tokens,
        max_query_len=max(batch.query_lens), max_seq_len=max(batch.seq_lens), block_table_tensor=v["block_table"],
        slot_mapping=v["slot_mapping"], causal=True, seq_lens_cpu_upper_bound=v["seq_lens"].cpu())


def _builder_impl_vs_reference(hq, hkv, block, opts, *, device="cpu", dtype=torch.float32, d=64,
                               query_lens=(1, 1, 1, 37, 20), prefix_lens=(30, 77, 5, 0, 44), max_seq_len=120):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    rng = random.Random(hq * 100 + block)
    # decodes first (vLLM reorders them to the front), then a fresh prefill and an extend with a prefix
    batch = random_batch(rng, batch_size=len(query_lens), page_size=block, max_seq_len=max_seq_len,
                         query_lens=list(query_lens), prefix_lens=list(prefix_lens), device=device)
    vllm_config = VllmConfig()
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=d, dtype=dtype)
    builder = TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], vllm_config, torch.device(device))
    md = builder.build(0, _common_metadata(batch, device))
    sinks = torch.randn(hq, device=device) if opts.get("sinks") else None
    window = opts.get("sliding_window")
    with set_current_vllm_config(vllm_config):
        impl = TileLangMusaBackend.get_impl_cls()(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv,
                                                  alibi_slopes=None, sliding_window=window, kv_cache_dtype="auto",
                                                  logits_soft_cap=opts.get("logits_soft_cap"), sinks=sinks)
    # vLLM's NHD storage [blocks, block, H, 2D], seen logically as [blocks, H, block, 2D]. Blocks no request
    # owns are NaN; owned blocks start as large finite junk (vLLM zero-allocates its cache and reuses slots,
    # so slots past a sequence end hold stale finite values, which whole-block loads read and mask).
    kv_cache = (1000 * torch.randn((batch.num_pages, block, hkv, 2 * d), device=device)).to(dtype)
    owned = torch.zeros(batch.num_pages, dtype=torch.bool)
    owned[[p for pages in batch.pages for p in pages]] = True
    kv_cache[~owned.to(device)] = float("nan")
    kv_cache = kv_cache.permute(0, 2, 1, 3)
    _, _, ks, vs = batch.make_kv(hkv, d, dtype)
    layer = type("L", (), {})()
    # the cached prefixes, written by the backend's own writer
    prefix_slots = torch.tensor([batch.slot(b, p) for b, n in enumerate(batch.prefix_lens) for p in range(n)],
                                device=device)
    if len(prefix_slots):
        impl.do_kv_cache_update(layer, torch.cat([k[:p] for k, p in zip(ks, batch.prefix_lens)]),
                                torch.cat([v[:p] for v, p in zip(vs, batch.prefix_lens)]), kv_cache, prefix_slots)
    key = torch.cat([k[p:] for k, p in zip(ks, batch.prefix_lens)])
    value = torch.cat([v[p:] for v, p in zip(vs, batch.prefix_lens)])
    impl.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
    query = torch.randn(batch.num_tokens, hq, d, device=device).to(dtype)
    output = torch.full((batch.num_tokens, hq, d), float("nan"), dtype=dtype, device=device)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    assert not output.isnan().any(), "unwritten output rows"
    assert impl.forward(layer, query, key, value, kv_cache, None, output.clone()).abs().sum() == 0  # profiling
    cu = 0
    for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
        ref = dense_attention(query[cu: cu + n].float(), ks[b].float(), vs[b].float(), prefix_len=p, causal=True,
                              sm_scale=d ** -0.5, sliding_window=window - 1 if window else None)
        if opts.get("logits_soft_cap") or sinks is not None:  # SDPA has neither: the reference op is the truth
            from musa_attn_backend.kernels import paged_attention

            ref = paged_attention(query, kv_cache.transpose(1, 2).split(d, -1)[0],
                                  kv_cache.transpose(1, 2).split(d, -1)[1], md.meta, sm_scale=d ** -0.5,
                                  logit_softcap=opts.get("logits_soft_cap"), sinks=sinks,
                                  impl="reference")[cu: cu + n].float()
        # the kernel bound of the output dtype: float32 (CPU, the reference through the impl) 1e-4, bf16 2e-2
        assert_close(output[cu: cu + n], ref, dtype)
        cu += n


@pytest.mark.parametrize("hq,hkv,block", [(8, 2, 16), (4, 4, 32), (8, 1, 1)])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 24}, {"logits_soft_cap": 20.0}, {"sinks": True}])
def test_builder_and_impl_match_sdpa_on_mixed_batch(hq, hkv, block, opts):
    _builder_impl_vs_reference(hq, hkv, block, opts)


def test_impl_writes_vllm_output_in_place(monkeypatch):
    """The impl hands vLLM's preallocated output (its real rows) to the kernels as ``out=``: the result is
    written there, not copied from a tensor of our own (the helper fills the output with NaN, then checks that
    every row was written with the right values)."""
    from musa_attn_backend.vllm import backend as vb

    calls = []
    real = vb.paged_attention

    def spy(q, k_cache, v_cache, meta, **kw):
        res = real(q, k_cache, v_cache, meta, **kw)
        calls.append((kw.get("out"), res))
        return res

    monkeypatch.setattr(vb, "paged_attention", spy)
    _builder_impl_vs_reference(8, 2, 16, {})
    assert calls, "the impl did not call paged_attention"
    for out, res in calls:
        assert out is not None and res is out
        assert out.shape[1:] == (8, 64) and out.is_contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["one_launch", "split_mixed"])
@pytest.mark.parametrize("hq,hkv,block", [(32, 8, 16), (32, 8, 128), (8, 1, 64), (16, 16, 1)])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 100}, {"logits_soft_cap": 30.0}, {"sinks": True}])
def test_builder_and_impl_on_gpu_run_tilelang(gpu_device, hq, hkv, block, opts, split, monkeypatch, use_settings):
    """vLLM's real builder/impl classes on the GPU: the TileLang kernels (KV write, decode, prefill incl. the
    whole-page copy path at block 128) on a mixed batch with long prefixes, bf16, vs float32 math; the mixed
    batch in one prefill launch (``MUSA_ATTN_SPLIT_MIXED=0``), or (the default) its leading decodes in a decode
    launch."""
    from musa_attn_backend.kernels.attention import tilelang_impl

    use_settings(split_mixed=split, poison=True)
    calls = []
    real = tilelang_impl.paged_attention_tilelang
    monkeypatch.setattr(tilelang_impl, "paged_attention_tilelang", lambda *a, **k: calls.append(1) or real(*a, **k))
    _builder_impl_vs_reference(hq, hkv, block, opts, device=gpu_device, dtype=torch.bfloat16, d=128,
                               query_lens=(1, 1, 1, 1, 300, 129), prefix_lens=(900, 77, 5, 2000, 0, 700),
                               max_seq_len=2200)
    assert calls, "the TileLang path did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("block,decodes", [(16, False), (1, True), (64, False)])
def test_builder_and_impl_new_kv_prefill_on_gpu(gpu_device, monkeypatch, use_settings, block, decodes):
    """The default new-K/V prefill: a prefill batch without cached prefixes (after leading decodes with
    ``decodes``) reads the key / value vLLM hands the impl instead of the blocks, and matches float32 math."""
    from musa_attn_backend.kernels.attention import tilelang_impl

    use_settings(new_kv_prefill=True, poison=True)  # (the default, and NaN-poisoned outputs)
    ragged = []
    real = tilelang_impl.prefill_kernel
    monkeypatch.setattr(tilelang_impl, "prefill_kernel",
                        lambda *a, **k: ragged.append(k.get("ragged", False)) or real(*a, **k))
    nd = 2 if decodes else 0
    _builder_impl_vs_reference(32, 8, block, {}, device=gpu_device, dtype=torch.bfloat16, d=128,
                               query_lens=(1,) * nd + (300, 129, 1000), prefix_lens=(900, 77)[:nd] + (0, 0, 0),
                               max_seq_len=1100)
    assert ragged == [True], ragged


def test_builder_counts_leading_decodes_when_splitting(use_settings):
    """By default (and with ``MUSA_ATTN_SPLIT_MIXED=1``) the builder asks vLLM to put decodes first and records
    how many lead the batch (from the host copy of query_start_loc); with ``MUSA_ATTN_SPLIT_MIXED=0``, neither."""
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    cases = [((1, 1, 1, 37, 20), 3), ((5, 1, 1), 0), ((1, 1, 3, 1), 2), ((2, 2), 0)]
    for flag in (None, "1", "0"):
        if flag is not None:
            use_settings(split_mixed=flag == "1")
        builder = TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], VllmConfig(), torch.device("cpu"))
        assert builder.reorder_batch_threshold == (None if flag == "0" else 1)
        for qlens, leading in cases:
            batch = random_batch(random.Random(len(qlens)), batch_size=len(qlens), page_size=16, max_seq_len=90,
                                 query_lens=list(qlens))
            assert builder.build(0, _common_metadata(batch)).meta.num_decodes == (0 if flag == "0" else leading)


def test_builder_flags_batches_without_cached_prefixes(use_settings):
    """``new_kv_only``: no request after the leading decodes (all requests, when the builder does not split
    mixed batches) has a cached prefix, from the host copies of query_start_loc and seq_lens (vLLM's
    ``seq_lens_cpu_upper_bound``, exact for prefill rows); unknown without them; never for pure decode batches."""
    import dataclasses as dc

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    cases = [((37, 20), (0, 0), True, True), ((1, 1, 37, 20), (5, 9, 0, 0), True, False),
             ((1, 1, 37, 20), (5, 9, 0, 3), False, False), ((37, 20), (0, 4), False, False),
             ((1, 1), (5, 9), False, False), ((1, 30), (0, 0), True, True)]
    for flag in ("1", "0"):
        use_settings(split_mixed=flag == "1")
        builder = TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], VllmConfig(), torch.device("cpu"))
        for qlens, plens, split_yes, one_launch_yes in cases:
            batch = random_batch(random.Random(len(qlens)), batch_size=len(qlens), page_size=16, max_seq_len=90,
                                 query_lens=list(qlens), prefix_lens=list(plens))
            cm = _common_metadata(batch)
            want = split_yes if flag == "1" else one_launch_yes
            assert builder.build(0, cm).meta.new_kv_only == want, (flag, qlens, plens)
            assert not builder.build(0, dc.replace(cm, seq_lens_cpu_upper_bound=None)).meta.new_kv_only


def _decode_builder(block, hkv, d, dtype, device, use_settings, graphs=True):
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm import backend as vb

    use_settings(vllm_cuda_graphs=graphs)
    cfg = VllmConfig()
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=d, dtype=dtype)
    return vb.TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], cfg, torch.device(device)), cfg


def test_cuda_graph_support_declared_with_opt_out(use_settings):
    from vllm.v1.attention.backend import AttentionCGSupport

    from musa_attn_backend.vllm import backend as vb

    cls = vb.TileLangMusaBackend.get_builder_cls()
    use_settings(vllm_cuda_graphs=True)  # the default
    assert cls.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    use_settings(vllm_cuda_graphs=False)  # MUSA_ATTN_VLLM_CUDA_GRAPHS=0
    assert cls.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


def test_decode_batches_reuse_persistent_buffers_under_full_graphs(use_settings):
    """Under full CUDA graphs every pure-decode batch is built into the same buffers (a captured graph reads
    each replay's metadata there), with the key bound at the block-table capacity; other batches are not."""
    builder, _ = _decode_builder(16, 2, 64, torch.float32, "cpu", use_settings)
    metas = []
    for seed in (1, 2):
        batch = random_batch(random.Random(seed), batch_size=6, page_size=16, max_seq_len=200, decode=True)
        md = builder.build(0, _common_metadata(batch))
        fresh = batch.meta()
        width = fresh.page_table.shape[1]
        for name in ("cu_seqlens_q", "seqlens_k", "prefix_lens", "slot_mapping"):
            assert torch.equal(getattr(md.meta, name), getattr(fresh, name)), name
        assert torch.equal(md.meta.page_table[:, :width], fresh.page_table)
        assert md.meta.max_seqlen_k == md.meta.page_table.shape[1] * 16
        metas.append(md.meta)
    assert metas[0].seqlens_k.data_ptr() == metas[1].seqlens_k.data_ptr()
    assert metas[0].page_table.data_ptr() == metas[1].page_table.data_ptr()
    mixed = random_batch(random.Random(3), batch_size=3, page_size=16, max_seq_len=200, query_lens=[1, 5, 1],
                         prefix_lens=[10, 0, 30])
    assert builder.build(0, _common_metadata(mixed)).meta.seqlens_k.data_ptr() != metas[0].seqlens_k.data_ptr()
    # opted out (MUSA_ATTN_VLLM_CUDA_GRAPHS=0): every batch gets its own tensors
    plain, _ = _decode_builder(16, 2, 64, torch.float32, "cpu", use_settings, graphs=False)
    batch = random_batch(random.Random(1), batch_size=6, page_size=16, max_seq_len=200, decode=True)
    assert plain.build(0, _common_metadata(batch)).meta.max_seqlen_k == max(batch.seq_lens)


@pytest.mark.gpu
def test_impl_decode_under_cuda_graph_capture_and_replay(gpu_device, monkeypatch, use_settings):
    """vLLM's builder + impl decode captured in a CUDA graph, then replayed after building *other* decode
    batches (new lengths, block tables, queries, one padded request): equal to eager runs of the same batches."""
    from vllm.config import set_current_vllm_config

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    hq, hkv, d, block, bs = 32, 8, 128, 16, 8
    builder, cfg = _decode_builder(block, hkv, d, torch.bfloat16, gpu_device, use_settings)
    with set_current_vllm_config(cfg):
        impl = TileLangMusaBackend.get_impl_cls()(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv)
    num_blocks, width = 600, 256
    kv_cache = torch.randn(num_blocks, block, hkv, 2 * d, device=gpu_device).to(torch.bfloat16).permute(0, 2, 1, 3)
    layer = type("L", (), {})()
    query = torch.empty(bs, hq, d, device=gpu_device, dtype=torch.bfloat16)
    output = torch.empty(bs, hq, d, device=gpu_device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)

    def common(seq_lens):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        table = torch.randint(1, num_blocks, (bs, width), generator=g, dtype=torch.int32).to(gpu_device)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=gpu_device)
        qsl = torch.arange(bs + 1, dtype=torch.int32, device=gpu_device)
        last = (sl - 1).clamp_min(0).long()
        slots = torch.where(sl > 0, table.long().gather(1, (last // block)[:, None])[:, 0] * block + last % block,
                            torch.full_like(last, -1))
        return CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=sl,
                                       num_reqs=bs, num_actual_tokens=bs, max_query_len=1,
                                       max_seq_len=max(seq_lens), block_table_tensor=table, slot_mapping=slots,
                                       causal=True, seq_lens_cpu_upper_bound=sl.cpu())

    def eager(cm, q):
        out = torch.empty_like(output)
        impl.forward(layer, q, None, None, kv_cache, builder.build(0, cm), out)
        return out

    cm0 = common([3000, 17, 900, 1, 4096, 250, 33, 1200])
    md = builder.build(0, cm0)
    query.copy_(torch.randn(bs, hq, d, generator=g).to(torch.bfloat16))
    impl.forward(layer, query, None, None, kv_cache, md, output)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        impl.forward(layer, query, None, None, kv_cache, md, output)
    torch.cuda.current_stream().wait_stream(s)
    for lens in ([5, 4000, 77, 2048, 1, 9, 3100, 0], [4096] * 8):  # 0: a padded request
        cm = common(lens)
        q = torch.randn(bs, hq, d, generator=g).to(torch.bfloat16).to(gpu_device)
        want = eager(cm, q)
        builder.build(0, cm)  # what vLLM does before each replay
        query.copy_(q)
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        live = torch.tensor(lens, device=gpu_device) > 0
        # replay against eager: both TileLang, bound by the bf16 kernel bound each is held to
        assert_close(output[live], want[live], torch.bfloat16)


def test_impl_refuses_unsupported():
    from musa_attn_backend.vllm.backend import TileLangMusaImpl

    with pytest.raises(ValueError, match="ALiBi"):
        TileLangMusaImpl(4, 64, 0.1, 4, alibi_slopes=[1.0] * 4)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TileLangMusaImpl(4, 64, 0.1, 4, kv_cache_dtype="int8_per_token_head")


def test_spawn_trap_is_real_without_our_reduce(tmp_path):
    """Control: with our by-reference pickling removed, a spawned worker cannot unpickle the member."""
    code = """
import multiprocessing as mp

def worker(cfg, q):
    q.put(cfg.backend.name)

if __name__ == "__main__":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    del AttentionBackendEnum.TILELANG_MUSA.__dict__["__reduce_ex__"]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(AttentionConfig(backend="tilelang_musa"), q))
    p.start()
    p.join(120)
    print("EXIT", p.exitcode)
"""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(code))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "EXIT 1" in res.stdout and "is not a valid AttentionBackendEnum" in res.stderr, \
        res.stdout[-1000:] + res.stderr[-2000:]
