"""PyTorch reference of DeepSeek-V4's KV compressors (ratio 4 with overlapping windows, ratio 128), the same
signature as :func:`musa_attn_backend.kernels.dsv4.compressor.compress`, vectorised, math in float32.

The model math (DeepSeek-V4's ``inference/model.py``, class ``Compressor``), as both engines' kernels run it. Each
token carries a projected row ``[kv | score]`` of ``2 * coff * d`` floats (``coff`` 2 for ratio 4, 1 for ratio
128). The compressed row ``c`` of a request (emitted by the token at position ``p = c * r + r - 1``) pools the
window of ``coff * r`` positions ``p - coff * r + 1 .. p``: window slot ``i`` (position ``w``) contributes, per
dimension, its kv half ``h = i // r`` (ratio 4: the previous chunk's first ``d`` dims, the current chunk's last
``d``; ratio 128: the one half) with weight ``softmax_i(score_h(w) + ape[w % r, h])``; a position below 0 has kv 0
and score ``-inf``. Then RMSNorm (float32, ``weight``, ``eps``), GPT-J RoPE of the last 64 dims at position
``c * r`` (pairs ``(2j, 2j + 1)`` rotated by ``cos[c * r, j]``, ``sin[c * r, j]``), for the indexer's compressor
(``d = 128``) optionally the Hadamard rotation (natural order, ``128 ** -0.5``), and the quantised store: main
rows (``d = 512``) as 584-byte rows (the nope values rounded to bf16 first, the RoPE values stored as bf16),
indexer keys as 132-byte rows with a power-of-two scale (after a bf16 rounding) or the exact ``amax / 448``.
The official code also rounds the pooled row to bf16 before the norm; the engines do not, and neither does this.

State: the rows ``[kv | score]`` of earlier tokens live in the engine's buffer (``state``), at rows
``state_table[b, w // state_block] * state_ring + w % state_ring``; a window position at or past the request's
prefix (``seq_lens[b]`` minus its tokens in this call) comes from this call's input instead. After every
compressed row is computed, the tokens' rows go to ``state_rows`` (their score with ape added when
``state_has_ape``, as vLLM keeps them).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import layout as L
from ..writers.reference import write_index_k_reference, write_kv_v4_reference

ROPE = 64


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The Walsh-Hadamard transform of the last dim (a power of two, natural (Sylvester) order), times
    ``n ** -0.5``."""
    n = x.shape[-1]
    y = x.reshape(-1, n).clone()
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).reshape(-1, n)
        h *= 2
    return (y * n ** -0.5).view(x.shape)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J rotation of the pairs ``(x[..., 2j], x[..., 2j + 1])`` by ``cos[..., j]``, ``sin[..., j]``."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def state_row_views(state: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``state`` as ``[blocks, block_rows, width]`` (a 2-D ``[rows, width]`` buffer is one row a block)."""
    return (state[:, None] if state.dim() == 2 else state), (1 if state.dim() == 2 else state.shape[1])


def default_state_rows(token_req: torch.Tensor, positions: torch.Tensor, state_table: torch.Tensor,
                       state_block: int, state_ring: int, num_rows: int) -> torch.Tensor:
    """``[T]`` int64: the state row each token is kept in when the caller names none, its position's table row
    ``state_table[b, pos // state_block] * state_ring + pos % state_ring``; ``-1`` (nothing kept) for padding
    (``token_req < 0``), a column past the table, a negative table entry or a row past the ``num_rows`` rows.
    Both the reference and the TileLang path take their rows from here."""
    req, pos = token_req.long(), positions.long()
    B, W = state_table.shape
    if B == 0 or W == 0:
        return torch.full_like(pos, -1)
    col = pos.clamp(min=0) // state_block
    entry = state_table.long()[req.clamp(0, B - 1), col.clamp(max=W - 1)]
    rows = entry * state_ring + pos.clamp(min=0) % state_ring
    ok = (req >= 0) & (req < B) & (pos >= 0) & (col < W) & (entry >= 0) & (rows < num_rows)
    return torch.where(ok, rows, torch.full_like(rows, -1))


