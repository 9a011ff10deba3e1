"""The PyTorch KV write (``write_kv``) and FP8 quantisation: slots scattered into paged caches, negative slots
skipped, strided vLLM views, and an FP8 cache written then read by the reference attention."""

import random

import pytest
import torch

from musa_attn_backend.kernels import paged_attention, quantize_fp8, write_kv
from musa_attn_backend.testing import dense_attention, random_batch
from musa_attn_backend.testing.numeric import assert_close


def _poisoned_cache(pages, page_size, h, d, dtype):
    return torch.full((pages, page_size, h, d), float("nan")).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_scatters_and_skips_negative_slots(dtype):
    g = torch.Generator().manual_seed(0)
    pages, page_size, h, d, n = 6, 16, 2, 64, 40
    k = torch.randn(n, h, d, generator=g).to(dtype)
    v = torch.randn(n, h, d, generator=g).to(dtype)
    slots = torch.randperm(pages * page_size, generator=g)[:n]
    slots[::5] = -1
    kc, vc = _poisoned_cache(pages, page_size, h, d, dtype), _poisoned_cache(pages, page_size, h, d, dtype)
    write_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, h, d), vc.view(-1, h, d)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.isnan(flat_k[untouched].float()).all() and torch.isnan(flat_v[untouched].float()).all()


def test_write_kv_into_strided_vllm_style_views():
    """vLLM hands K and V as views of one [blocks, heads, block_size, 2*D] buffer."""
    blocks, bs, h, d, n = 5, 16, 2, 32, 30
    buf = torch.full((blocks, h, bs, 2 * d), float("nan"))
    kc, vc = buf.transpose(1, 2).split(d, dim=-1)  # [blocks, bs, h, d] each, strided
    assert not kc.is_contiguous()
    k, v = torch.randn(n, h, d), torch.randn(n, h, d)
    slots = torch.randperm(blocks * bs)[:n]
    write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc[slots // bs, slots % bs], k) and torch.equal(vc[slots // bs, slots % bs], v)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_kv_write_then_attention_matches_sdpa_on_dequantised_kv(per_head):
    rng = random.Random(8)
    hq, hkv, d = 8, 2, 64
    batch = random_batch(rng, batch_size=3, page_size=16, max_seq_len=100, max_query_len=30)
    _, _, ks, vs = batch.make_kv(hkv, d, torch.bfloat16)
    k_scale = torch.tensor([0.02, 0.03]) if per_head else 0.025
    v_scale = torch.tensor([0.05, 0.01]) if per_head else torch.tensor(0.02)
    fp8 = torch.float8_e4m3fn
    kc = torch.full((batch.num_pages, 16, hkv, d), float("nan")).to(fp8)
    vc = kc.clone()
    slots = torch.tensor([batch.slot(b, p) for b, n in enumerate(batch.seq_lens) for p in range(n)])
    write_kv(torch.cat(ks), torch.cat(vs), kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(batch.num_tokens, hq, d).bfloat16()
    out = paged_attention(q, kc, vc, batch.meta(), k_scale=k_scale, v_scale=v_scale)
    ksc = torch.as_tensor(k_scale).reshape(-1).view(1, -1, 1) if per_head else k_scale
    vsc = torch.as_tensor(v_scale).reshape(-1).view(1, -1, 1)
    cu = 0
    for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
        kd = quantize_fp8(ks[b], k_scale).float() * ksc
        vd = quantize_fp8(vs[b], v_scale).float() * vsc
        # e4m3 keeps 3 mantissa bits: dequantised values are within 1/16 relative (plus the clamp range). A
        # bound on quantisation itself, not on an attention output: not from the tolerance table.
        torch.testing.assert_close(kd, ks[b].float(), rtol=0.07, atol=0.02)
        ref = dense_attention(q[cu: cu + n], kd, vd, prefix_len=p, causal=True, sm_scale=d ** -0.5)
        # both read the same dequantised values: the reference bound of bf16, not widened for FP8
        assert_close(out[cu: cu + n], ref, torch.bfloat16, reference=True)
        cu += n


def test_quantize_fp8_clamps():
    x = torch.tensor([[[1000.0, -1000.0, 1.0]]])
    y = quantize_fp8(x, 1.0).float()
    assert y.tolist() == [[[448.0, -448.0, 1.0]]]
