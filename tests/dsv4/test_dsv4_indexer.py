"""DeepSeek-V4's indexer on the CPU: the logits references (prefill and paged) against float64 loops written here
from the formula, on keys read back from the bytes by hand (page stride, scale words), every range and length
case (empty, cut, negative, past the keys), invalid page entries, MTP rows; the top-k reference against sorting
in Python (ties compared as sets, short rows in position order, page-table slots, NaN); the argument checks."""

import math

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

E4M3 = torch.float8_e4m3fn


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(E4M3)


def logits64(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_h w[t, h] relu(q[t, h] . k[s]) scale[s]``, head by head."""
    qd, kd = q.double(), keys.double()
    out = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.float64)
    for h in range(q.shape[1]):
        out += (qd[:, h] @ kd.T).clamp(min=0) * w[:, h].double()[:, None]
    return out * scales.double()[None, :]


def close(a: torch.Tensor, b: torch.Tensor, rtol=2e-5) -> bool:
    """Equal ``-inf`` pattern, finite values within ``rtol`` of the row's largest magnitude (float32 sums of
    64 x 128 products)."""
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return False
    fin = torch.isfinite(b)
    scale = b.abs().where(fin, torch.zeros_like(b)).amax().clamp(min=1e-30)
    return bool(((a.double() - b.double()).abs().where(fin, torch.zeros_like(b.double())) <= rtol * scale).all())


@pytest.mark.parametrize("T,S,H", [(1, 1, 64), (7, 300, 64), (33, 129, 32), (4, 1000, 16)])
def test_indexer_logits_matches_float64(T, S, H):
    g = torch.Generator().manual_seed(T * 1000 + S)
    q = fp8(torch.randn(T, H, 128, generator=g) * 3)
    w = torch.randn(T, H, generator=g)
    k = fp8(torch.randn(S, 128, generator=g) * 2)
    ks = torch.rand(S, generator=g) + 0.25
    starts = torch.randint(-3, S + 2, (T,), generator=g, dtype=torch.int32)
    ends = starts + torch.randint(-2, S + 3, (T,), generator=g, dtype=torch.int32)
    starts[0], ends[0] = 0, S  # one full row
    want = logits64(q, w, k, ks)
    col = torch.arange(S)[None, :]
    inside = (col >= starts[:, None].long()) & (col < ends[:, None].long())
    got = dsv4.indexer_logits(q, w, k, ks, starts, ends)
    assert close(got, want.masked_fill(~inside, float("-inf")))
    raw = dsv4.indexer_logits(q, w, k, ks, starts, ends, clean=False)
    assert torch.equal(raw.masked_fill(~inside, 0), got.masked_fill(~inside, 0))


def index_cache(keys: torch.Tensor, pages: int, page_stride: int = 0, seed: int = 0):
    """A ``[pages, 64, 132]`` indexer-key cache (pages ``page_stride`` bytes apart, 0xFF bytes (NaN as e4m3 and as
    float32) between pages and in every unwritten row), the keys written at random distinct slots; returns
    (cache, slots, storage)."""
    stride = page_stride or L.index_page_bytes(64)
    buf = torch.full((pages * stride + 64,), 0xFF, dtype=torch.uint8)
    cache = buf.as_strided((pages, 64, L.INDEX_ROW_BYTES), (stride, L.INDEX_ROW_BYTES, 1))
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pages * 64, generator=g)[:keys.shape[0]]
    dsv4.write_index_k(keys, cache, slots)
    return cache, slots, buf


def read_key64(buf: torch.Tensor, stride: int, slot: int) -> tuple[torch.Tensor, float]:
    """Key ``slot``'s 128 values and its scale, read from the bytes by hand."""
    p, r = divmod(slot, 64)
    base = p * stride
    vals = buf[base + r * 128: base + r * 128 + 128].view(E4M3).double()
    scale = buf[base + 64 * 128 + r * 4: base + 64 * 128 + r * 4 + 4].view(torch.float32).item()
    return vals, scale


