"""A mixed batch whose metadata counts its leading decodes runs them in a decode launch and the rest in a prefill
launch (the default; ``MUSA_ATTN_SPLIT_MIXED=0`` turns it off). On a CPU the compiled kernels are replaced by
stand-ins that keep their contract (packed ``q`` / ``O`` / ``LSE`` indexed by ``cu_seqlens_q``; every argument
shaped consistently with the batch it is given; nothing written outside its requests' rows) and compute with the
reference op, so these tests check what the launcher hands each kernel; the GPU test (``test_vllm_backend.py``,
``split_mixed``) runs the real kernels."""

import dataclasses
import random

import pytest
import torch

from musa_attn_backend.kernels import paged_attention
from musa_attn_backend.kernels.attention import tilelang_impl
from musa_attn_backend.metadata import PagedKVMeta
from musa_attn_backend.testing import random_batch
from musa_attn_backend.testing.numeric import assert_close


def _stand_in(kind, k_cache, v_cache, launches, causal):
    def kernel(q, k_rows, v_rows, cu, sk, pt, sinks, k_scale, v_scale, sm_scale, softcap, window, page_size, extra,
               o, lse):
        b = sk.numel()
        assert cu.numel() == b + 1 and pt.shape[0] == b, "metadata arrays disagree on the batch size"
        assert o.shape[0] == q.shape[0] == lse.shape[0], "q / O / LSE rows disagree"
        assert all(t.is_contiguous() for t in (q, cu, sk, pt, o, lse))
        assert int(cu[-1]) <= q.shape[0]
        launches.append((kind, b, q.shape[0], extra))
        for i in range(b):
            lo, hi = int(cu[i]), int(cu[i + 1])
            one = PagedKVMeta(cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32), seqlens_k=sk[i:i + 1],
                              prefix_lens=sk[i:i + 1] - (hi - lo), page_table=pt[i:i + 1],
                              slot_mapping=torch.full((hi - lo,), -1, dtype=torch.int64), page_size=page_size,
                              max_seqlen_q=hi - lo, max_seqlen_k=int(sk[i]))
            out, l = paged_attention(q[lo:hi].float(), k_cache.float(), v_cache.float(), one, causal=causal,
                                     sm_scale=sm_scale, return_lse=True, impl="reference")
            o[lo:hi] = out.to(o.dtype)
            lse[lo:hi] = l
    return kernel


def _new_kv_stand_in(spec, launches, causal):
    """The prefill kernel reading the batch's new K/V rows (``ragged``): request ``b``'s keys are rows
    ``cu[b]:cu[b+1]`` of ``k_rows`` / ``v_rows`` (laid out as ``spec`` says), and it has no cached prefix."""
    def kernel(q, k_rows, v_rows, cu, sk, pt, sinks, k_scale, v_scale, sm_scale, softcap, window, page_size, extra,
               o, lse):
        b = sk.numel()
        launches.append(("prefill_new_kv", b, q.shape[0], extra))
        kv = []
        for rows, (_, s_tok, s_head), w in ((k_rows, spec.k_layout, spec.d), (v_rows, spec.v_layout, spec.dv)):
            assert rows.stride() == (s_tok, 1), "rows and layout disagree"
            kv.append(rows.as_strided((rows.shape[0], spec.hkv, w), (s_tok, s_head, 1)))
        for i in range(b):
            lo, hi = int(cu[i]), int(cu[i + 1])
            assert int(sk[i]) == hi - lo, "a request with a cached prefix took the new-K/V kernel"
            n = hi - lo
            one = PagedKVMeta(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seqlens_k=sk[i:i + 1],
                              prefix_lens=torch.zeros(1, dtype=torch.int32),
                              page_table=torch.arange(n, dtype=torch.int32)[None],
                              slot_mapping=torch.full((n,), -1, dtype=torch.int64), page_size=1, max_seqlen_q=n,
                              max_seqlen_k=n)
            out, l = paged_attention(q[lo:hi].float(), kv[0][lo:hi, None].float(), kv[1][lo:hi, None].float(), one,
                                     causal=causal, sm_scale=sm_scale, return_lse=True, impl="reference")
            o[lo:hi] = out.to(o.dtype)
            lse[lo:hi] = l
    return kernel


