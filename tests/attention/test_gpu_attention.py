"""TileLang paged attention on a GPU against the PyTorch reference (``pytest -m gpu``).

Outputs and split partials are poisoned with NaN before each run (MUSA_ATTN_POISON), caches hold NaN in
every slot no request owns, and K/V sit in shuffled pages. Bounds: the kernel table of
:mod:`musa_attn_backend.testing.numeric` (against float32 math on the same inputs) and its kernel LSE bound. FP8
caches compare with the reference reading the same FP8 cache, so only the matmul precision differs: the bf16
bound, not the FP8-widened one, holds there. Every tiling the tuner picks from: ``tests/tuning``.
"""

import random

import pytest
import torch

from musa_attn_backend.kernels import paged_attention, write_kv
from musa_attn_backend.kernels.attention import tilelang_impl
from musa_attn_backend.testing import random_batch
from musa_attn_backend.testing.numeric import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(use_settings):
    use_settings(poison=True)


def _compare(batch, hq, hkv, d, dtype, device, *, dv=None, causal=True, fp8=False, seed=0, **opts):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, _, _ = batch.make_kv(hkv, d, dtype, head_dim_v=dv)
    if fp8:
        kf = torch.full(k_cache.shape, float("nan"), device=device).to(torch.float8_e4m3fn)
        vf = torch.full(v_cache.shape, float("nan"), device=device).to(torch.float8_e4m3fn)
        slots = torch.tensor([batch.slot(b, p) for b, n in enumerate(batch.seq_lens) for p in range(n)],
                             device=device)
        flat_k = k_cache.view(-1, hkv, d)[slots]
        flat_v = v_cache.view(-1, hkv, v_cache.shape[-1])[slots]
        opts["k_scale"] = torch.rand(hkv, device=device) * 0.01 + 0.005
        opts["v_scale"] = 0.01
        write_kv(flat_k, flat_v, kf, vf, slots, k_scale=opts["k_scale"], v_scale=opts["v_scale"])
        k_cache, v_cache = kf, vf
    q = torch.randn(batch.num_tokens, hq, d, generator=g).to(dtype).to(device)
    meta = batch.meta()
    out, lse = paged_attention(q, k_cache, v_cache, meta, causal=causal, return_lse=True, impl="tilelang", **opts)
    ref, ref_lse = paged_attention(q, k_cache, v_cache, meta, causal=causal, return_lse=True, impl="reference",
                                   **opts)
    assert out.shape == ref.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    # fp8: both sides read the same FP8 cache, so the dtype's bound (not the FP8-widened one) applies
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, lse=True)


def _batch(seed, device, **kw):
    return random_batch(random.Random(seed), device=device, **kw)


@pytest.mark.parametrize("page_size", [1, 16, 32, 64, 128])
def test_extend_ragged_all_page_sizes(gpu_device, page_size):
    b = _batch(page_size, gpu_device, batch_size=5, page_size=page_size, max_seq_len=700, max_query_len=300)
    _compare(b, 32, 8, 128, torch.bfloat16, gpu_device)


@pytest.mark.parametrize("musa_forms", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["extend", "decode", "decode_split", "verify"])
def test_head_dim_192_with_v_128(gpu_device, use_settings, mode, fp8, musa_forms):
    """q/k 192, v 128 (DeepSeek's MLA shapes without absorption), and MUSA's form of it: the head dim cut into
    GEMMs of 128 and 64 (``MUSA_ATTN_MUSA_FORMS``: docs/musa.md). Their row gathers copy K and V in two loops a
    stage, which TileLang 0.1.15 generated only with one stage (seen on the H200, 2026-12-04: the launcher now
    gives them one)."""
    use_settings(musa_forms=musa_forms)
    kw = {"extend": dict(batch_size=3, max_seq_len=600, prefix_lens=[0, 33, 300], query_lens=[200, 1, 77]),
          "decode": dict(batch_size=6, max_seq_len=900, query_lens=[1] * 6),
          "decode_split": dict(batch_size=2, max_seq_len=9000, query_lens=[1, 1]),
          "verify": dict(batch_size=4, max_seq_len=700, query_lens=[3] * 4)}[mode]
    b = _batch(192, gpu_device, page_size=16, **kw)
    _compare(b, 16, 4, 192, torch.bfloat16, gpu_device, dv=128, fp8=fp8)


