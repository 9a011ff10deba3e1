"""The PyTorch reference ops against torch's SDPA (and closed forms where SDPA has no such option)."""

import math
import random

import pytest
import torch

from musa_attn_backend.kernels import paged_attention
from musa_attn_backend.metadata import PagedKVMeta
from musa_attn_backend.testing import dense_attention, random_batch
from musa_attn_backend.testing.numeric import assert_close


def _run_case(batch, hq, hkv, d, dtype, *, causal=True, sliding_window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, ks, vs = batch.make_kv(hkv, d, dtype)
    q = torch.randn(batch.num_tokens, hq, d, generator=g).to(dtype)
    scale = d ** -0.5
    out, lse = paged_attention(q, k_cache, v_cache, batch.meta(), causal=causal, sliding_window=sliding_window,
                               return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (batch.num_tokens, hq)
    cu = 0
    for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
        qb = q[cu: cu + n]
        ref = dense_attention(qb, ks[b], vs[b], prefix_len=p, causal=causal, sm_scale=scale,
                              sliding_window=sliding_window)
        assert_close(out[cu: cu + n], ref, dtype, reference=True)
        # LSE against the explicit masked scores.
        kk = ks[b].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->qhk", qb.float(), kk) * scale
        qpos = p + torch.arange(n)[:, None, None]
        kpos = torch.arange(ks[b].shape[0])[None, None, :]
        vis = torch.ones_like(s, dtype=torch.bool)
        if causal:
            vis &= kpos <= qpos
        if sliding_window is not None:
            vis &= kpos >= qpos - sliding_window
        ref_lse = torch.logsumexp(s.masked_fill(~vis, float("-inf")), dim=-1)
        assert_close(lse[cu: cu + n], ref_lse, lse=True, reference=True)
        cu += n
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_extend_with_prefix_matches_sdpa(dtype, page_size, hq, hkv):
    rng = random.Random(hash((page_size, hq, hkv)) % 1000)
    batch = random_batch(rng, batch_size=4, page_size=page_size, max_seq_len=150, max_query_len=40)
    _run_case(batch, hq, hkv, 64, dtype)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_prefill_without_prefix_matches_sdpa(d):
    rng = random.Random(d)
    batch = random_batch(rng, batch_size=3, page_size=16, max_seq_len=90, prefix_lens=[0, 0, 0],
                         query_lens=[1, 37, 90])
    _run_case(batch, 4, 2, d, torch.float32)


@pytest.mark.parametrize("page_size", [1, 32])
def test_decode_matches_sdpa(page_size):
    rng = random.Random(5)
    batch = random_batch(rng, batch_size=7, page_size=page_size, max_seq_len=500, decode=True)
    _run_case(batch, 8, 1, 128, torch.bfloat16)


def test_non_causal_matches_sdpa():
    rng = random.Random(11)
    batch = random_batch(rng, batch_size=3, page_size=16, max_seq_len=80, max_query_len=20)
    _run_case(batch, 4, 2, 64, torch.float32, causal=False)


@pytest.mark.parametrize("window", [0, 1, 7, 64])
def test_sliding_window_matches_sdpa(window):
    rng = random.Random(window)
    batch = random_batch(rng, batch_size=4, page_size=16, max_seq_len=200, max_query_len=50)
    _run_case(batch, 4, 2, 64, torch.float32, sliding_window=window)


def test_negative_window_and_zero_softcap_mean_off():
    rng = random.Random(2)
    batch = random_batch(rng, batch_size=2, page_size=16, max_seq_len=60)
    k_cache, v_cache, _, _ = batch.make_kv(2, 64, torch.float32)
    q = torch.randn(batch.num_tokens, 4, 64)
    meta = batch.meta()
    base = paged_attention(q, k_cache, v_cache, meta)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, sliding_window=-1, logit_softcap=0.0), base)