@pytest.fixture()
def stand_ins(monkeypatch, use_settings):
    launches = []
    state = {}
    use_settings(poison=True)
    monkeypatch.setattr(tilelang_impl, "num_splits_for", lambda *a, **k: 1)
    monkeypatch.setattr(tilelang_impl, "prefill_kernel",
                        lambda spec, causal, page_size, cfg=None, target=None, ragged=False:
                        _new_kv_stand_in(spec, launches, causal) if ragged else
                        _stand_in("prefill", state["k"], state["v"], launches, causal))
    monkeypatch.setattr(tilelang_impl, "decode_kernel", lambda spec, dcfg, split, target=None:
                        _stand_in(f"decode{dcfg.max_q}", state["k"], state["v"], launches, True))
    return launches, state


def _run(state, num_decodes, query_lens, prefix_lens, causal=True):
    batch = random_batch(random.Random(len(query_lens)), batch_size=len(query_lens), page_size=16,
                         max_seq_len=400, query_lens=query_lens, prefix_lens=prefix_lens)
    k, v, _, _ = batch.make_kv(2, 64, torch.bfloat16)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)  # the stand-ins read whole pages in float
    state["k"], state["v"] = k, v
    meta = dataclasses.replace(batch.meta(), num_decodes=num_decodes)
    q = torch.randn(batch.num_tokens, 8, 64).to(torch.bfloat16)
    out, lse = tilelang_impl.paged_attention_tilelang(q, k, v, meta, causal=causal, return_lse=True)
    ref, ref_lse = paged_attention(q, k, v, meta, causal=causal, return_lse=True, impl="reference")
    assert not torch.isnan(out).any(), "rows no launch wrote"
    assert_close(out, ref)
    assert_close(lse, ref_lse, lse=True)


def test_mixed_batch_splits_into_decode_and_prefill_launches(stand_ins, use_settings):
    launches, state = stand_ins
    use_settings(split_mixed=True)  # the default
    _run(state, 4, [1, 1, 1, 1, 37, 120, 5], [30, 200, 0, 64, 0, 100, 7])
    # 4 decode requests over the first 4 rows of q; 3 prefill requests over the whole q
    assert launches == [("decode1", 4, 4, 1), ("prefill", 3, 166, 120)]


@pytest.mark.parametrize("flag,num_decodes,causal", [(False, 4, True), (True, 0, True), (True, 4, False)])
def test_one_prefill_launch_otherwise(stand_ins, use_settings, flag, num_decodes, causal):
    """Turned off (``MUSA_ATTN_SPLIT_MIXED=0``), no count of leading decodes, or not causal: the whole batch in
    one prefill launch."""
    launches, state = stand_ins
    use_settings(split_mixed=flag)
    _run(state, num_decodes, [1, 1, 1, 1, 37, 120, 5], [30, 200, 0, 64, 0, 100, 7], causal=causal)
    assert [kind for kind, *_ in launches] == ["prefill"]


def test_requests_view_keeps_absolute_rows():
    batch = random_batch(random.Random(0), batch_size=5, page_size=16, max_seq_len=200,
                         query_lens=[1, 1, 9, 30, 2], prefix_lens=[10, 50, 0, 7, 100])
    meta = batch.meta()
    tail = meta.requests(2, 5)
    assert tail.cu_seqlens_q.tolist() == meta.cu_seqlens_q[2:].tolist()
    assert torch.equal(tail.page_table, meta.page_table[2:]) and tail.page_table.is_contiguous()
    assert tail.max_seqlen_q == meta.max_seqlen_q and tail.max_seqlen_k == meta.max_seqlen_k
    assert meta.requests(0, 2, max_seqlen_q=1).max_seqlen_q == 1
    with pytest.raises(ValueError, match="requests"):
        meta.requests(3, 3)