@pytest.mark.parametrize("next_n,two_d", [(1, False), (1, True), (2, True)])
@pytest.mark.parametrize("page_stride", [0, 93888])
def test_paged_indexer_logits_matches_float64(next_n, two_d, page_stride):
    g = torch.Generator().manual_seed(next_n * 7 + page_stride)
    B, H, P = 4, 64, 6
    lens_max = [1, 64, 200, 6 * 64]
    keys = torch.randn(P * 64 * B, 128, generator=g)
    cache, slots, buf = index_cache(keys, B * P, page_stride, seed=3)  # every row written; NaN bytes between pages
    stride = page_stride or L.index_page_bytes(64)
    table = torch.randperm(B * P, generator=g).view(B, P).to(torch.int32)
    table[2, 1] = -1  # a bad page entry inside request 2's keys
    table[1, 3] = 10 ** 6  # past the cache, but past request 1's length: never read
    q = fp8(torch.randn(B, next_n, H, 128, generator=g) * 2)
    w = torch.randn(B * next_n, H, generator=g)
    lens = torch.tensor([[max(n - next_n + 1 + j, 0) for j in range(next_n)] for n in lens_max], dtype=torch.int32)
    context_lens = lens if two_d else lens[:, 0]
    max_len = P * 64
    got = dsv4.paged_indexer_logits(q, w, cache, context_lens, table, max_len)
    assert got.shape == (B * next_n, max_len)
    for b in range(B):
        for j in range(next_n):
            n = int(lens[b, j])
            want = torch.full((max_len,), float("-inf"), dtype=torch.float64)
            for i in range(n):
                entry = int(table[b, i // 64])
                if 0 <= entry < B * P:
                    vals, scale = read_key64(buf, stride, entry * 64 + i % 64)
                    qd = q[b, j].double()
                    want[i] = ((qd @ vals).clamp(min=0) * w[b * next_n + j].double()).sum() * scale
            row = got[b * next_n + j]
            assert close(row[None], want[None]), (b, j)
            assert not torch.isnan(row).any()


def test_paged_indexer_logits_unclean_keeps_the_valid_columns():
    g = torch.Generator().manual_seed(5)
    cache, _, _ = index_cache(torch.randn(256, 128, generator=g), 4)
    q = fp8(torch.randn(2, 1, 64, 128, generator=g))
    w = torch.randn(2, 64, generator=g)
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    lens = torch.tensor([70, 128], dtype=torch.int32)
    a = dsv4.paged_indexer_logits(q, w, cache, lens, table, 128)
    b = dsv4.paged_indexer_logits(q, w, cache, lens, table, 128, clean=False)
    assert torch.equal(a[0, :70], b[0, :70]) and torch.equal(a[1], b[1])
    assert torch.isneginf(a[0, 70:]).all()


def topk_oracle(row: list, n: int, k: int) -> tuple[list, list]:
    """(positions that must be chosen, positions any of which may fill the rest) for the top-k of ``row[:n]``,
    NaN ranking lowest."""
    key = [(-math.inf if math.isnan(v) else v, 0 if math.isnan(v) else 1) for v in row[:n]]
    order = sorted(range(n), key=lambda i: (key[i][1], key[i][0]), reverse=True)
    if n <= k:
        return list(range(n)), []
    kth = key[order[k - 1]]
    must = [i for i in range(n) if (key[i][1], key[i][0]) > (kth[1], kth[0])]
    tied = [i for i in range(n) if key[i] == kth]
    return must, tied


@pytest.mark.parametrize("k", [1, 8, 64])
def test_indexer_topk_matches_sorting(k):
    g = torch.Generator().manual_seed(k)
    T, N = 12, 200
    logits = torch.randn(T, N, generator=g).round(decimals=1)  # many ties
    logits[3, 5:50] = float("nan")
    logits[4] = float("-inf")
    lengths = torch.tensor([0, 1, k - 1, 150, 100, k, k + 1, 199, 200, 250, -5, 64], dtype=torch.int32)
    starts = torch.tensor([0, 3, 0, 10, 0, 7, 0, 1, 0, 0, 0, 190], dtype=torch.int32)
    got = dsv4.indexer_topk(logits, lengths, k, starts=starts)
    assert got.shape == (T, k) and got.dtype == torch.int32
    for t in range(T):
        s = int(starts[t])
        n = max(0, min(int(lengths[t]), N - s))
        row = logits[t, s:].tolist()
        must, tied = topk_oracle(row, n, k)
        sel = [v for v in got[t].tolist() if v >= 0]
        assert got[t, len(sel):].eq(-1).all(), t  # padding only at the end
        if n <= k:
            assert sel == list(range(n)), t  # short rows: every position, in order
        else:
            assert len(sel) == k and len(set(sel)) == k, t
            assert set(must) <= set(sel) and set(sel) - set(must) <= set(tied), t


def test_indexer_topk_page_table_slots():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=g)
    lengths = torch.tensor([300, 20, 130], dtype=torch.int32)
    table = torch.randint(0, 50, (3, 5), generator=g, dtype=torch.int32)
    table[2, 1] = -1  # positions 64..127 of row 2 have no page
    pos = dsv4.indexer_topk(logits, lengths, 32)
    slots = dsv4.indexer_topk(logits, lengths, 32, page_table=table)
    for t in range(3):
        for p, s in zip(pos[t].tolist(), slots[t].tolist()):
            if p < 0:
                assert s == -1
            else:
                e = int(table[t, p // 64])
                assert s == (e * 64 + p % 64 if e >= 0 else -1)
    out = torch.empty(3, 32, dtype=torch.int32)
    assert dsv4.indexer_topk(logits, lengths, 32, page_table=table, out=out) is out and torch.equal(out, slots)


def test_indexer_argument_errors():
    q = fp8(torch.randn(2, 64, 128))
    w = torch.randn(2, 64)
    k = fp8(torch.randn(10, 128))
    ks = torch.ones(10)
    se = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be float8_e4m3fn"):
        dsv4.indexer_logits(q.float(), w, k, ks, se, se)
    with pytest.raises(ValueError, match="indexer heads must be one of"):
        dsv4.indexer_logits(fp8(torch.randn(2, 48, 128)), torch.randn(2, 48), k, ks, se, se)
    with pytest.raises(ValueError, match=r"w must be float32 \[2, 64\]"):
        dsv4.indexer_logits(q, w.bfloat16(), k, ks, se, se)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        dsv4.indexer_logits(q, w, k, ks[:5], se, se)
    with pytest.raises(ValueError, match="ends must be an integer"):
        dsv4.indexer_logits(q, w, k, ks, se, se.float())
    buf = torch.zeros(2, L.index_page_bytes(64), dtype=torch.uint8)
    c = dsv4.paged_view(buf, 64, L.INDEX_ROW_BYTES)
    q4 = fp8(torch.randn(2, 2, 64, 128))
    w4 = torch.randn(4, 64)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context_lens must be an integer \[2, 2\]"):
        dsv4.paged_indexer_logits(q4, w4, c, torch.ones(2, dtype=torch.int32), table, 128)
    with pytest.raises(ValueError, match="max_len must be an int in"):
        dsv4.paged_indexer_logits(q4, w4, c, torch.ones(2, 2, dtype=torch.int32), table, 129)
    with pytest.raises(ValueError, match="next_n must be in"):
        dsv4.paged_indexer_logits(fp8(torch.randn(2, 3, 64, 128)), torch.randn(6, 64), c,
                                  torch.ones(2, 3, dtype=torch.int32), table, 128)
    c32 = dsv4.paged_view(torch.zeros(2, L.index_page_bytes(32), dtype=torch.uint8), 32, L.INDEX_ROW_BYTES)
    with pytest.raises(ValueError, match="64 rows a page"):
        dsv4.paged_indexer_logits(q4, w4, c32, torch.ones(2, 2, dtype=torch.int32), table, 64)
    logits = torch.randn(2, 10)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="k must be an int in"):
        dsv4.indexer_topk(logits, lens, 0)
    with pytest.raises(ValueError, match="unit column stride"):
        dsv4.indexer_topk(torch.randn(10, 2).T, lens, 4)
    with pytest.raises(ValueError, match="page_rows must be a power of two"):
        dsv4.indexer_topk(logits, lens, 4, page_table=table, page_rows=48)
    with pytest.raises(ValueError, match=r"out must be a contiguous int32 \[2, 4\]"):
        dsv4.indexer_topk(logits, lens, 4, out=torch.empty(2, 4, dtype=torch.int64))


def test_paged_indexer_logits_on_an_empty_cache_is_minus_inf():
    cache = dsv4.paged_view(torch.zeros(0, L.index_page_bytes(64), dtype=torch.uint8), 64, L.INDEX_ROW_BYTES)
    q = fp8(torch.randn(2, 1, 64, 128))
    got = dsv4.paged_indexer_logits(q, torch.randn(2, 64), cache, torch.tensor([100, 0], dtype=torch.int32),
                                    torch.zeros(2, 4, dtype=torch.int32), 256)
    assert got.shape == (2, 256) and torch.isneginf(got).all()


def hadamard64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("rotate,scale,bf16_rope", [(True, "exact", False), (False, "pow2", True)])
def test_indexer_q_matches_float64(rotate, scale, bf16_rope):
    g = torch.Generator().manual_seed(int(rotate))
    T, H = 9, 64
    q = torch.randn(T, H, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(T, H, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 100, (T,), generator=g)
    ang = torch.rand(100, 32, generator=g) * 6.3
    q8, wo = dsv4.indexer_q(q, w, pos, ang.cos(), ang.sin(), rotate=rotate, scale=scale, bf16_rope=bf16_rope)
    x = q.double()
    c, s = ang.cos().double()[pos][:, None], ang.sin().double()[pos][:, None]
    r = x[..., 64:].clone()
    x[..., 64::2] = r[..., 0::2] * c - r[..., 1::2] * s
    x[..., 65::2] = r[..., 0::2] * s + r[..., 1::2] * c
    if bf16_rope:
        x = x.to(torch.bfloat16).double()
    if rotate:
        x = x @ hadamard64(128).T
    sc = x.abs().amax(-1).clamp(min=1e-4) / 448
    if scale == "pow2":
        sc = torch.exp2(torch.ceil(torch.log2(sc)))
    assert torch.allclose(wo.double(), w.double() * 128 ** -0.5 * 64 ** -0.5 * sc, rtol=1e-5)
    back = q8.double() * sc[..., None]
    assert ((back - x).abs() <= sc[..., None] * 448 / 14 + 1e-9).all()  # e4m3: 3 mantissa bits
    assert q8.float().abs().amax() <= 448


def test_c4_layer_path_equals_dense_attention_over_the_selected_rows():
    """A C4 layer end to end on the CPU: the compressors fill the C4 cache and the indexer-key cache from one
    request's tokens, the indexer (q, paged logits, top-k through the compressed page table) picks rows, and
    sparse MQA over window + picked rows equals a float64 softmax (with the sink) over exactly those rows,
    dequantised."""
    from musa_attn_backend.kernels.dsv4.compressor import compress

    g = torch.Generator().manual_seed(11)
    S, topk, H = 600, 64, 16
    n_c = S // 4  # compressed rows: 150
    ang = torch.rand(S + 1, 32, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    c4 = L.new_kv_cache(4, 64)
    ik = dsv4.paged_view(torch.zeros(4, L.index_page_bytes(64), dtype=torch.uint8), 64, L.INDEX_ROW_BYTES)
    page_table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)  # compressed position i -> page i // 64
    pos = torch.arange(S)
    slots = (page_table[0].long()[pos // 4 // 64] * 64 + (pos // 4) % 64)
    common = dict(positions=pos, token_req=torch.zeros(S, dtype=torch.int32),
                  query_start=torch.tensor([0, S], dtype=torch.int32), seq_lens=torch.tensor([S], dtype=torch.int32),
                  ratio=4, state_table=torch.zeros(1, 3, dtype=torch.int32), state_block=256, state_ring=8, eps=1e-6,
                  cos=cos, sin=sin, out_slots=slots)
    compress(torch.randn(S, 2048, generator=g), torch.randn(4, 1024, generator=g), state=torch.zeros(8, 2048),
             norm_weight=torch.ones(512), cache=c4, **common)
    compress(torch.randn(S, 512, generator=g), torch.randn(4, 256, generator=g), state=torch.zeros(8, 512),
             norm_weight=torch.ones(128), cache=ik, rotate=True, index_scale="exact", **common)
    # one decode token at position S - 1: its indexer query and weights, the logits over the 150 keys, the top-k
    q8, w = dsv4.indexer_q(torch.randn(1, 64, 128, generator=g), torch.randn(1, 64, generator=g),
                           torch.tensor([S - 1]), cos, sin)
    lens = torch.tensor([n_c], dtype=torch.int32)
    logits = dsv4.paged_indexer_logits(q8.view(1, 1, 64, 128), w, ik, lens, page_table, 256)
    picked = dsv4.indexer_topk(logits, lens, topk, page_table=page_table)
    assert (picked >= 0).all() and len(set(picked[0].tolist())) == topk
    # the window: the last 128 raw tokens, in a SWA cache of their own
    swa = L.new_kv_cache(1, 128)
    win_rows = torch.randn(128, 512, generator=g).to(torch.bfloat16)
    dsv4.write_kv_v4(win_rows, swa, torch.arange(128))
    q = torch.randn(1, H, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    win_idx = torch.arange(128, dtype=torch.int32)[None]
    out = dsv4.sparse_mqa(q, swa, win_idx, extra_cache=c4, extra_indices=picked, sink=sink)
    rows = torch.cat([dsv4.read_kv_v4(swa, win_idx[0].long()), dsv4.read_kv_v4(c4, picked[0].long())]).double()
    s = (q[0].double() @ rows.T) * 512 ** -0.5  # [H, 128 + topk]
    m = torch.maximum(s.amax(-1), sink.double())
    p = torch.exp(s - m[:, None])
    want = (p @ rows) / (p.sum(-1) + torch.exp(sink.double() - m))[:, None]
    assert torch.allclose(out[0].double(), want, atol=2e-2, rtol=2e-2)
    # and the picked rows are the indexer's top-k: every picked logit >= every unpicked one
    pos_of = {int(page_table[0, i // 64]) * 64 + i % 64: i for i in range(n_c)}
    chosen = {pos_of[int(v)] for v in picked[0]}
    lo = min(float(logits[0, i]) for i in chosen)
    assert all(float(logits[0, i]) <= lo for i in range(n_c) if i not in chosen)
