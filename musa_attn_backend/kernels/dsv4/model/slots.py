"""The cache slots a DeepSeek-V4 layer's query tokens attend to, from the batch's positions, requests and block
tables: the window rows in the SWA cache and the compressed rows (C4: the indexer's choice; C128: every row) in
the main cache, as :func:`musa_attn_backend.kernels.dsv4.sparse_mqa` takes them. vLLM's layer computes these per
layer call (its metadata holds block tables and request-local rows); one TileLang launch on a GPU, the torch
reference here on a CPU.

Conventions: a block table row maps a request's ``i``-th block (``block`` tokens of the SWA cache; ``rows`` rows
of a compressed cache) to a physical page; a slot is ``page * rows + row``; ``-1`` means none.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check, check_same_device, is_int_tensor, resolve_impl

MODES = (1, 4, 128)


def local_to_global(local: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, rows: int) -> torch.Tensor:
    """``int32``, ``local``'s shape ``[T, K]``: request-local row ``local[t, j]`` of request ``req[t]`` as a cache
    slot ``block_table[req, local // rows] * rows + local % rows``. ``-1`` where the local row is negative, the
    request is ``-1``, the block is past the table, or the table's entry is negative."""
    T = local.shape[0]
    width = block_table.shape[1]
    lo = local.long()
    blk = torch.div(lo, rows, rounding_mode="floor")
    ok = (lo >= 0) & (req.long().view(T, 1) >= 0) & (blk < width)
    r = req.long().clamp(min=0).view(T, 1).expand_as(lo)
    entry = block_table.long()[r, blk.clamp(0, max(width - 1, 0))] if width else torch.full_like(lo, -1)
    ok = ok & (entry >= 0)
    return torch.where(ok, entry * rows + lo % rows, torch.full_like(lo, -1)).to(torch.int32)


def window_local(positions: torch.Tensor, window: int) -> torch.Tensor:
    """``int64 [T, window]``: the positions ``pos - window + 1 .. pos`` each token attends to in its sliding window,
    ``-1`` before position 0 (and for padding rows, position ``-1``)."""
    pos = positions.long().view(-1, 1)
    loc = pos - window + 1 + torch.arange(window, device=positions.device)
    return torch.where((loc >= 0) & (pos >= 0), loc, torch.full_like(loc, -1))


def dense_local(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """``int64 [T, width]``: the compressed rows a token of a dense-compressed (C128) layer attends to, ``0 ..
    (pos + 1) // ratio - 1``, ``-1`` past them."""
    n = torch.div(positions.long() + 1, ratio, rounding_mode="floor").clamp(min=0).view(-1, 1)
    j = torch.arange(width, device=positions.device).view(1, -1)
    return torch.where(j < n, j, torch.full_like(j, -1))


def attention_slots_reference(positions, req, swa_table, swa_block, window, ratio=1, main_table=None, main_rows=0,
                              topk_local=None, width=0):
    win = local_to_global(window_local(positions, window), req, swa_table, swa_block)
    if ratio == 1:
        return win, None
    if ratio == 4:  # a padding row (position -1) names no row, whatever the indexer wrote for it
        local = torch.where(positions.long().view(-1, 1) >= 0, topk_local.long(), -1)
    else:
        local = dense_local(positions, ratio, width)
    return win, local_to_global(local, req, main_table, main_rows)


def attention_slots(positions: torch.Tensor, req: torch.Tensor, swa_table: torch.Tensor, swa_block: int,
                    window: int, ratio: int = 1, main_table: Optional[torch.Tensor] = None, main_rows: int = 0,
                    topk_local: Optional[torch.Tensor] = None, width: int = 0, *, impl: str = "auto"):
    """``(window_slots int32 [T, window], compressed_slots int32 [T, K] or None)`` for query tokens at
    ``positions [T]`` (int64; ``-1``: padding) of requests ``req [T]`` (``-1``: padding).

    - The window: positions ``pos - window + 1 .. pos`` through ``swa_table [B, W]`` (``swa_block`` tokens a
      block).
    - ``ratio`` 4: the indexer's request-local rows ``topk_local [T, K]`` (``-1``: none) through ``main_table``
      (``main_rows`` rows a block); ``ratio`` 128: rows ``0 .. (pos + 1) // 128 - 1`` of ``width`` entries;
      ``ratio`` 1: no compressed rows (None).

    An entry is ``-1`` where its position or row is negative, its request is ``-1``, its block is past the table or
    the table's entry is negative. Nothing is read on the host (no synchronisation)."""
    op = "attention_slots"
    check(ratio in MODES, lambda: f"{op}: ratio must be one of {MODES}, got {ratio!r}")
    check(is_int_tensor(positions) and positions.dim() == 1, lambda: f"{op}: positions must be an integer [T] tensor")
    T = positions.numel()
    check(is_int_tensor(req) and req.dim() == 1 and req.numel() == T, lambda: f"{op}: req must be an integer [{T}] tensor")
    check(isinstance(window, int) and 1 <= window <= 1024, lambda: f"{op}: window must be an int in [1, 1024]")
    check(is_int_tensor(swa_table) and swa_table.dim() == 2, lambda: f"{op}: swa_table must be an integer [B, W] tensor")
    check(isinstance(swa_block, int) and swa_block >= 1, lambda: f"{op}: swa_block must be a positive int")
    if ratio != 1:
        check(is_int_tensor(main_table) and main_table.dim() == 2,
              lambda: f"{op}: main_table must be an integer [B, W] tensor for ratio {ratio}")
        check(isinstance(main_rows, int) and main_rows >= 1, lambda: f"{op}: main_rows must be a positive int")
    if ratio == 4:
        check(is_int_tensor(topk_local) and topk_local.dim() == 2 and topk_local.shape[0] >= T,
              lambda: f"{op}: topk_local must be an integer [{T}, K] tensor for ratio 4")
        topk_local = topk_local[:T]
    if ratio == 128:
        check(isinstance(width, int) and width >= 1, lambda: f"{op}: width must be a positive int for ratio 128")
    check_same_device(op, positions=positions, req=req, swa_table=swa_table, main_table=main_table,
                      topk_local=topk_local)
    args = (positions, req, swa_table, swa_block, window, ratio, main_table, main_rows, topk_local, width)
    which = resolve_impl(impl, positions.device, op)
    if which == "reference" or T == 0:
        return attention_slots_reference(*args)
    from .tilelang_impl import attention_slots_tilelang

    return attention_slots_tilelang(*args)