def test_split_metadata_built_once_per_batch(stand_ins, monkeypatch, use_settings):
    """Every layer of a step runs on the same metadata: the two sub-batches are built on the first layer call and
    reused, not rebuilt (device copies) on each; a new batch (``dataclasses.replace``) builds its own."""
    launches, state = stand_ins
    use_settings(split_mixed=True)
    built = []
    real = PagedKVMeta.requests
    monkeypatch.setattr(PagedKVMeta, "requests", lambda self, *a, **k: built.append(a) or real(self, *a, **k))
    batch = random_batch(random.Random(3), batch_size=4, page_size=16, max_seq_len=300, query_lens=[1, 1, 20, 7],
                         prefix_lens=[40, 9, 0, 100])
    k, v, _, _ = batch.make_kv(2, 64, torch.bfloat16)
    state["k"], state["v"] = torch.nan_to_num(k), torch.nan_to_num(v)
    meta = dataclasses.replace(batch.meta(), num_decodes=2)
    q = torch.randn(batch.num_tokens, 8, 64).to(torch.bfloat16)
    for _ in range(3):  # three layers
        tilelang_impl.paged_attention_tilelang(q, state["k"], state["v"], meta)
    assert built == [(0, 2), (2, 4)] and len(launches) == 6
    assert meta.decode_split() is meta.decode_split()
    assert dataclasses.replace(meta, num_decodes=1).decode_split()[0].batch_size == 1
    with pytest.raises(ValueError, match="decode_split"):
        batch.meta().decode_split()  # no leading decodes counted


def _new_kv_case(num_decodes, query_lens, prefix_lens, *, new_kv_only=True, fused=False, dtype=torch.bfloat16,
                 window=None):
    """A batch whose cache holds its K/V, and new K/V that differ from what the cache holds for the new tokens
    (+1): an output that follows them shows which source a launch read."""
    batch = random_batch(random.Random(sum(query_lens)), batch_size=len(query_lens), page_size=16,
                         max_seq_len=300, query_lens=query_lens, prefix_lens=prefix_lens)
    k, v, ks, vs = batch.make_kv(2, 64, torch.bfloat16)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)
    meta = dataclasses.replace(batch.meta(), num_decodes=num_decodes, new_kv_only=new_kv_only)
    new_k = torch.cat([x[p:] for x, p in zip(ks, prefix_lens)]) + 1
    new_v = torch.cat([x[p:] for x, p in zip(vs, prefix_lens)]) + 1
    if fused:  # SGLang / vLLM views of a fused [q | k | v] projection: 2-D, a row stride of the whole projection
        qkv = torch.randn(batch.num_tokens, (8 + 2 + 2) * 64).to(torch.bfloat16)
        qkv[:, 8 * 64:10 * 64] = new_k.flatten(1)
        qkv[:, 10 * 64:] = new_v.flatten(1)
        new_kv = (qkv[:, 8 * 64:10 * 64], qkv[:, 10 * 64:])
    else:
        new_kv = (new_k.to(dtype), new_v.to(dtype))
    # the cache as the new K/V say (what the new-K/V kernel sees), for the expected output
    k2, v2 = k.clone(), v.clone()
    for b, (p, n) in enumerate(zip(prefix_lens, query_lens)):
        rows = torch.tensor([batch.slot(b, p + i) for i in range(n)])
        k2.view(-1, 2, 64)[rows] += 1
        v2.view(-1, 2, 64)[rows] += 1
    q = torch.randn(batch.num_tokens, 8, 64).to(torch.bfloat16)
    return q, k, v, k2, v2, meta, new_kv


