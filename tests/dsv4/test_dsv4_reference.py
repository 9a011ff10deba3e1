"""DeepSeek-V4 caches and sparse MQA on the CPU: the writers byte for byte against a packer written here from the
byte rules alone (its own e4m3 encoder, float64 scales), the reader and the reference sparse MQA against a float64
implementation that decodes the bytes by hand, every page geometry both engines use (SGLang's 256-row SWA pages,
vLLM's 64, C4's 64, C128's 2, vLLM's pages packed into larger physical blocks), invalid entries of every kind, and
NaN in every byte of every row no entry selects."""

import math
import random

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

# ---- the independent packer: the byte rules of the issue, nothing from the package ---------------------------


def e4m3_bits(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even e4m3 (finite, |x| <= 448) bit patterns of float64 values, by hand."""
    a = x.abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=-6)
    m = torch.round(a / torch.exp2(e - 3))  # torch.round: half to even
    up = m >= 16
    e, m = torch.where(up, e + 1, e), torch.where(up, m / 2, m)
    normal = m >= 8
    exp_field = torch.where(normal, e + 7, torch.zeros_like(e))
    mant = torch.where(normal, m - 8, m)
    bits = (exp_field * 8 + mant).to(torch.int64)
    bits = torch.where(a == 0, torch.zeros_like(bits), bits)
    return (bits | (torch.signbit(x).to(torch.int64) << 7)).to(torch.uint8)


def e4m3_value(b: torch.Tensor) -> torch.Tensor:
    """float64 value of e4m3 bit patterns (NaN for 0x7f / 0xff)."""
    b = b.to(torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).double()
    exp_field, mant = (b >> 3) & 15, (b & 7).double()
    val = torch.where(exp_field == 0, mant * 2.0 ** -9, (8 + mant) * torch.exp2(exp_field.double() - 10))
    val = torch.where((b & 127) == 127, torch.full_like(val, float("nan")), val)
    return sign * val


def pack_rows(kv: torch.Tensor):
    """(data [T, 576], scales [T, 8]) bytes of bf16 rows, from the rules: per 64-value tile
    scale = 2^ceil(log2(max(amax, 1e-4) / 448)) as byte e + 127; nope = e4m3(x / scale); RoPE as bf16."""
    x = kv.double()
    data = torch.zeros(kv.shape[0], 576, dtype=torch.uint8)
    scales = torch.zeros(kv.shape[0], 8, dtype=torch.uint8)
    for t in range(7):
        tile = x[:, 64 * t:64 * (t + 1)]
        e = torch.tensor([math.ceil(math.log2(max(float(r.abs().max()), 1e-4) / 448)) for r in tile],
                         dtype=torch.float64)
        scales[:, t] = (e + 127).to(torch.uint8)
        data[:, 64 * t:64 * (t + 1)] = e4m3_bits(tile / torch.exp2(e)[:, None])
    data[:, 448:] = kv[:, 448:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return data, scales


def page_bytes_of(cache, slot):
    """(data bytes, scale bytes) of one slot, read from the raw storage by the byte rules."""
    rows = cache.shape[1]
    page, row = divmod(slot, rows)
    raw = torch.as_strided(cache, (cache.untyped_storage().nbytes(),), (1,), 0)
    base = cache.storage_offset() + page * cache.stride(0)
    scale_at = base + rows * 576 + row * 8
    return raw[base + row * 576: base + row * 576 + 576], raw[scale_at: scale_at + 8]


def decode_row(data, scales) -> torch.Tensor:
    """float64 [512] row from its bytes, by hand."""
    nope = e4m3_value(data[:448]).view(7, 64) * torch.exp2(scales[:7].double() - 127)[:, None]
    rope = data[448:].clone().view(torch.bfloat16).double()
    return torch.cat([nope.reshape(-1), rope])


def random_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(n, 1).uniform_(math.log(1e-3), math.log(1e2), generator=g))
    kv = (torch.randn(n, 512, generator=g) * mag).to(torch.bfloat16)
    kv[0, :64] = 0  # an all-zero tile: the amax floor
    kv[1, 64:128] = 7 * 2.0 ** -3  # amax / 448 exactly a power of two
    return kv


# geometry: (pages, rows a page, page stride in bytes: 0 = the padded page, else a packed vLLM block)
GEOMETRIES = [(3, 256, 0), (6, 64, 0), (5, 64, 93888), (9, 2, 0), (4, 2, 93888)]


@pytest.mark.parametrize("pages,rows,stride", GEOMETRIES)
def test_write_kv_v4_is_byte_exact(pages, rows, stride):
    cache = L.new_kv_cache(pages, rows, page_stride=stride)
    cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0).fill_(0xA5)  # bytes no write may touch
    n = min(40, pages * rows)
    slots = torch.tensor(random.Random(rows).sample(range(pages * rows), n), dtype=torch.int64)
    slots[3] = -1  # skipped
    slots[5] = pages * rows  # at the slot count: skipped, nothing written out of bounds
    kv = random_rows(n, rows)
    before = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0).clone()
    dsv4.write_kv_v4(kv, cache, slots)
    data, scales = pack_rows(kv)
    touched = torch.zeros_like(before, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0 or s >= pages * rows:
            continue
        d, sc = page_bytes_of(cache, s)
        assert torch.equal(d, data[t]), (t, s, (d != data[t]).nonzero()[:5])
        assert torch.equal(sc[:7], scales[t, :7]) and sc[7] == 0
        page, row = divmod(s, rows)
        base = cache.storage_offset() + page * cache.stride(0)
        touched[base + row * 576: base + row * 576 + 576] = True
        touched[base + rows * 576 + row * 8: base + rows * 576 + row * 8 + 8] = True
    after = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
    assert torch.equal(after[~touched], before[~touched]), "bytes outside the written rows changed"


def test_read_kv_v4_decodes_exactly():
    cache = L.new_kv_cache(4, 64, page_stride=93888)
    kv = random_rows(50, 5)
    slots = torch.arange(200, 250)
    dsv4.write_kv_v4(kv, cache, slots)
    got = dsv4.read_kv_v4(cache, slots[[0, 7, 49]])
    for k, s in zip(got, slots[[0, 7, 49]].tolist()):
        assert torch.equal(k.double(), decode_row(*page_bytes_of(cache, s)))  # exact in bf16
    # and it is the quantised row: within one e4m3 step (2^-4 relative) of the input
    back = dsv4.read_kv_v4(cache, slots).float()
    assert torch.allclose(back, kv.float(), rtol=2 ** -4, atol=1e-4 / 448 * 2)
    assert torch.equal(back[:, 448:], kv[:, 448:].float())


def test_write_index_k_is_byte_exact():
    rows = 64
    buf = torch.full((3, L.index_page_bytes(rows) + 192), 0x5A, dtype=torch.uint8)  # pages with slack, SGLang-like
    cache = dsv4.paged_view(buf, rows, dsv4.INDEX_ROW_BYTES)
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(20, 128, generator=g) * torch.rand(20, 1, generator=g) * 50).to(torch.bfloat16)
    slots = torch.tensor(random.Random(1).sample(range(3 * rows), 20))
    dsv4.write_index_k(k, cache, slots)
    x = k.double()
    for t, s in enumerate(slots.tolist()):
        page, row = divmod(s, rows)
        e = math.ceil(math.log2(max(float(x[t].abs().max()), 1e-4) / 448))
        assert torch.equal(buf[page, row * 128: row * 128 + 128], e4m3_bits(x[t] / 2.0 ** e))
        assert buf[page, rows * 128 + row * 4: rows * 128 + row * 4 + 4].view(torch.float32).item() == 2.0 ** e
    assert (buf[:, L.index_page_bytes(rows):] == 0x5A).all()  # the slack past the page untouched
    assert torch.allclose(dsv4.read_index_k(cache, slots), k.float(), rtol=2 ** -4, atol=1e-6)


def sparse_mqa_float64(q, caches, sink, sm_scale):
    """Per token and head, in float64, rows decoded from the bytes by hand. ``caches``: (cache, indices, lengths)."""
    T, H, _ = q.shape
    o = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        rows = []
        for cache, idx, lens in caches:
            slots = cache.shape[0] * cache.shape[1]
            n = idx.shape[1] if lens is None else int(lens[t])
            for j in range(idx.shape[1]):
                s = int(idx[t, j])
                if j < n and 0 <= s < slots:
                    rows.append(decode_row(*page_bytes_of(cache, s)))
        if not rows:
            continue
        kv = torch.stack(rows)
        s = q[t].double() @ kv.T * sm_scale  # [H, n]
        lse[t] = torch.logsumexp(s, dim=-1)
        m = s.amax(dim=-1)
        if sink is not None:
            m = torch.maximum(m, sink.double())
        p = torch.exp(s - m[:, None])
        den = p.sum(-1) + (torch.exp(sink.double() - m) if sink is not None else 0)
        o[t] = (p @ kv) / den[:, None]
    return o, lse


def nan_cache(pages, rows, stride=0):
    cache = L.new_kv_cache(pages, rows, page_stride=stride)
    cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0).fill_(0xFF)  # NaN e4m3 / bf16, NaN scales
    return cache


@pytest.mark.parametrize("heads,with_extra,with_sink", [(8, True, True), (16, False, True), (3, True, False)])
def test_sparse_mqa_reference_matches_float64(heads, with_extra, with_sink):
    rng = random.Random(heads)
    T = 6
    swa = nan_cache(5, 64, stride=93888)  # vLLM-like SWA pages in packed blocks
    extra = nan_cache(7, 2)  # C128-like pages of 2 rows
    written = []
    for cache, seed in ((swa, 1), (extra, 2)):
        n = cache.shape[0] * cache.shape[1]
        slots = torch.tensor(rng.sample(range(n), n // 2))
        dsv4.write_kv_v4(random_rows(len(slots), seed), cache, slots)
        written.append(slots)

    g = torch.Generator().manual_seed(heads)

    def indices(slots, k, n_slots):
        idx = torch.tensor([[rng.choice(slots.tolist()) for _ in range(k)] for _ in range(T)], dtype=torch.int32)
        idx[torch.rand(T, k, generator=g) < 0.2] = -1  # invalid
        idx[0, 1] = n_slots  # one past the end
        idx[1, 2] = n_slots + 1000
        return idx

    idx = indices(written[0], 70, 320)
    lens = torch.tensor([70, 3, 0, 64, 65, 17], dtype=torch.int32)  # ragged, one empty
    ext = indices(written[1], 9, 14) if with_extra else None
    ext_lens = torch.tensor([9, 9, 0, 4, 1, 2], dtype=torch.int32) if with_extra else None
    q = (torch.randn(T, heads, 512, generator=g) * 3).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g) if with_sink else None
    o, lse = dsv4.sparse_mqa(q, swa, idx, lens, extra_cache=extra if with_extra else None, extra_indices=ext,
                             extra_lengths=ext_lens, sink=sink, return_lse=True)
    caches = [(swa, idx, lens)] + ([(extra, ext, ext_lens)] if with_extra else [])
    o64, lse64 = sparse_mqa_float64(q, caches, sink, 512 ** -0.5)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert torch.allclose(o.double(), o64, atol=2e-2, rtol=2e-2)  # bf16 output
    empty = ~torch.isfinite(lse64)
    assert torch.equal(~torch.isfinite(lse), empty) and (o[empty[:, 0]] == 0).all()
    assert torch.allclose(lse[~empty].double(), lse64[~empty], atol=1e-4, rtol=1e-5)
    # float32 output: tighter (only float32 accumulation in the way; the rows reach magnitudes of 1e2)
    o32 = dsv4.sparse_mqa(q.float(), swa, idx, lens, extra_cache=extra if with_extra else None, extra_indices=ext,
                          extra_lengths=ext_lens, sink=sink)
    assert torch.allclose(o32.double(), o64, atol=1e-5 * float(o64.abs().max()), rtol=1e-4)


def test_sink_only_row_and_out_parameter():
    """A token with no valid entry: zeros whatever the sink; ``out`` is written in place and returned."""
    cache = nan_cache(2, 64)
    q = torch.randn(2, 4, 512).to(torch.bfloat16)
    idx = torch.full((2, 64), -1, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    res, lse = dsv4.sparse_mqa(q, cache, idx, sink=torch.randn(4), out=out, return_lse=True)
    assert res is out and (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("call,match", [
    (lambda c, q, i: dsv4.sparse_mqa(q[..., :256], c, i), r"q must be \[num_tokens, num_heads, 512\]"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i.long()), r"indices must be an int32 tensor"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i[:1]), r"indices has 1 rows for 3 query tokens"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c.view(torch.int8), i), r"cache must be a uint8 tensor"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c[:, :, :576], i), r"cache must be \[pages, rows, 584\]"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i, extra_indices=i), r"extra_cache and extra_indices go together"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i, sink=torch.zeros(5)), r"sink must be a float32 tensor \[4\]"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i, lengths=torch.zeros(2, dtype=torch.int32)),
     r"lengths of indices must be a 1-D integer tensor of 3"),
    (lambda c, q, i: dsv4.sparse_mqa(q.repeat(1, 33, 1), c, i), r"num_heads must be in \[1, 128\], got 132"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i, out=torch.empty(3, 4, 512)), r"out must be a contiguous"),
    (lambda c, q, i: dsv4.sparse_mqa(q, c, i, impl="triton"), r"impl must be one of"),
    (lambda c, q, i: dsv4.write_kv_v4(q[:, 0], c, torch.tensor([0.0, 1, 2])), r"slots must be a 1-D integer"),
    (lambda c, q, i: dsv4.write_kv_v4(q[:, 0, :448], c, torch.tensor([0, 1, 2])), r"kv must be \[num_tokens, 512\]"),
    (lambda c, q, i: dsv4.read_kv_v4(c, torch.tensor([-1])), r"every slot must be in \[0, 128\)"),
    (lambda c, q, i: dsv4.write_index_k(q[:, 0, :128], c, torch.tensor([0, 1, 2])), r"rows of 132-byte|132\]"),
    (lambda c, q, i: dsv4.norm_rope_write_kv_v4(q[:, 0, :448], torch.ones(512), 1e-6, torch.ones(8, 32),
                                                torch.ones(8, 32), torch.arange(3), c, torch.arange(3)),
     r"kv must be a bf16/fp16/fp32 \[T, 512\]"),
    (lambda c, q, i: dsv4.norm_rope_write_kv_v4(q[:, 0], torch.ones(512), 1e-6, torch.ones(8, 64),
                                                torch.ones(8, 32), torch.arange(3), c, torch.arange(3)),
     r"cos must be a \[max_pos, 32\]"),
    (lambda c, q, i: dsv4.norm_rope_write_kv_v4(q[:, 0], torch.ones(512), 1e-6, torch.ones(8, 32),
                                                torch.ones(8, 32), torch.arange(2), c, torch.arange(3)),
     r"positions must be an integer \[3\]"),
])
def test_argument_errors_name_the_argument(call, match):
    cache = L.new_kv_cache(2, 64)
    q = torch.randn(3, 4, 512).to(torch.bfloat16)
    idx = torch.zeros(3, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        call(cache, q, idx)


def test_page_geometry():
    assert L.page_bytes(256) == 149760 and L.page_bytes(64) == 37440 and L.page_bytes(2) == 1728
    assert L.index_page_bytes(64) == 8448
    buf = torch.zeros(3, L.page_bytes(256), dtype=torch.uint8)
    view = dsv4.paged_view(buf, 256)
    assert view.shape == (3, 256, 584) and view.stride() == (149760, 584, 1)
    flash_mla_view = view.unsqueeze(2)  # [pages, rows, 1, 584]
    assert L.kv_pages(flash_mla_view).num_slots == 768
    with pytest.raises(ValueError, match="page stride 500 is smaller"):
        L.kv_pages(torch.zeros(4000, dtype=torch.uint8).as_strided((3, 2, 584), (500, 584, 1)))


@pytest.mark.parametrize("s_q", [1, 2])
def test_flash_mla_with_kvcache_is_sparse_mqa_in_flashmla_shapes(s_q):
    """FlashMLA's decode entry point: [B, s_q, H, 512] queries, per-request top-k lengths, lse [B, H, s_q] with
    +inf for a query with no valid entry; the same numbers as sparse_mqa on the flattened tokens."""
    rng = random.Random(0)
    cache = nan_cache(4, 64, stride=93888)
    slots = torch.tensor(rng.sample(range(256), 128))
    dsv4.write_kv_v4(random_rows(128, 9), cache, slots)
    B, H, K = 3, 8, 40
    idx = slots[torch.randint(0, 128, (B, s_q, K))].to(torch.int32)
    idx[2] = -1  # request 2: nothing valid
    lens = torch.tensor([40, 7, 40], dtype=torch.int32)
    q = torch.randn(B, s_q, H, 512).to(torch.bfloat16)
    sink = torch.randn(H)
    meta, none = dsv4.get_mla_metadata()
    assert none is None and isinstance(meta, dsv4.FlashMLASchedMeta)
    out, lse = dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, 512, meta, indices=idx,
                                           attn_sink=sink, topk_length=lens, softmax_scale=0.05)
    assert out.shape == (B, s_q, H, 512) and lse.shape == (B, H, s_q)
    ref, ref_lse = dsv4.sparse_mqa(q.view(B * s_q, H, 512), cache, idx.view(B * s_q, K), lens.repeat_interleave(s_q),
                                   sink=sink, sm_scale=0.05, return_lse=True)
    assert torch.equal(out.view(-1, H, 512), ref)
    assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()
    assert torch.equal(lse[:2].transpose(1, 2).reshape(-1, H), ref_lse[:2 * s_q])


@pytest.mark.parametrize("kwargs,match", [
    (dict(indices=None), "only sparse attention is supported"),
    (dict(causal=True), "causal must be False"),
    (dict(is_fp8_kvcache=False), "is_fp8_kvcache must be True"),
    (dict(head_dim_v=448), "head_dim_v must be 512"),
    (dict(num_splits=4), "num_splits must be None"),
])
def test_flash_mla_with_kvcache_refuses_what_flashmla_refuses(kwargs, match):
    cache = L.new_kv_cache(2, 64).unsqueeze(2)
    q = torch.randn(1, 1, 64, 512).to(torch.bfloat16)
    args = dict(indices=torch.zeros(1, 1, 64, dtype=torch.int32))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dsv4.flash_mla_with_kvcache(q, cache, None, None, **args)


def test_flash_mla_sparse_fwd_matches_float64():
    """FlashMLA's prefill entry point over a bf16 workspace: out, max_logits, lse as its reference defines them
    (lse = +inf, max_logits = -inf for a query with no valid entry; an index >= s_kv invalid)."""
    g = torch.Generator().manual_seed(4)
    S, H, S_kv, K = 5, 4, 50, 33
    q = torch.randn(S, H, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(S_kv, 1, 512, generator=g).to(torch.bfloat16)
    kv[40:] = float("nan")  # rows nobody may read: only invalid entries point there
    idx = torch.randint(0, 40, (S, 1, K), generator=g, dtype=torch.int32)
    idx[:, 0, 3] = S_kv  # invalid: >= s_kv
    idx[:, 0, 4] = -1
    idx[4] = -1  # a lonely query
    idx[1, 0, 20] = 45  # a NaN row past query 1's length: never read
    lens = torch.tensor([33, 10, 1, 0, 33], dtype=torch.int32)
    sink = torch.tensor([0.5, float("inf"), float("-inf"), -1.0])
    out, max_logits, lse = dsv4.flash_mla_sparse_fwd(q, kv, idx, 0.04, attn_sink=sink, topk_length=lens)
    for t in range(S):
        rows = [kv[int(i), 0].double() for j, i in enumerate(idx[t, 0].tolist()) if j < lens[t] and 0 <= i < S_kv]
        if not rows:
            assert torch.isposinf(lse[t]).all() and torch.isneginf(max_logits[t]).all() and (out[t] == 0).all()
            continue
        kvt = torch.stack(rows)
        s = q[t].double() @ kvt.T * 0.04
        l64 = torch.logsumexp(s, -1)
        assert torch.allclose(lse[t].double(), l64, atol=1e-5) and torch.allclose(max_logits[t].double(), s.amax(-1))
        o = torch.softmax(s, -1) @ kvt * torch.sigmoid(l64 - sink.double())[:, None]
        assert torch.allclose(out[t].double(), o, atol=2e-2, rtol=2e-2)
    assert (out[:4, 1] == 0).all()  # sink +inf: zero output


def test_write_index_k_exact_scale_is_byte_exact():
    """``scale="exact"`` (SGLang's indexer keys): the float32 ``max(amax, 1e-4) / 448`` itself, the values
    ``e4m3(x / scale)`` of the float32 quotient."""
    rows = 64
    buf = torch.full((2, L.index_page_bytes(rows)), 0x5A, dtype=torch.uint8)
    cache = dsv4.paged_view(buf, rows, dsv4.INDEX_ROW_BYTES)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(30, 128, generator=g) * torch.rand(30, 1, generator=g) * 50
    k[0] = 0.0  # the floor
    slots = torch.tensor(random.Random(2).sample(range(2 * rows), 30))
    dsv4.write_index_k(k, cache, slots, scale="exact")
    for t, s in enumerate(slots.tolist()):
        page, row = divmod(s, rows)
        scale = (torch.tensor(max(float(k[t].abs().max()), 1e-4), dtype=torch.float32) / 448).item()
        q = (k[t] / torch.tensor(scale, dtype=torch.float32)).double()
        assert torch.equal(buf[page, row * 128: row * 128 + 128], e4m3_bits(q)), t
        assert buf[page, rows * 128 + row * 4: rows * 128 + row * 4 + 4].view(torch.float32).item() == scale
    with pytest.raises(ValueError, match="scale must be 'pow2' or 'exact'"):
        dsv4.write_index_k(k, cache, slots, scale="ue8m0")
