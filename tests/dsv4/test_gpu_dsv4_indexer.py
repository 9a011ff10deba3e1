"""DeepSeek-V4's indexer on the GPU: the TileLang logits (prefill and paged) and top-k against the float32
references on the same inputs. Ragged and cut key ranges, empty rows, 1 to 70k keys, MTP rows, packed page
strides, bad page entries, an empty cache, 0xFF (NaN) bytes between pages, outputs allocated over NaN (every
element a clean call owns must be written). Tolerance of the logits: FP8 products summed in float32 by the tensor
cores, ``|got - ref| <= 1e-3 * (max |ref| of the row) + 1e-3 * |ref|``; the ``-inf`` pattern exact. Top-k: the
selected positions distinct, in range, and their values, sorted, equal to the k largest values of the row (any
tie-break), short rows exactly in position order."""

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn


def nan_pool(numel: int, device) -> None:
    """Leave a NaN-filled block of ``numel`` float32 in the caching allocator, so the next allocation of that
    size starts as NaN."""
    x = torch.full((numel,), float("nan"), device=device)
    del x


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, where=None):
    if where is not None:
        got, ref = got[where], ref[where]
    assert not torch.isnan(got).any()
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    g, r = got.where(fin, 0).double(), ref.where(fin, 0).double()
    row_max = r.abs().amax(dim=-1, keepdim=True)
    assert ((g - r).abs() <= 1e-3 * row_max + 1e-3 * r.abs()).all(), (g - r).abs().max()


@pytest.mark.parametrize("T,S,H", [(1, 1, 64), (7, 300, 64), (33, 1000, 32), (64, 4099, 64), (5, 70001, 64),
                                   (130, 2048, 16)])
@pytest.mark.parametrize("clean", [True, False])
def test_indexer_logits_kernel(gpu_device, T, S, H, clean):
    g = torch.Generator().manual_seed(T + S + H)
    q = (torch.randn(T, H, 128, generator=g) * 3).to(E4M3).to(gpu_device)
    w = torch.randn(T, H, generator=g).to(gpu_device)
    k = (torch.randn(S, 128, generator=g) * 2).to(E4M3).to(gpu_device)
    ks = (torch.rand(S, generator=g) + 0.25).to(gpu_device)
    starts = torch.randint(-3, S + 2, (T,), generator=g, dtype=torch.int32)
    ends = starts + torch.randint(-2, S + 3, (T,), generator=g, dtype=torch.int32)
    starts[0], ends[0] = 0, S
    starts, ends = starts.to(gpu_device), ends.to(gpu_device)
    ref = dsv4.indexer_logits(q, w, k, ks, starts, ends, impl="reference")
    nan_pool(T * S, gpu_device)
    got = dsv4.indexer_logits(q, w, k, ks, starts, ends, clean=clean, impl="tilelang")
    if clean:
        assert_logits_close(got, ref)
    else:
        col = torch.arange(S, device=gpu_device)[None, :]
        inside = (col >= starts[:, None].long()) & (col < ends[:, None].long())
        assert_logits_close(got, ref, inside)


def index_cache(n_pages, stride, device, seed):
    """Every row of ``n_pages`` pages written with random keys; 0xFF bytes between pages."""
    buf = torch.full((max(n_pages, 1) * stride + 64,), 0xFF, dtype=torch.uint8, device=device)
    cache = buf.as_strided((n_pages, 64, L.INDEX_ROW_BYTES), (stride, L.INDEX_ROW_BYTES, 1))
    if n_pages:
        g = torch.Generator().manual_seed(seed)
        keys = torch.randn(n_pages * 64, 128, generator=g).to(device)
        dsv4.write_index_k(keys, cache, torch.arange(n_pages * 64, device=device))
    return cache


@pytest.mark.parametrize("B,next_n,stride", [(1, 1, 8448), (3, 2, 93888), (17, 1, 8448), (64, 2, 8640),
                                             (2, 1, 8448)])