def compress_reference(kv_score: torch.Tensor, ape: torch.Tensor, ratio: int, positions: torch.Tensor,
                       token_req: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                       state: torch.Tensor, state_table: torch.Tensor, state_block: int, state_ring: int,
                       norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       cache: torch.Tensor, out_slots: torch.Tensor, *, state_rows: Optional[torch.Tensor] = None,
                       state_has_ape: bool = False, rotate: bool = False, index_scale: str = "pow2",
                       return_rows: bool = False) -> Optional[torch.Tensor]:
    """See the module docstring; ``return_rows``: also return the compressed rows ``[T, d]`` as the writer
    quantises them, as float32: rounded to bf16 for the MODEL1 cache and the ``"pow2"`` index rule, float32 for
    ``"exact"`` (NaN where a token emits none)."""
    T, width = kv_score.shape
    coff = 2 if ratio == 4 else 1
    d = width // (2 * coff)
    win = coff * ratio
    dev = kv_score.device
    x = kv_score.float()
    ape = ape.float().reshape(ratio, coff * d)
    pos = positions.to(dev).long()
    req = token_req.to(dev).long()
    qs = query_start.to(dev).long()
    prefix = seq_lens.to(dev).long() - (qs[1:] - qs[:-1])
    emit = (req >= 0) & ((pos + 1) % ratio == 0) & (out_slots.to(dev).long() >= 0)
    e_tok = emit.nonzero().flatten()
    rows_out = None
    if return_rows:
        rows_out = torch.full((T, d), float("nan"), device=dev)
    blocks, block_rows = state_row_views(state)
    if e_tok.numel():
        b = req[e_tok]
        w = pos[e_tok, None] - win + 1 + torch.arange(win, device=dev)[None, :]  # [E, win] window positions
        from_input = w >= prefix[b, None]
        in_row = (qs[b, None] + w - prefix[b, None]).clamp(0, max(T - 1, 0))
        # a column past the table and a row past the state read clamped, as the kernel does (the engine's table
        # covers every position it keeps; default_state_rows keeps nothing past it)
        col = (w.clamp(min=0) // state_block).clamp(max=state_table.shape[1] - 1)
        st_row = (state_table.to(dev).long()[b[:, None].expand_as(w), col] * state_ring
                  + w.clamp(min=0) % state_ring).clamp(0, blocks.shape[0] * block_rows - 1)
        st = blocks[st_row // block_rows, st_row % block_rows].float()  # [E, win, width]
        src = torch.where(from_input[..., None], x[in_row], st)
        half = (torch.arange(win, device=dev) // ratio)  # [win]: the kv / score half each slot uses
        cols = half[:, None] * d + torch.arange(d, device=dev)[None, :]  # [win, d]
        kv = src.gather(2, cols[None].expand(len(e_tok), win, d))
        score = src.gather(2, (coff * d + cols)[None].expand(len(e_tok), win, d))
        bias = ape[w.clamp(min=0) % ratio].gather(2, cols[None].expand(len(e_tok), win, d))
        add = from_input if state_has_ape else torch.ones_like(from_input)  # rows whose score lacks ape
        score = score + torch.where(add[..., None], bias, torch.zeros_like(bias))
        neg = (w < 0)[..., None]
        score = score.masked_fill(neg, float("-inf"))
        kv = kv.masked_fill(neg, 0.0)
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)  # [E, d]
        y = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * norm_weight.float()
        at = pos[e_tok] + 1 - ratio
        y = torch.cat([y[:, :d - ROPE], rope_gptj(y[:, d - ROPE:], cos[at].float(), sin[at].float())], dim=1)
        if rotate:
            y = hadamard(y)
        bf16_row = d == L.D or index_scale == "pow2"  # the writer takes the row rounded to bf16
        if rows_out is not None:
            rows_out[e_tok] = y.to(torch.bfloat16).float() if bf16_row else y
        slots = out_slots.to(dev).long()[e_tok]
        row = y.to(torch.bfloat16) if bf16_row else y
        if d == L.D:
            write_kv_v4_reference(row, cache, slots)
        else:  # vLLM rounds the key to bf16 before its power-of-two scale, SGLang quantises the float32 key
            write_index_k_reference(row, cache, slots, index_scale)
    # the state writes, after every read (SGLang's rings alias the rows a window reads)
    if state_rows is None:
        sr = default_state_rows(req, pos, state_table.to(dev), state_block, state_ring,
                                blocks.shape[0] * block_rows)
    else:
        sr = state_rows.to(dev).long()
    keep = (sr >= 0) & (sr < blocks.shape[0] * block_rows)  # as the kernel: a row past the state is not kept
    if keep.any():
        new = x[keep].clone()
        if state_has_ape:
            new[:, coff * d:] += ape[pos[keep] % ratio]
        r = sr[keep]
        blocks[r // block_rows, r % block_rows] = new.to(blocks.dtype)
    return rows_out

