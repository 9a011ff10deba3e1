"""vLLM 0.33.0's DeepSeek-V4 index metadata on any device, with no host synchronisation: what vLLM's V4 builders
compute with Triton (``token_to_req_indices``, the compressed slot mapping: plain tensor ops here) and the
window and C128 index sets the layer needs (:func:`attention_indices`, through
:func:`..kernels.dsv4.attention_slots`), for :mod:`musa_attn_backend.vllm.dsv4`'s builders and layer.

Conventions (vLLM's): a batch is ``query_start_loc [B + 1]`` and ``seq_lens [B]``; request ``b``'s query tokens are
rows ``query_start_loc[b] .. query_start_loc[b + 1]`` at positions ``seq_lens[b] - query_len .. seq_lens[b] - 1``.
Rows past ``query_start_loc[-1]`` are padding: their request is ``-1`` and every index derived from them is ``-1``.
A block table row maps a request's ``i``-th block of ``block_size`` tokens (``rows`` cache rows, ``rows = block_size
/ ratio`` for a compressed cache) to a physical block; a slot is ``block * rows + row``; ``-1`` means none.

This module never imports vLLM.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.dsv4.model.slots import attention_slots, dense_local, local_to_global, window_local

__all__ = ["token_to_req", "token_positions", "local_to_global", "compressed_slot_mapping", "window_local",
           "dense_local", "all_candidates", "attention_indices"]


def token_to_req(query_start_loc: torch.Tensor, num_tokens: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``int32 [num_tokens]``: each query row's request (its batch row), ``-1`` for rows past the last request.
    Requests with no query rows are skipped. Written into ``out[:num_tokens]`` when given."""
    qsl = query_start_loc.long()
    t = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:], t, right=True)
    req = torch.where(t < qsl[-1], req, torch.full_like(req, -1)).to(torch.int32)
    if out is None:
        return req
    out[:num_tokens].copy_(req)
    return out[:num_tokens]


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, req: torch.Tensor,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``int64 [T]``: each query row's position in its request (``-1`` for padding rows). Written into ``out[:T]``
    when given."""
    qsl, seq = query_start_loc.long(), seq_lens.long()
    r = req.long().clamp(min=0)
    t = torch.arange(req.numel(), device=req.device)
    pos = seq[r] - (qsl[r + 1] - qsl[r]) + (t - qsl[r])
    res = torch.where(req >= 0, pos, torch.full_like(pos, -1))
    if out is None:
        return res
    out[:res.numel()].copy_(res)
    return out[:res.numel()]


def compressed_slot_mapping(positions: torch.Tensor, req: torch.Tensor, slot_mapping: torch.Tensor,
                            block_table: torch.Tensor, block_size: int, ratio: int,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``int64 [T]``: where each token writes its compressed row (vLLM's ``get_compressed_slot_mapping``): a token
    at a window's end (``(pos + 1) % ratio == 0``) whose own slot is not ``-1`` writes compressed row ``pos //
    ratio`` of its request, at slot ``block_table[req, row // rows] * rows + row % rows`` (``rows = block_size /
    ratio``); every other token ``-1``. Written into ``out[:T]`` when given."""
    T = positions.numel()
    rows = block_size // ratio
    pos = positions.long()
    row = torch.div(pos, ratio, rounding_mode="floor")
    emit = ((pos + 1) % ratio == 0) & (slot_mapping[:T].long() != -1) & (pos >= 0)
    slots = local_to_global(torch.where(emit, row, torch.full_like(row, -1)).view(T, 1), req, block_table, rows)
    res = slots.view(T).long()
    if out is None:
        return res
    out[:T].copy_(res)
    return out[:T]


def all_candidates(positions: torch.Tensor, ratio: int, topk: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``int32 [T, topk]``: every compressed row a C4 token sees (``0 .. (pos + 1) // ratio - 1``, ``-1`` past
    them), the indexer's choice when no token sees more than ``topk`` (no scoring needed). Written into
    ``out[:T, :topk]`` when given."""
    res = dense_local(positions, ratio, topk).to(torch.int32)
    if out is None:
        return res
    out[:res.shape[0], :topk].copy_(res)
    return out[:res.shape[0], :topk]


def attention_indices(positions: torch.Tensor, req: torch.Tensor, swa_table: torch.Tensor, swa_block: int,
                      window: int, ratio: int = 1, main_table: Optional[torch.Tensor] = None, main_block: int = 0,
                      topk_local: Optional[torch.Tensor] = None, max_seq_len: int = 0):
    """The cache slots one V4 layer's query tokens attend to, as :func:`..kernels.dsv4.sparse_mqa` takes them:
    ``(window [T, window] int32, compressed [T, K] int32 or None)`` (:func:`..kernels.dsv4.attention_slots`: one
    TileLang launch on a GPU). The window: the token's last ``window`` positions in the SWA cache (``swa_block``
    tokens a block). The compressed rows (``ratio`` 4 or 128, the main cache's block of ``main_block`` tokens
    holding ``main_block / ratio`` rows): C4 the indexer's request-local choice ``topk_local [T, K]``; C128 every
    row the token sees, ``K = ceil(max_seq_len / ratio)``. ``-1``: none."""
    rows = main_block // ratio if ratio > 1 else 0
    return attention_slots(positions, req, swa_table, swa_block, window, ratio if ratio > 1 else 1, main_table, rows,
                           topk_local, max(-(-max_seq_len // ratio), 1) if ratio > 1 else 0)