@pytest.mark.parametrize("clean", [True, False])
def test_paged_indexer_logits_kernel(gpu_device, B, next_n, stride, clean):
    g = torch.Generator().manual_seed(B * 10 + next_n)
    P = 40  # table width: 2560 keys
    n_pages = 3 * P
    cache = index_cache(n_pages, stride, gpu_device, B)
    table = torch.randint(0, n_pages, (B, P), generator=g, dtype=torch.int32)
    table[0, 1] = -1  # a bad entry inside row 0's keys
    if B > 1:
        table[1, 2] = n_pages + 7
    n = torch.randint(0, P * 64 + 1, (B,), generator=g)
    n[0] = P * 64
    lens = torch.stack([(n - next_n + 1 + j).clamp(min=0) for j in range(next_n)], 1).to(torch.int32)
    q = (torch.randn(B, next_n, 64, 128, generator=g) * 2).to(E4M3).to(gpu_device)
    w = torch.randn(B * next_n, 64, generator=g).to(gpu_device)
    table, lens = table.to(gpu_device), lens.to(gpu_device)
    ctx = lens if next_n > 1 else lens[:, 0]
    max_len = P * 64 - 100
    ref = dsv4.paged_indexer_logits(q, w, cache, ctx, table, max_len, impl="reference")
    nan_pool(B * next_n * max_len, gpu_device)
    got = dsv4.paged_indexer_logits(q, w, cache, ctx, table, max_len, clean=clean, impl="tilelang")
    if clean:
        assert_logits_close(got, ref)
    else:
        inside = torch.arange(max_len, device=gpu_device)[None, :] < lens.reshape(-1, 1)
        assert_logits_close(got, ref, inside)


def test_paged_indexer_logits_on_an_empty_cache(gpu_device):
    cache = index_cache(0, 8448, gpu_device, 0)
    q = torch.randn(2, 1, 64, 128, device=gpu_device).to(E4M3)
    lens = torch.tensor([100, 0], dtype=torch.int32, device=gpu_device)
    got = dsv4.paged_indexer_logits(q, torch.randn(2, 64, device=gpu_device), cache, lens,
                                    torch.zeros(2, 4, dtype=torch.int32, device=gpu_device), 256, impl="tilelang")
    assert torch.isneginf(got).all()


def assert_topk_valid(got, logits, lengths, starts, k):
    """Each row: distinct in-range positions whose values are the row's k largest (short rows: in order)."""
    T, N = logits.shape
    got, logits = got.cpu(), logits.cpu()
    for t in range(T):
        s = int(starts[t]) if starts is not None else 0
        s = max(0, min(s, N))
        n = max(0, min(int(lengths[t]), N - s))
        row = got[t]
        sel = row[row >= 0]
        assert row[len(sel):].eq(-1).all(), t
        if n <= k:
            assert torch.equal(sel, torch.arange(n, dtype=torch.int32)), t
            continue
        assert len(sel) == k and len(torch.unique(sel)) == k and int(sel.max()) < n, t
        vals = logits[t, s:s + n].double()
        vals = torch.where(torch.isnan(vals), torch.full_like(vals, -1.5e308),
                           torch.where(torch.isneginf(vals), torch.full_like(vals, -1e308), vals))
        assert torch.equal(vals[sel.long()].sort().values, vals.topk(k).values.sort().values), t


@pytest.mark.parametrize("T,N,k", [(1, 600, 512), (9, 5000, 512), (33, 65536, 1024), (130, 2048, 512),
                                   (4, 3000, 2048)])
def test_indexer_topk_kernel(gpu_device, T, N, k):
    g = torch.Generator().manual_seed(T * N + k)
    logits = torch.randn(T, N, generator=g)
    logits[0] = logits[0].round(decimals=1)  # many ties
    if T > 2:
        logits[1] = 3.0  # every value equal
        logits[2, ::3] = float("nan")
    if T > 3:
        logits[3] = float("-inf")
    if T > 6:  # keys crowded into one bin of the first level (and of the second): settled further down
        logits[5] = 1000.0 + 1e-3 * torch.randn(N, generator=g)
        logits[6] = 1.0 + 1e-2 * torch.randn(N, generator=g)
    lengths = torch.randint(0, N + 10, (T,), generator=g, dtype=torch.int32)
    lengths[0] = N
    starts = torch.randint(-2, 40, (T,), generator=g, dtype=torch.int32)
    if T > 4:
        lengths[4] = k  # exactly k: in order
    dev_logits = logits.to(gpu_device)
    got = dsv4.indexer_topk(dev_logits, lengths.to(gpu_device), k, starts=starts.to(gpu_device), impl="tilelang")
    assert_topk_valid(got, logits, lengths, starts, k)
    got0 = dsv4.indexer_topk(dev_logits, lengths.to(gpu_device), k, impl="tilelang")
    assert_topk_valid(got0, logits, lengths, None, k)