@pytest.mark.parametrize("d", [64, 96, 256])
def test_prefill_head_dims(gpu_device, d):
    b = _batch(d, gpu_device, batch_size=3, page_size=16, max_seq_len=400, prefix_lens=[0, 0, 77],
               query_lens=[1, 257, 130])
    _compare(b, 8, 2, d, torch.bfloat16, gpu_device)


def test_fp16(gpu_device):
    b = _batch(3, gpu_device, batch_size=4, page_size=16, max_seq_len=500, max_query_len=200)
    _compare(b, 32, 8, 128, torch.float16, gpu_device)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 1), (12, 4)])
def test_gqa_ratios_extend(gpu_device, hq, hkv):
    b = _batch(hq * 10 + hkv, gpu_device, batch_size=4, page_size=64, max_seq_len=600, max_query_len=250)
    _compare(b, hq, hkv, 128, torch.bfloat16, gpu_device)


def test_non_causal(gpu_device):
    b = _batch(4, gpu_device, batch_size=3, page_size=16, max_seq_len=300, max_query_len=150)
    _compare(b, 16, 4, 128, torch.bfloat16, gpu_device, causal=False)


@pytest.mark.parametrize("opts", [dict(sliding_window=100), dict(logit_softcap=30.0), dict(sinks=True),
                                  dict(sliding_window=64, logit_softcap=20.0, sinks=True)],
                         ids=["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("mode", ["extend", "decode", "decode_split"])
def test_options(gpu_device, opts, mode):
    hq = 16
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(hq, device=gpu_device)
    if mode == "extend":
        b = _batch(1, gpu_device, batch_size=4, page_size=16, max_seq_len=800, max_query_len=300)
    elif mode == "decode":
        b = _batch(2, gpu_device, batch_size=40, page_size=16, max_seq_len=900, decode=True)
    else:
        b = _batch(3, gpu_device, batch_size=2, page_size=16, max_seq_len=3000, decode=True)
    _compare(b, hq, 4, 128, torch.bfloat16, gpu_device, **opts)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("batch_size,max_len", [(1, 32768), (3, 9000), (64, 2000), (200, 300)])
def test_decode_long_and_wide(gpu_device, page_size, batch_size, max_len):
    b = _batch(batch_size + page_size, gpu_device, batch_size=batch_size, page_size=page_size,
               max_seq_len=max_len, decode=True)
    _compare(b, 32, 8, 128, torch.bfloat16, gpu_device)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("batch_size,max_len,sinks", [(1, 32768, False), (3, 9000, True), (5, 700, False)])
def test_decode_chunked_combine(gpu_device, use_settings, batch_size, max_len, sinks, chunked):
    """The split-KV combine reading 8 splits at a time (the default) and one by one
    (``MUSA_ATTN_CHUNKED_COMBINE=0``): split counts that are and are not multiples of 8 (the wave model gives
    1-64 here), with and without sinks."""
    use_settings(chunked_combine=chunked)
    b = _batch(7 + batch_size, gpu_device, batch_size=batch_size, page_size=16, max_seq_len=max_len, decode=True)
    opts = dict(sinks=torch.randn(32, device=gpu_device)) if sinks else {}
    _compare(b, 32, 8, 128, torch.bfloat16, gpu_device, **opts)


@pytest.mark.parametrize("q_len", [2, 4, 8])
def test_short_queries_speculative_verify(gpu_device, q_len):
    b = _batch(q_len, gpu_device, batch_size=6, page_size=16, max_seq_len=2000, query_lens=[q_len] * 6)
    _compare(b, 32, 8, 128, torch.bfloat16, gpu_device)


def test_decode_mqa_large_group(gpu_device):
    b = _batch(9, gpu_device, batch_size=7, page_size=64, max_seq_len=3000, decode=True)
    _compare(b, 64, 1, 128, torch.bfloat16, gpu_device)  # 64 rows per KV head


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_fp8_kv_cache(gpu_device, mode):
    if mode == "extend":
        b = _batch(5, gpu_device, batch_size=3, page_size=16, max_seq_len=600, max_query_len=200)
    else:
        b = _batch(6, gpu_device, batch_size=4, page_size=16, max_seq_len=5000, decode=True)
    _compare(b, 32, 8, 128, torch.bfloat16, gpu_device, fp8=True)


def test_long_prefill(gpu_device):
    b = _batch(11, gpu_device, batch_size=1, page_size=64, max_seq_len=4096, prefix_lens=[0], query_lens=[4096])
    _compare(b, 16, 4, 128, torch.bfloat16, gpu_device)


@pytest.mark.parametrize("page_size,causal", [(64, True), (128, True), (128, False), (256, True)])
def test_long_extends_tma_tiles(gpu_device, page_size, causal):
    """The TMA ping-pong kernels' producer reads the page table for 32 tiles' copies at once (one per lane, 16
    tiles for 64-row chunks): requests of up to 70 key tiles (several reads), with cached prefixes and
    shuffled pages, check each copy's rows."""
    b = _batch(page_size + causal, gpu_device, batch_size=3, page_size=page_size, max_seq_len=9000,
               prefix_lens=[4000, 0, 300], query_lens=[5000, 4500, 129])
    cfg = tilelang_impl.prefill_config(128, 128, page_size=page_size)
    plat = tilelang_impl.get_platform()
    assert cfg.tma and cfg.pingpong == (plat.warp_specialized and plat.gemm_a_in_registers)
    _compare(b, 16, 4, 128, torch.bfloat16, gpu_device, causal=causal)


def test_tilelang_rejects_unsupported(gpu_device):
    b = _batch(0, gpu_device, batch_size=2, page_size=16, max_seq_len=50)
    kc, vc, _, _ = b.make_kv(2, 72, torch.bfloat16)
    q = torch.randn(b.num_tokens, 4, 72, device=gpu_device).bfloat16()
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_attention(q, kc, vc, b.meta(), impl="tilelang")
    kc, vc, _, _ = b.make_kv(2, 64, torch.float32)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        paged_attention(torch.randn(b.num_tokens, 4, 64, device=gpu_device), kc, vc, b.meta(), impl="tilelang")


@pytest.mark.parametrize("page_size,d,variant", [(1, 128, "causal"), (16, 128, "non_causal"), (1, 64, "softcap"),
                                                 (16, 128, "sinks"), (1, 128, "fused_mqa"), (64, 128, "decodes"),
                                                 (1, 256, "causal")])
def test_prefill_from_new_kv(gpu_device, use_settings, monkeypatch, page_size, d, variant):
    """The default new-K/V prefill: a batch without cached prefixes (``new_kv_only``; after leading decodes
    with ``decodes``) reads its keys from the new K/V rows, whatever the page size. With the new K/V equal to
    what the cache holds the result is the reference's; with them perturbed it follows them (the new rows were
    read, not the pages). Ragged lengths that are not multiples of the tile, a request longer than 2 tiles; head
    dim 256 takes the TMA-tile kernel without ping-pong (the MUSA path's kernel)."""
    import dataclasses

    use_settings(new_kv_prefill=True, split_mixed=True)  # the defaults
    hq, hkv, dtype, causal, opts = 16, 4, torch.bfloat16, variant != "non_causal", {}
    if variant == "softcap":
        opts["logit_softcap"] = 30.0
    elif variant == "sinks":
        opts["sinks"] = torch.randn(hq, device=gpu_device)
    elif variant == "fused_mqa":
        hq, hkv = 8, 1
    nd = 3 if variant == "decodes" else 0
    qlens = [1] * nd + [1, 77, 300, 1030, 129]
    b = _batch(11 + page_size + d, gpu_device, batch_size=len(qlens), page_size=page_size, max_seq_len=2000,
               query_lens=qlens, prefix_lens=[500, 9, 1200][:nd] + [0] * (len(qlens) - nd))
    k_cache, v_cache, ks, vs = b.make_kv(hkv, d, dtype)
    new_k = torch.cat([x[p:] for x, p in zip(ks, b.prefix_lens)])
    new_v = torch.cat([x[p:] for x, p in zip(vs, b.prefix_lens)])
    if variant == "fused_mqa":  # 2-D strided views of a fused [q | k | v] projection, as the engines pass them
        qkv = torch.randn(b.num_tokens, (hq + 2 * hkv) * d, device=gpu_device).to(dtype)
        qkv[:, hq * d:(hq + hkv) * d] = new_k.flatten(1)
        qkv[:, (hq + hkv) * d:] = new_v.flatten(1)
        new_k, new_v = qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    q = torch.randn(b.num_tokens, hq, d, generator=torch.Generator().manual_seed(2)).to(dtype).to(gpu_device)
    meta = dataclasses.replace(b.meta(), num_decodes=nd, new_kv_only=True)
    ran = []
    real = tilelang_impl.prefill_kernel
    monkeypatch.setattr(tilelang_impl, "prefill_kernel", lambda *a, **k: ran.append(k.get("ragged")) or real(*a, **k))
    out, lse = paged_attention(q, k_cache, v_cache, meta, causal=causal, return_lse=True, new_kv=(new_k, new_v),
                               impl="tilelang", **opts)
    assert ran == [True], ran
    ref, ref_lse = paged_attention(q, k_cache, v_cache, meta, causal=causal, return_lse=True, impl="reference",
                                   **opts)
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, lse=True)
    # perturbed new K/V: the prefill rows follow them, the decode rows (the cache) do not move
    bumped = paged_attention(q, k_cache, v_cache, meta, causal=causal, new_kv=(new_k, new_v + 1), impl="tilelang",
                             **opts)
    t = nd
    assert torch.equal(bumped[:t], out[:t])
    assert (bumped[t:].float() - out[t:].float()).abs().mean() > 0.5


@pytest.mark.parametrize("kind", ["prefill", "decode_split_kv", "mixed_split", "new_kv"])
def test_out_is_written_in_place(gpu_device, kind):
    """``out=`` on the TileLang path: rows of a larger, NaN-filled buffer (an engine's padded output) are
    written by every kind of launch (prefill, split-KV decode + combine, a mixed batch's decode and prefill
    launches, the new-K/V prefill), come back as the result, equal a call without ``out=``, and the rows past
    the batch stay untouched; a non-contiguous ``out`` is refused before anything launches."""
    import dataclasses

    if kind == "decode_split_kv":
        b = _batch(21, gpu_device, batch_size=2, page_size=16, max_seq_len=6000, decode=True)
    else:
        b = _batch(22, gpu_device, batch_size=4, page_size=16, max_seq_len=700,
                   query_lens=[1, 1, 300, 129] if kind != "new_kv" else [40, 300, 129, 7],
                   prefix_lens=[500, 33, 0, 77] if kind != "new_kv" else [0, 0, 0, 0])
    k_cache, v_cache, ks, vs = b.make_kv(8, 128, torch.bfloat16)
    meta = b.meta()
    opts = {}
    if kind == "mixed_split":
        meta = dataclasses.replace(meta, num_decodes=2)
    if kind == "new_kv":
        meta = dataclasses.replace(meta, new_kv_only=True)
        opts["new_kv"] = (torch.cat(ks), torch.cat(vs))
    q = torch.randn(b.num_tokens, 32, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = q.to(gpu_device)
    want, want_lse = paged_attention(q, k_cache, v_cache, meta, return_lse=True, impl="tilelang", **opts)
    engine = torch.full((b.num_tokens + 3, 32, 128), float("nan"), dtype=torch.bfloat16, device=gpu_device)
    out, lse = paged_attention(q, k_cache, v_cache, meta, return_lse=True, impl="tilelang",
                               out=engine[:b.num_tokens], **opts)
    assert out.data_ptr() == engine.data_ptr() and out.shape == want.shape
    assert not torch.isnan(engine[:b.num_tokens]).any(), "rows the kernels left unwritten"
    assert torch.isnan(engine[b.num_tokens:]).all(), "rows past the batch were written"
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    with pytest.raises(ValueError, match="out must be contiguous"):
        paged_attention(q, k_cache, v_cache, meta, impl="tilelang",
                        out=torch.empty(32, b.num_tokens, 128, dtype=torch.bfloat16, device=gpu_device).transpose(0, 1))
