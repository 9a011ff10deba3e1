"""The reference's two ways through a batch: the whole batch as one padded problem and request by request.

Both must agree with each other and with a row-by-row softmax (the module docstring's formula) on ragged
batches with every option on, with NaN in the slots no request owns (padded keys read them).
"""

import math
import random

import pytest
import torch

from musa_attn_backend.kernels.attention.reference import paged_attention_reference
from musa_attn_backend.metadata import PagedKVMeta
from musa_attn_backend.testing import random_batch


def _row_by_row(q, ks, vs, batch, *, causal, window, cap, sinks, scale):
    """One softmax per (row, head) in float64, straight from the formula."""
    hq, hkv = q.shape[1], ks[0].shape[1]
    out = torch.zeros(q.shape[0], hq, vs[0].shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[0], hq), float("-inf"), dtype=torch.float64)
    row = 0
    for b, (p0, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
        k, v = ks[b].double(), vs[b].double()
        for i in range(n):
            pos = p0 + i
            j = torch.arange(k.shape[0])
            vis = torch.ones_like(j, dtype=torch.bool)
            if causal:
                vis &= j <= pos
            if window is not None:
                vis &= j >= pos - window
            for h in range(hq):
                s = (k[:, h // (hq // hkv)] @ q[row, h].double()) * scale
                if cap:
                    s = cap * torch.tanh(s / cap)
                s = s[vis]
                if sinks is not None:
                    s = torch.cat([s, sinks[h].double().view(1)])
                lse[row, h] = torch.logsumexp(s, 0)
                w = torch.exp(s - lse[row, h])[: int(vis.sum())]
                out[row, h] = w @ v[vis, h // (hq // hkv)]
            row += 1
    return out, lse


CASES = [  # (page_size, hq, hkv, causal, window, cap, use_sinks, kv dtype)
    (1, 4, 2, True, None, None, False, torch.float32),
    (16, 8, 2, True, 7, 5.0, True, torch.float32),
    (16, 6, 1, False, None, None, True, torch.float32),
    (32, 4, 4, False, 12, 3.0, False, torch.float32),
    (16, 8, 2, True, 3, None, True, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_padded_batch_equals_request_by_request_and_the_formula(case, decode):
    page_size, hq, hkv, causal, window, cap, use_sinks, kv_dtype = CASES[case]
    rng = random.Random(100 * case + decode)
    batch = random_batch(rng, batch_size=6, page_size=page_size, max_seq_len=90, decode=decode,
                         max_query_len=None if decode else 24)
    d = 32
    k_cache, v_cache, ks, vs = batch.make_kv(hkv, d, torch.float32, stale=float("nan"))  # NaN past every sequence
    assert torch.isnan(k_cache).any()
    g = torch.Generator().manual_seed(case)
    q = 2 * torch.randn(batch.num_tokens, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) if use_sinks else None
    scales = {}
    if kv_dtype == torch.float8_e4m3fn:
        scales = dict(k_scale=torch.tensor([0.02, 0.05]), v_scale=0.03)
        k_cache = (k_cache / scales["k_scale"].view(1, 1, -1, 1)).to(kv_dtype)
        v_cache = (v_cache / scales["v_scale"]).to(kv_dtype)
        ks = [(k_cache.float() * scales["k_scale"].view(1, 1, -1, 1)).view(-1, hkv, d)[_slots(batch, b)]
              for b in range(batch.batch_size)]
        vs = [(v_cache.float() * scales["v_scale"]).view(-1, hkv, d)[_slots(batch, b)]
              for b in range(batch.batch_size)]
    opts = dict(causal=causal, sliding_window=window, logit_softcap=cap, sinks=sinks, return_lse=True, **scales)
    meta = batch.meta()
    padded = paged_attention_reference(q, k_cache, v_cache, meta, pad_requests=True, **opts)
    single = paged_attention_reference(q, k_cache, v_cache, meta, pad_requests=False, **opts)
    auto = paged_attention_reference(q, k_cache, v_cache, meta, **opts)
    ref_out, ref_lse = _row_by_row(q, ks, vs, batch, causal=causal, window=window, cap=cap, sinks=sinks,
                                   scale=d ** -0.5)
    # float64 ground truth computed row by row: 1e-5 for outputs and LSEs, tighter than the table's float32
    # reference bounds (2e-5, LSE 1e-4), which allow for a second float32 computation (SDPA)
    for out, lse in (padded, single, auto):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # two gathers of the same reference math: only summation order may differ
    torch.testing.assert_close(padded[0], single[0], atol=1e-6, rtol=1e-6)


def _slots(batch, b):
    return torch.tensor([batch.slot(b, p) for p in range(batch.seq_lens[b])])


def test_padded_batch_reads_strided_caches():
    """vLLM's K and V are strided views of one buffer; the padded gather indexes them as they are."""
    rng = random.Random(3)
    batch = random_batch(rng, batch_size=5, page_size=16, max_seq_len=70, decode=True)
    k_cache, v_cache, _, _ = batch.make_kv(2, 32, torch.float32)
    buf = torch.cat([k_cache, v_cache], dim=-1).transpose(1, 2).contiguous()  # [pages, heads, page, 2 * d]
    kc, vc = buf.transpose(1, 2).split(32, dim=-1)
    assert not kc.is_contiguous()
    q = torch.randn(batch.num_tokens, 4, 32)
    meta = batch.meta()
    for pad in (True, False):
        torch.testing.assert_close(paged_attention_reference(q, kc, vc, meta, pad_requests=pad),
                                   paged_attention_reference(q, k_cache, v_cache, meta, pad_requests=False))


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_row_that_sees_nothing_gives_zero_output_and_the_sink_lse(pad, use_sinks):
    """Request 1's queries sit past its keys and their window (as a combine's empty split would): zero output,
    LSE -inf, or the sink logit itself when there is a sink."""
    page_size, hq, hkv, d = 4, 4, 2, 16
    k_cache = torch.randn(8, page_size, hkv, d)
    v_cache = torch.randn(8, page_size, hkv, d)
    meta = PagedKVMeta(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32),
                       seqlens_k=torch.tensor([6, 3], dtype=torch.int32),
                       prefix_lens=torch.tensor([4, 20], dtype=torch.int32),
                       page_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                       slot_mapping=torch.arange(4), page_size=page_size, max_seqlen_q=2, max_seqlen_k=6)
    q = torch.randn(4, hq, d)
    sinks = torch.randn(hq) if use_sinks else None
    out, lse = paged_attention_reference(q, k_cache, v_cache, meta, sliding_window=2, sinks=sinks,
                                         return_lse=True, pad_requests=pad)
    assert torch.equal(out[2:], torch.zeros(2, hq, d))
    expect = sinks.expand(2, hq) if use_sinks else torch.full((2, hq), -math.inf)
    assert torch.equal(lse[2:], expect)
    assert torch.isfinite(lse[:2]).all() and out[:2].abs().sum() > 0


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_equal_query_lengths_take_the_unpadded_query_view(hq, hkv):
    """Every request with the same number of query rows (a chain verify): the queries are a plain reshape."""
    rng = random.Random(hq)
    batch = random_batch(rng, batch_size=4, page_size=1, max_seq_len=40, query_lens=[3, 3, 3, 3])
    k_cache, v_cache, _, _ = batch.make_kv(hkv, 16, torch.float32, stale=float("nan"))
    q = torch.randn(batch.num_tokens, hq, 16)
    meta = batch.meta()
    padded = paged_attention_reference(q, k_cache, v_cache, meta, pad_requests=True, return_lse=True)
    single = paged_attention_reference(q, k_cache, v_cache, meta, pad_requests=False, return_lse=True)
    torch.testing.assert_close(padded, single, atol=1e-6, rtol=1e-6)