def test_indexer_topk_kernel_page_slots_and_strided_rows(gpu_device):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 3000, generator=g)
    logits = torch.as_strided(base.to(gpu_device), (6, 2500), (3000, 1))  # a row stride past the columns
    lengths = torch.tensor([2500, 10, 600, 513, 0, 2000], dtype=torch.int32, device=gpu_device)
    table = torch.randint(0, 1000, (6, 40), generator=g, dtype=torch.int32)
    table[0, 3] = -1
    table = table.to(gpu_device)
    pos = dsv4.indexer_topk(logits, lengths, 512, impl="tilelang")
    slots = dsv4.indexer_topk(logits, lengths, 512, page_table=table, impl="tilelang")
    assert_topk_valid(pos, logits, lengths, None, 512)
    entry = table.long().gather(1, (pos.long().clamp(min=0) // 64))
    want = torch.where((pos >= 0) & (entry >= 0), entry * 64 + pos.long().clamp(min=0) % 64, -1)
    # the order within a row follows the kernel's atomics, so rows are compared as sorted lists (no ties here)
    assert torch.equal(slots.long().sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.parametrize("rotate,scale,bf16_rope", [(True, "exact", False), (False, "pow2", True)])
@pytest.mark.parametrize("T,H", [(1, 64), (300, 64), (17, 32)])
def test_indexer_q_kernel(gpu_device, rotate, scale, bf16_rope, T, H):
    g = torch.Generator().manual_seed(T + H)
    q = torch.randn(T, H, 128, generator=g).to(torch.bfloat16).to(gpu_device)
    w = torch.randn(T, H, generator=g).to(torch.bfloat16).to(gpu_device)
    pos = torch.randint(0, 5000, (T,), generator=g).to(gpu_device)
    ang = (torch.rand(5000, 32, generator=g) * 6.3).to(gpu_device)
    kw = dict(rotate=rotate, scale=scale, bf16_rope=bf16_rope)
    q8, wo = dsv4.indexer_q(q, w, pos, ang.cos(), ang.sin(), impl="tilelang", **kw)
    r8, ro = dsv4.indexer_q(q, w, pos, ang.cos(), ang.sin(), impl="reference", **kw)
    assert torch.allclose(wo, ro, rtol=1e-5, atol=0)
    # in units of the (equal) scales: within one e4m3 step of each other (a value at a rounding boundary may go
    # either way; the step is at most 32, at the top of the range), and nearly all equal
    d = (q8.float() - r8.float()).abs()
    step = torch.exp2(torch.floor(torch.log2(r8.float().abs().clamp(min=2 ** -6)))) / 8
    assert (d <= step * 1.01 + 2 ** -9).all()
    assert (d == 0).float().mean() > 0.99


@pytest.mark.parametrize("B,ctx", [(1, 2048), (5, 5000), (32, 16384)])
def test_paged_logits_match_sglangs_tilelang_kernel(gpu_device, B, ctx):
    """Ours against SGLang's own TileLang ``tilelang_fp8_paged_mqa_logits`` (the engine's CUDA path; skipped where
    SGLang's kernels do not import) on the same cache, shuffled pages, ragged lengths. SGLang's kernel computes
    its own way (its tiling, its own sum order), so the tolerance is that of ours against the reference, on the
    columns below each row's length."""
    try:
        from sglang.kernels.ops.attention.dsa.tilelang_kernel import tilelang_fp8_paged_mqa_logits
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's TileLang paged logits do not import here: {type(e).__name__}: {e}")
    dev = gpu_device
    g = torch.Generator(device=dev).manual_seed(B)
    pages_per_req = -(-ctx // 64)
    n_pages = B * pages_per_req
    buf = torch.empty(n_pages, L.index_page_bytes(64), dtype=torch.uint8, device=dev)
    cache = dsv4.paged_view(buf, 64, L.INDEX_ROW_BYTES)
    dsv4.write_index_k(torch.randn(n_pages * 64, 128, device=dev, generator=g), cache,
                       torch.arange(n_pages * 64, device=dev))
    table = torch.randperm(n_pages, device=dev, generator=g).view(B, pages_per_req).to(torch.int32)
    lens = torch.randint(1, ctx + 1, (B,), device=dev, generator=g).to(torch.int32)
    lens[0] = ctx
    q = torch.randn(B, 1, 64, 128, device=dev, generator=g).to(E4M3)
    w = torch.randn(B, 64, device=dev, generator=g)
    ours = dsv4.paged_indexer_logits(q, w, cache, lens, table, ctx, impl="tilelang")
    theirs = tilelang_fp8_paged_mqa_logits(q, buf.view(n_pages, 64, 1, L.INDEX_ROW_BYTES), w, lens, table, None,
                                           ctx, False)
    cols = torch.arange(ctx, device=dev)[None, :] < lens[:, None]
    assert_logits_close(ours.where(cols, 0.0), theirs.float().where(cols, 0.0))
