"""DeepSeek-V4 caches larger than 2^32 bytes, as vLLM binds them: every layer's view spans the engine's whole KV
buffer (one physical block of 93,888 bytes holds a page of each cache kind), so a server's views run to tens of
GB and the programs must address them with 64-bit offsets. One 4.7 GB buffer of packed blocks; the pages used are
near its end (past 2^31 and 2^32 bytes) and at its start. Each TileLang program against itself on compact copies
of the same pages (bytes and results identical) or against the reference:

- ``write_kv_v4`` / ``write_index_k``: the page bytes equal the reference writer's in a compact cache;
- ``sparse_mqa`` (window + compressed rows at far pages): equal to the same call on compact copies;
- ``paged_indexer_logits`` over far pages: equal to the call on a compact copy;
- ``compress`` with its state rows in far blocks: the rows it writes equal those from a compact state.
"""

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

pytestmark = pytest.mark.gpu

STRIDE = 93_888
NB = 50_000  # 4.69 GB
OFF = {"swa": 0, "c4": 37_440, "idx": 76_608, "state": 0}


@pytest.fixture(scope="module")
def big():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    buf = torch.zeros(NB * STRIDE, dtype=torch.uint8, device="cuda")
    yield buf
    del buf
    torch.cuda.empty_cache()


def kv_view(buf, kind, rows=64):
    return buf.as_strided((NB, rows, L.ROW_BYTES), (STRIDE, L.ROW_BYTES, 1), OFF[kind])


def idx_view(buf):
    return buf.as_strided((NB, 64, L.INDEX_ROW_BYTES), (STRIDE, L.INDEX_ROW_BYTES, 1), OFF["idx"])


PAGES = torch.tensor([0, 3, 22_900, 22_901, 45_800, NB - 2, NB - 1])  # 2^31 bytes ~ block 22,873; 2^32 ~ 45,746