def test_softcap_and_sinks_closed_form():
    """softcap: cap*tanh(s/cap) on the logits; sinks: out = out_nosink * sigmoid(lse - sink)."""
    rng = random.Random(9)
    batch = random_batch(rng, batch_size=3, page_size=16, max_seq_len=70, max_query_len=30)
    hq, hkv, d, cap = 8, 2, 64, 5.0
    k_cache, v_cache, ks, vs = batch.make_kv(hkv, d, torch.float32)
    q = 3 * torch.randn(batch.num_tokens, hq, d)
    sinks = torch.randn(hq) * 2
    meta = batch.meta()
    out_cap = paged_attention(q, k_cache, v_cache, meta, logit_softcap=cap)
    base, lse = paged_attention(q, k_cache, v_cache, meta, return_lse=True)
    out_sink, lse_sink = paged_attention(q, k_cache, v_cache, meta, sinks=sinks, return_lse=True)
    # 1e-5, tighter than the table's float32 reference bound (2e-5): these closed forms repeat the reference's own
    # float32 arithmetic on the same logits, with no second attention computation to differ from
    torch.testing.assert_close(out_sink, base * torch.sigmoid(lse - sinks)[..., None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_sink, torch.logaddexp(lse, sinks.expand_as(lse)), atol=1e-5, rtol=1e-5)
    cu = 0
    for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
        kk = ks[b].repeat_interleave(hq // hkv, 1)
        vv = vs[b].repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->qhk", q[cu: cu + n], kk) / math.sqrt(d)
        s = cap * torch.tanh(s / cap)
        vis = torch.arange(kk.shape[0])[None, None] <= (p + torch.arange(n))[:, None, None]
        pr = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
        torch.testing.assert_close(out_cap[cu: cu + n], torch.einsum("qhk,khd->qhd", pr, vv), atol=1e-5, rtol=1e-5)
        cu += n
    assert not torch.allclose(out_cap, base)


def test_custom_sm_scale():
    rng = random.Random(4)
    batch = random_batch(rng, batch_size=2, page_size=16, max_seq_len=40)
    k_cache, v_cache, ks, vs = batch.make_kv(2, 64, torch.float32)
    q = torch.randn(batch.num_tokens, 2, 64)
    out = paged_attention(q, k_cache, v_cache, batch.meta(), sm_scale=0.3)
    ref = dense_attention(q[: batch.query_lens[0]], ks[0], vs[0], prefix_len=batch.prefix_lens[0], causal=True,
                          sm_scale=0.3)
    assert_close(out[: batch.query_lens[0]], ref, torch.float32, reference=True)


def test_both_engine_views_give_the_same_attention():
    rng = random.Random(21)
    batch = random_batch(rng, batch_size=5, page_size=16, max_seq_len=120, max_query_len=30)
    k_cache, v_cache, _, _ = batch.make_kv(2, 64, torch.bfloat16)
    q = torch.randn(batch.num_tokens, 4, 64).bfloat16()
    a = paged_attention(q, k_cache, v_cache, PagedKVMeta.from_sglang(**batch.sglang_view()))
    b = paged_attention(q, k_cache, v_cache, PagedKVMeta.from_vllm(**batch.vllm_view()))
    assert torch.equal(a, b)


@pytest.mark.parametrize("return_lse", [False, True])
def test_out_is_written_and_returned(return_lse):
    """``out=``: the result lands in the caller's tensor, which is what comes back (the LSE beside it when asked
    for), with the values of a call without it."""
    batch = random_batch(random.Random(11), batch_size=4, page_size=16, max_seq_len=90, max_query_len=20)
    k_cache, v_cache, _, _ = batch.make_kv(2, 64, torch.bfloat16, head_dim_v=32)
    q = torch.randn(batch.num_tokens, 4, 64).to(torch.bfloat16)
    meta = batch.meta()
    want, want_lse = paged_attention(q, k_cache, v_cache, meta, return_lse=True)
    buf = torch.full((batch.num_tokens, 4, 32), float("nan"), dtype=torch.bfloat16)
    res = paged_attention(q, k_cache, v_cache, meta, out=buf, return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    assert out is buf
    assert torch.equal(buf, want)
    if return_lse:
        assert torch.equal(lse, want_lse)


def test_out_may_be_rows_of_a_larger_buffer():
    """An engine's output holds padded rows past the batch: its leading rows, contiguous, are a valid ``out``
    and nothing past them is touched."""
    batch = random_batch(random.Random(12), batch_size=3, page_size=1, max_seq_len=40, max_query_len=9)
    k_cache, v_cache, _, _ = batch.make_kv(2, 64, torch.float32)
    q = torch.randn(batch.num_tokens, 4, 64)
    engine = torch.full((batch.num_tokens + 5, 4, 64), 7.0)
    res = paged_attention(q, k_cache, v_cache, batch.meta(), out=engine[:batch.num_tokens])
    assert res.data_ptr() == engine.data_ptr()
    assert torch.equal(engine[:batch.num_tokens], paged_attention(q, k_cache, v_cache, batch.meta()))
    assert (engine[batch.num_tokens:] == 7.0).all()
