"""DeepSeek-V4 compressor cases for tests: requests fed through several calls (chunks and decode steps), the
running state laid out as each engine keeps it.

- ``"paged"`` (vLLM): every token's row in a paged state cache of 4- (ratio 4) or 8-row (ratio 128) blocks,
  packed with NaN between the blocks, a random block table; scores stored with ape.
- ``"ring"`` (SGLang): rings of 8 rows per 256-token page (ratio 4) or 128 rows per request (ratio 128), only
  each request's last ``ring`` positions written back; scores stored without ape.

The compressed row ``c`` of request ``b`` goes to slot ``b * max_rows + c``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import dsv4
from ..kernels.dsv4 import layout as L


@dataclass
class CompressCase:
    ratio: int
    d: int
    layout: str
    schedules: list  # schedules[b][i]: request b's new tokens in call i
    xs: list  # per request, its tokens' [kv | score] rows
    ape: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    cache: torch.Tensor
    state: torch.Tensor
    table: torch.Tensor
    addr: dict  # state_block, state_ring, state_has_ape
    max_rows: int


def make_case(ratio: int, d: int, layout: str, schedules: list, device="cpu", seed: int = 0) -> CompressCase:
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * d
    B = len(schedules)
    totals = [sum(s) for s in schedules]
    xs = [(torch.randn(n, width, generator=g) * 2).to(device) for n in totals]
    ape = torch.randn(ratio, coff * d, generator=g).to(device)
    weight = (torch.rand(d, generator=g) + 0.5).to(device)
    ang = torch.rand(max(totals) + 1, 32, generator=g) * 6.3
    max_rows = max(totals) // ratio + 1
    rows = 64 if (d == L.INDEX_D or ratio == 4) else 2
    pages = B * max_rows // rows + 2
    if d == L.D:
        cache = L.new_kv_cache(pages, rows, device)
    else:
        cache = dsv4.paged_view(torch.zeros(pages, L.index_page_bytes(64), dtype=torch.uint8, device=device), 64,
                                L.INDEX_ROW_BYTES)
    if layout == "paged":
        block = 4 if ratio == 4 else 8
        wt = max(math.ceil(n / block) for n in totals)
        nblk = B * wt + 3
        bstride = block * width + 16
        state = torch.full((nblk * bstride,), float("nan"), device=device).as_strided(
            (nblk, block, width), (bstride, width, 1))
        table = torch.randperm(nblk, generator=g)[:B * wt].view(B, wt).to(torch.int32).to(device)
        addr = dict(state_block=block, state_ring=block, state_has_ape=True)
    elif ratio == 4:
        wt = max(totals) // 256 + 1
        state = torch.full(((B * wt + 2) * 8, width), float("nan"), device=device)
        table = torch.randperm(B * wt + 2, generator=g)[:B * wt].view(B, wt).to(torch.int32).to(device)
        addr = dict(state_block=256, state_ring=8, state_has_ape=False)
    else:
        wt = max(totals) // 128 + 1
        state = torch.full((B * 128, width), float("nan"), device=device)
        table = torch.arange(B, dtype=torch.int32, device=device)[:, None].expand(B, wt)  # stride 0
        addr = dict(state_block=128, state_ring=128, state_has_ape=False)
    return CompressCase(ratio, d, layout, schedules, xs, ape, weight, 1e-6, ang.cos().to(device),
                        ang.sin().to(device), cache, state, table, addr, max_rows)


def call_args(case: CompressCase, rotate: bool = False, index_scale: str = "pow2"):
    """Yield, call by call, the keyword arguments of :func:`dsv4.compress` for ``case`` (without ``impl``); the
    caller runs each before asking for the next (a call's state is the previous calls')."""
    dev = case.xs[0].device
    B, r = len(case.schedules), case.ratio
    done = [0] * B
    for call in range(max(len(s) for s in case.schedules)):
        new = [case.schedules[b][call] if call < len(case.schedules[b]) else 0 for b in range(B)]
        qs = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        seq = torch.tensor([done[b] + new[b] for b in range(B)], dtype=torch.int32, device=dev)
        pos = torch.cat([torch.arange(done[b], done[b] + new[b]) for b in range(B)]).to(dev)
        req = torch.cat([torch.full((new[b],), b) for b in range(B)]).to(torch.int32).to(dev)
        kvs = torch.cat([case.xs[b][done[b]:done[b] + new[b]] for b in range(B)])
        slots = torch.where((pos + 1) % r == 0, req.long() * case.max_rows + pos // r, torch.zeros_like(pos))
        rows = None
        if case.layout == "ring":  # SGLang keeps each request's last `ring` positions
            ring, blk = case.addr["state_ring"], case.addr["state_block"]
            rows = torch.where(pos >= seq.long()[req.long()] - ring,
                               case.table.long()[req.long(), pos // blk] * ring + pos % ring,
                               torch.full_like(pos, -1))
        yield dict(kv_score=kvs, ape=case.ape, positions=pos, token_req=req, query_start=qs, seq_lens=seq,
                   ratio=r, state=case.state, state_table=case.table, norm_weight=case.norm_weight, eps=case.eps,
                   cos=case.cos, sin=case.sin, cache=case.cache, out_slots=slots, state_rows=rows, rotate=rotate,
                   index_scale=index_scale, **case.addr)
        done = [done[b] + new[b] for b in range(B)]


def run_calls(case: CompressCase, impl: str, rotate: bool = False, index_scale: str = "pow2") -> list:
    """Feed every call of ``case`` through :func:`dsv4.compress`; returns, per call, (positions, token_req,
    the returned rows [T, d])."""
    out = []
    for kw in call_args(case, rotate, index_scale):
        got = dsv4.compress(**kw, return_rows=True, impl=impl)
        out.append((kw["positions"], kw["token_req"], got))
    return out