@pytest.mark.parametrize("fused", [False, True])
def test_new_kv_prefill_reads_the_new_rows(stand_ins, use_settings, fused):
    """``MUSA_ATTN_NEW_KV_PREFILL=1`` on a Hopper target: a batch without cached prefixes (``new_kv_only``) runs
    the prefill kernel on the new K/V rows (3-D, or 2-D strided views of a fused projection); after leading
    decodes, those go to the decode kernel on the cache and only the rest reads the new rows."""
    launches, state = stand_ins
    use_settings(target="sm_90a", new_kv_prefill=True, split_mixed=True)
    for nd, qlens, plens in ((0, [37, 120, 5], [0, 0, 0]), (2, [1, 1, 37, 130], [30, 99, 0, 0])):
        launches.clear()
        q, k, v, k2, v2, meta, new_kv = _new_kv_case(nd, qlens, plens, fused=fused)
        state["k"], state["v"] = k, v
        out = tilelang_impl.paged_attention_tilelang(q, k, v, meta, new_kv=new_kv)
        assert [kind for kind, *_ in launches] == (["decode1"] if nd else []) + ["prefill_new_kv"]
        t = sum(qlens[:nd])
        ref_new = paged_attention(q, k2, v2, meta, impl="reference")  # the prefill part: the new rows
        ref_cache = paged_attention(q, k, v, meta, impl="reference")  # the decodes: the cache
        assert_close(out[t:], ref_new[t:])
        assert_close(out[:t], ref_cache[:t])
        assert not torch.allclose(ref_new[t:].float(), ref_cache[t:].float(), atol=0.1), "the sources must differ"


@pytest.mark.parametrize("case", ["not_flagged", "opted_out", "window", "dtype", "no_bulk_copy"])
def test_new_kv_prefill_falls_back_to_the_cache(stand_ins, use_settings, case):
    """The cache path where the new K/V may not stand in for it: the batch not flagged (not known to be free of
    cached prefixes), the switch off, a window (no whole-tile TMA kernel), new K/V of another dtype than the cache,
    or a platform without bulk copies (sm_80)."""
    launches, state = stand_ins
    use_settings(target="sm_80" if case == "no_bulk_copy" else "sm_90a", new_kv_prefill=case != "opted_out")
    q, k, v, _, _, meta, new_kv = _new_kv_case(0, [37, 120, 5], [0, 0, 0], new_kv_only=case != "not_flagged",
                                               dtype=torch.float16 if case == "dtype" else torch.bfloat16)
    state["k"], state["v"] = k, v
    opts = dict(sliding_window=50) if case == "window" else {}
    out = tilelang_impl.paged_attention_tilelang(q, k, v, meta, new_kv=new_kv, **opts)
    assert [kind for kind, *_ in launches] == ["prefill"]
    if not opts:  # (the stand-in kernels know no window)
        assert_close(out, paged_attention(q, k, v, meta, impl="reference"))


def test_new_kv_only_survives_the_decode_split():
    batch = random_batch(random.Random(1), batch_size=4, page_size=16, max_seq_len=200, query_lens=[1, 1, 9, 30],
                         prefix_lens=[10, 50, 0, 0])
    meta = dataclasses.replace(batch.meta(), num_decodes=2, new_kv_only=True)
    decodes, rest = meta.decode_split()
    assert rest.new_kv_only and not decodes.new_kv_only
    assert not dataclasses.replace(batch.meta(), num_decodes=2).decode_split()[1].new_kv_only
    assert not batch.meta().new_kv_only  # not known unless an engine says so


def test_reference_reads_the_cache_whatever_new_kv():
    """The reference (the CPU path and the ground truth) reads the cache; ``new_kv`` is only a GPU shortcut."""
    q, k, v, _, _, meta, new_kv = _new_kv_case(0, [37, 120, 5], [0, 0, 0])
    assert torch.equal(paged_attention(q, k, v, meta, new_kv=new_kv, impl="reference"),
                       paged_attention(q, k, v, meta, impl="reference"))