def compact_slots(slots, rows):
    """Slots of ``PAGES`` renumbered as pages 0, 1, ... of a compact cache."""
    where = {int(p): i for i, p in enumerate(PAGES)}
    return torch.tensor([where[int(s) // rows] * rows + int(s) % rows for s in slots], device=slots.device)


def far_slots(g, rows, n):
    pages = PAGES[torch.randint(0, len(PAGES), (n,), generator=g)]
    return (pages * rows + torch.randint(0, rows, (n,), generator=g)).cuda()


def test_writers_address_far_pages(big):
    g = torch.Generator().manual_seed(0)
    for kind, rows, width, write, view in (("kv", 64, 512, dsv4.write_kv_v4, kv_view(big, "swa")),
                                           ("idx", 64, 128, dsv4.write_index_k, idx_view(big))):
        slots = torch.unique(far_slots(g, rows, 300))
        x = (torch.randn(slots.numel(), width, generator=g) * 3).to(torch.bfloat16).cuda()
        write(x, view, slots, impl="tilelang")
        ref = (dsv4.new_kv_cache(len(PAGES), rows, "cuda") if kind == "kv" else
               L.paged_view(torch.zeros(len(PAGES), L.index_page_bytes(rows), dtype=torch.uint8, device="cuda"),
                            rows, L.INDEX_ROW_BYTES))
        write(x, ref, compact_slots(slots, rows), impl="reference")
        pages_of = L.kv_pages if kind == "kv" else L.index_pages
        ours = pages_of(view, op="test").pages[PAGES.cuda()]  # each page's rows and scales
        assert torch.equal(ours, pages_of(ref, op="test").pages), kind


def compact_copy(view, rows, row_bytes):
    out = torch.zeros(len(PAGES), rows * row_bytes, dtype=torch.uint8, device="cuda")
    for i, p in enumerate(PAGES):
        out[i] = view[int(p)].reshape(-1)
    return out.view(len(PAGES), rows, row_bytes)


def test_sparse_mqa_reads_far_pages(big):
    g = torch.Generator().manual_seed(1)
    swa, c4 = kv_view(big, "swa"), kv_view(big, "c4")
    for view in (swa, c4):
        slots = PAGES.cuda().repeat_interleave(64) * 64 + torch.arange(64, device="cuda").repeat(len(PAGES))
        dsv4.write_kv_v4(torch.randn(slots.numel(), 512, generator=g).to(torch.bfloat16).cuda(), view, slots)
    T, H = 9, 64
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).cuda()
    i1 = far_slots(g, 64, T * 128).view(T, 128).to(torch.int32)
    i2 = far_slots(g, 64, T * 512).view(T, 512).to(torch.int32)
    i2[0, 100:] = -1
    sink = torch.randn(H, generator=g).cuda()
    ours = dsv4.sparse_mqa(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink, impl="tilelang")
    cs, cc = compact_copy(swa, 64, L.ROW_BYTES), compact_copy(c4, 64, L.ROW_BYTES)
    remap = lambda i: compact_slots(i.flatten().cpu(), 64).view(i.shape).to(torch.int32).cuda()  # noqa: E731
    j2 = torch.where(i2 >= 0, remap(i2.clamp(min=0)), -1)
    want = dsv4.sparse_mqa(q, cs, remap(i1), extra_cache=cc, extra_indices=j2, sink=sink, impl="tilelang")
    assert torch.isfinite(ours.float()).all()
    assert torch.equal(ours, want)


def test_paged_indexer_logits_read_far_pages(big):
    g = torch.Generator().manual_seed(2)
    view = idx_view(big)
    slots = PAGES.cuda().repeat_interleave(64) * 64 + torch.arange(64, device="cuda").repeat(len(PAGES))
    dsv4.write_index_k(torch.randn(slots.numel(), 128, generator=g).to(torch.bfloat16).cuda(), view, slots)
    B, H = 3, 64
    q = (torch.randn(B, 1, H, 128, generator=g) * 2).cuda().to(torch.float8_e4m3fn)
    w = torch.randn(B, H, generator=g).cuda()
    table = PAGES[torch.randint(0, len(PAGES), (B, 6), generator=g)].to(torch.int32).cuda()
    lens = torch.tensor([300, 64 * 6, 17], dtype=torch.int32, device="cuda")
    ours = dsv4.paged_indexer_logits(q, w, view, lens, table, 64 * 6, impl="tilelang")
    where = {int(p): i for i, p in enumerate(PAGES)}
    ctable = table.cpu().apply_(lambda p: where[p]).cuda()
    compact = compact_copy(view, 64, L.INDEX_ROW_BYTES)
    want = dsv4.paged_indexer_logits(q, w, compact, lens, ctable, 64 * 6, impl="tilelang")
    assert torch.equal(ours, want) and torch.isfinite(ours[0, :300]).all()


def test_compress_state_in_far_blocks(big):
    g = torch.Generator().manual_seed(3)
    ratio, d, block = 4, 512, 4
    width = 2 * 2 * d  # float32 [kv | score] of both overlapping windows
    floats = big.view(torch.float32)
    stride_f = STRIDE // 4
    state = floats.as_strided((NB, block, width), (stride_f, width, 1), OFF["state"])
    n = 37
    blocks = torch.tensor([NB - 1 - 2 * i for i in range(8)] + [22_901, 45_800])  # past 2^31 and 2^32 bytes
    table = blocks[: n // block + 1].view(1, -1).to(torch.int32).cuda()
    compact_state = torch.zeros(table.shape[1], block, width, device="cuda")
    ctable = torch.arange(table.shape[1], dtype=torch.int32, device="cuda").view(1, -1)
    kv = torch.randn(n, width, generator=g).cuda()
    ape = torch.randn(ratio, 2 * d, generator=g).cuda()
    ang = torch.rand(64, 32, generator=g) * 6
    common = dict(ape=ape, positions=torch.arange(n, device="cuda"), token_req=torch.zeros(n, dtype=torch.int32,
                  device="cuda"), query_start=torch.tensor([0, n], dtype=torch.int32, device="cuda"),
                  seq_lens=torch.tensor([n], dtype=torch.int32, device="cuda"), ratio=ratio, state_block=block,
                  state_ring=block, norm_weight=torch.ones(d, device="cuda"), eps=1e-6, cos=ang.cos().cuda(),
                  sin=ang.sin().cuda(), state_has_ape=True, return_rows=True, impl="tilelang")
    out_slots = torch.arange(n, device="cuda") // ratio
    c1, c2 = dsv4.new_kv_cache(2, 64, "cuda"), dsv4.new_kv_cache(2, 64, "cuda")
    ours = dsv4.compress(kv, state=state, state_table=table, cache=c1, out_slots=out_slots, **common)
    want = dsv4.compress(kv, state=compact_state, state_table=ctable, cache=c2, out_slots=out_slots, **common)
    emit = (torch.arange(n, device="cuda") + 1) % ratio == 0
    assert torch.equal(ours[emit], want[emit]) and torch.isfinite(ours[emit]).all()
    assert torch.equal(c1, c2)
