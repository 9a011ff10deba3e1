"""DeepSeek-V4's compressors on the GPU: the TileLang programs against the reference on the same inputs, over
several calls (chunks and decode steps), in both engines' state layouts (vLLM's packed paged state with ape
stored, NaN between its blocks; SGLang's rings holding the tail), ratio 4 and 128, both widths, the Hadamard and
both indexer scales. Tolerances: rows before quantisation ``rtol = atol = 1e-4`` (float32, the kernel's exp
differs from torch's in the last bits); the state bit for bit (a copy and one float32 add); the cache read back
within one e4m3 step of the reference's (a value at a rounding boundary may round the other way)."""

import math

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

pytestmark = pytest.mark.gpu


def make_case(ratio, d, layout, schedules, dev, seed):
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * d
    B = len(schedules)
    totals = [sum(s) for s in schedules]
    xs = [(torch.randn(n, width, generator=g) * 2).to(dev) for n in totals]
    case = dict(ape=torch.randn(ratio, coff * d, generator=g).to(dev),
                norm_weight=(torch.rand(d, generator=g) + 0.5).to(dev), eps=1e-6)
    ang = torch.rand(max(totals) + 1, 32, generator=g) * 6.3
    case["cos"], case["sin"] = ang.cos().to(dev), ang.sin().to(dev)
    max_rows = max(totals) // ratio + 1
    rows = 64 if (d == 128 or ratio == 4) else 2
    pages = B * max_rows // rows + 2
    if d == L.D:
        cache = L.new_kv_cache(pages, rows, dev)
    else:
        cache = dsv4.paged_view(torch.zeros(pages, L.index_page_bytes(64), dtype=torch.uint8, device=dev), 64,
                                L.INDEX_ROW_BYTES)
    if layout == "paged":
        block = 4 if ratio == 4 else 8
        wt = max(math.ceil(n / block) for n in totals)
        nblk = B * wt + 3
        bstride = block * width + 16
        state = torch.full((nblk * bstride,), float("nan"), device=dev).as_strided((nblk, block, width),
                                                                                  (bstride, width, 1))
        table = torch.randperm(nblk, generator=g)[:B * wt].view(B, wt).to(torch.int32).to(dev)
        addr = dict(state_block=block, state_ring=block, state_has_ape=True)
    elif ratio == 4:
        wt = max(totals) // 256 + 1
        state = torch.full(((B * wt + 2) * 8, width), float("nan"), device=dev)
        table = torch.randperm(B * wt + 2, generator=g)[:B * wt].view(B, wt).to(torch.int32).to(dev)
        addr = dict(state_block=256, state_ring=8, state_has_ape=False)
    else:
        wt = max(totals) // 128 + 1
        state = torch.full((B * 128, width), float("nan"), device=dev)
        table = torch.arange(B, dtype=torch.int32, device=dev)[:, None].expand(B, wt)
        addr = dict(state_block=128, state_ring=128, state_has_ape=False)
    return xs, case, cache, state, table, addr, max_rows


def run(impl, ratio, d, layout, schedules, dev, rotate, scale, seed):
    xs, case, cache, state, table, addr, max_rows = make_case(ratio, d, layout, schedules, dev, seed)
    B = len(schedules)
    done = [0] * B
    out_rows = []
    for call in range(max(len(s) for s in schedules)):
        new = [schedules[b][call] if call < len(schedules[b]) else 0 for b in range(B)]
        qs = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        seq = torch.tensor([done[b] + new[b] for b in range(B)], dtype=torch.int32, device=dev)
        pos = torch.cat([torch.arange(done[b], done[b] + new[b]) for b in range(B)]).to(dev)
        req = torch.cat([torch.full((new[b],), b) for b in range(B)]).to(torch.int32).to(dev)
        kvs = torch.cat([xs[b][done[b]:done[b] + new[b]] for b in range(B)])
        slots = torch.where((pos + 1) % ratio == 0, req.long() * max_rows + pos // ratio, torch.zeros_like(pos))
        srows = None
        if layout == "ring":
            ring, blk = addr["state_ring"], addr["state_block"]
            srows = torch.where(pos >= seq.long()[req.long()] - ring,
                                table.long()[req.long(), pos // blk] * ring + pos % ring, torch.full_like(pos, -1))
        out_rows.append(dsv4.compress(kvs, case["ape"], pos, req, qs, seq, ratio=ratio, state=state,
                                      state_table=table, norm_weight=case["norm_weight"], eps=case["eps"],
                                      cos=case["cos"], sin=case["sin"], cache=cache, out_slots=slots,
                                      state_rows=srows, rotate=rotate, index_scale=scale, return_rows=True,
                                      impl=impl, **addr))
        done = [done[b] + new[b] for b in range(B)]
    return out_rows, cache, state, max_rows


SCHEDULES = {4: [[13, 11, 1, 1, 1, 1, 1, 9], [5, 1, 1, 1, 30, 1, 1, 0], [0, 0, 8, 1, 1, 1, 1, 1]],
             128: [[200, 57, 1, 1, 70], [130, 1, 125, 1, 1], [1, 1, 1, 300, 0]]}


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("layout", ["paged", "ring"])
@pytest.mark.parametrize("d,rotate,scale", [(512, False, "pow2"), (128, True, "exact"), (128, False, "pow2")])
def test_compress_kernel_matches_the_reference(gpu_device, ratio, layout, d, rotate, scale):
    args = (ratio, d, layout, SCHEDULES[ratio], gpu_device, rotate, scale, ratio + d)
    ref_rows, ref_cache, ref_state, max_rows = run("reference", *args)
    got_rows, got_cache, got_state, _ = run("tilelang", *args)
    for r, g in zip(ref_rows, got_rows):
        assert torch.equal(torch.isnan(r), torch.isnan(g))
        fin = ~torch.isnan(r)
        assert torch.allclose(g[fin], r[fin], rtol=1e-4, atol=1e-4), (g[fin] - r[fin]).abs().max()
    assert torch.equal(torch.isnan(got_state), torch.isnan(ref_state))
    assert torch.equal(got_state.nan_to_num(), ref_state.nan_to_num())
    n = got_cache.shape[0] * got_cache.shape[1]
    slots = torch.arange(n, device=gpu_device)
    read = dsv4.read_kv_v4 if d == L.D else dsv4.read_index_k
    a, b = read(got_cache, slots).float(), read(ref_cache, slots).float()
    tile = 64 if d == L.D else 128
    nope = L.D_NOPE if d == L.D else d
    amax = b[:, :nope].abs().view(n, -1, tile).amax(-1, keepdim=True)
    assert ((a - b)[:, :nope].abs().view(n, -1, tile) <= amax / 14 + 1e-6).all()