def test_new_kv_rows_take_only_what_fits():
    """The new K/V the TMA kernel can read: 3-D or 2-D (heads x dim flattened), any row stride, 16-byte aligned
    rows and data, the batch's dtype; anything else (None: the cache path) is not an error."""
    rows = tilelang_impl._new_kv_rows
    k = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    assert rows((k, k), 10, 2, 64, 64, torch.bfloat16, "t")[2] == (128, 128, 64)
    qkv = torch.zeros(12, (8 + 4) * 64, dtype=torch.bfloat16)
    fused = rows((qkv[:, 512:640], qkv[:, 640:]), 10, 2, 64, 64, torch.bfloat16, "t")
    assert fused[2] == (128, 768, 64) and fused[0].data_ptr() == qkv[:, 512:].data_ptr()  # a view, no copy
    assert rows((k, k), 10, 2, 64, 64, torch.float16, "t") is None  # dtype
    assert rows((k[:9], k), 10, 2, 64, 64, torch.bfloat16, "t") is None  # too few rows
    assert rows((k.flatten(1)[:, :96], k), 10, 2, 64, 64, torch.bfloat16, "t") is None  # not heads x dim
    assert rows((qkv[:, 4:132], qkv[:, 640:]), 10, 2, 64, 64, torch.bfloat16, "t") is None  # misaligned
    assert rows((k, k.transpose(1, 2).contiguous().transpose(1, 2)), 10, 2, 64, 64, torch.bfloat16, "t") is None


def test_new_kv_only_batch_with_leading_decodes_unsplit_reads_the_cache(stand_ins, use_settings):
    """``new_kv_only`` covers only the requests after the leading decodes: where the batch is not split (not
    causal here, or ``MUSA_ATTN_SPLIT_MIXED=0``) the one prefill launch holds the decodes too, whose keys include
    a cached prefix, so it reads the cache."""
    launches, state = stand_ins
    use_settings(target="sm_90a", new_kv_prefill=True)
    for split, causal in ((True, False), (False, True)):
        launches.clear()
        use_settings(split_mixed=split)
        q, k, v, _, _, meta, new_kv = _new_kv_case(2, [1, 1, 37, 130], [30, 99, 0, 0])
        state["k"], state["v"] = k, v
        out = tilelang_impl.paged_attention_tilelang(q, k, v, meta, causal=causal, new_kv=new_kv)
        assert [kind for kind, *_ in launches] == ["prefill"]
        assert_close(out, paged_attention(q, k, v, meta, causal=causal, impl="reference"))


def test_tilelang_path_writes_the_given_out(stand_ins):
    """``out=`` on the launch path: the decode and prefill launches of a split mixed batch write the caller's
    tensor (NaN beforehand), which is what comes back, with the LSE beside it."""
    _, state = stand_ins
    batch = random_batch(random.Random(4), batch_size=4, page_size=16, max_seq_len=400, query_lens=[1, 1, 30, 7],
                         prefix_lens=[50, 9, 0, 20])
    k, v, _, _ = batch.make_kv(2, 64, torch.bfloat16)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)
    state["k"], state["v"] = k, v
    meta = dataclasses.replace(batch.meta(), num_decodes=2)
    q = torch.randn(batch.num_tokens, 8, 64).to(torch.bfloat16)
    buf = torch.full((batch.num_tokens, 8, 64), float("nan"), dtype=torch.bfloat16)
    out, lse = tilelang_impl.paged_attention_tilelang(q, k, v, meta, return_lse=True, out=buf)
    assert out is buf and not torch.isnan(buf).any()
    ref, ref_lse = paged_attention(q, k, v, meta, return_lse=True, impl="reference")
    assert_close(buf, ref)
    assert_close(lse, ref_lse, lse=True)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        tilelang_impl.paged_attention_tilelang(q, k, v, meta, out=buf.transpose(0, 1).contiguous().transpose(0, 1))
