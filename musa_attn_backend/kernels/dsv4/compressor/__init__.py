"""DeepSeek-V4's KV compressors: every ``ratio`` tokens of a C4 / C128 layer (and of its indexer) become one
quantised row of the compressed cache. The running state between calls stays in the engine's own buffer,
addressed through a table, so SGLang's rings and vLLM's paged state cache are both served without a copy.

The math: :mod:`.reference` (the path on a CPU); on a GPU the TileLang programs of
:mod:`.kernel` and the writers. The op checks every argument before anything runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check, check_same_device, is_int_tensor, resolve_impl
from .. import layout as L
from .reference import compress_reference

RATIOS = (4, 128)
INDEX_SCALES = ("pow2", "exact")


def compress(kv_score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, token_req: torch.Tensor,
             query_start: torch.Tensor, seq_lens: torch.Tensor, *, ratio: int, state: torch.Tensor,
             state_table: torch.Tensor, state_block: int, state_ring: int, norm_weight: torch.Tensor, eps: float,
             cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, out_slots: torch.Tensor,
             state_rows: Optional[torch.Tensor] = None, state_has_ape: bool = False, rotate: bool = False,
             index_scale: str = "pow2", return_rows: bool = False, impl: str = "auto") -> Optional[torch.Tensor]:
    """Compress this call's tokens into ``cache`` and record them in ``state``.

    - ``kv_score [T, 2 * coff * d]`` float32: each token's projected ``[kv | score]`` (``coff`` 2 for ``ratio``
      4, 1 for 128; ``d`` 512: the attention compressor, 128: the indexer's), scores without ape.
    - ``ape [ratio, coff * d]`` float32 (the checkpoint's layout; any strides).
    - ``positions [T]`` (in the request), ``token_req [T]`` (the token's batch row, ``-1``: padding),
      ``query_start [B + 1]`` (the rows of request ``b`` in ``kv_score`` are ``query_start[b] ..
      query_start[b + 1]``, in position order, ending at position ``seq_lens[b] - 1``), ``seq_lens [B]``.
    - ``state``: float32 rows of ``2 * coff * d``, ``[rows, width]`` or ``[blocks, block_rows, width]`` (any
      block stride); the row of request ``b``'s position ``w`` is ``state_table[b, w // state_block] *
      state_ring + w % state_ring`` (vLLM: its block table with ``state_block = state_ring`` = the block size;
      SGLang C128: ``req_pool_indices`` expanded over the table's width, ring 128 (256 with speculation)).
      ``state_rows [T]``: the rows this call's tokens are written to afterwards (``-1`` or past the state: not
      kept; None: the table's row of every token's position, none for a position past the table or at a
      negative entry). A window position past the table reads the table's last column: the engine's table
      covers every position it keeps. ``state_has_ape``: the stored scores include ape (vLLM).
    - ``norm_weight [d]``, ``eps``: the RMSNorm; ``cos``, ``sin [max_pos, 32]`` float32: the compressor's RoPE
      table (GPT-J pairs of the last 64 dims), read at position ``c * ratio`` for row ``c``.
    - ``cache``: the compressed cache (584-byte rows for ``d`` 512, 132-byte rows for 128); ``out_slots [T]``: a
      token at a window's end (``(position + 1) % ratio == 0``) writes its row at ``out_slots[t]`` (negative:
      skipped); other tokens' slots are not read (SGLang passes 0 there, vLLM -1).
    - ``rotate``: the Hadamard rotation (the indexer's keys; SGLang rotates, vLLM does not); ``index_scale``:
      the indexer keys' FP8 scale, ``"pow2"`` (vLLM) or ``"exact"`` ``amax / 448`` (SGLang).
    - ``return_rows``: return the rows ``[T, d]`` the writer quantises, as float32 (bf16 values for the MODEL1
      cache and the ``"pow2"`` rule; NaN for tokens that emit none).
    """
    op = "compress"
    check(ratio in RATIOS, lambda: f"{op}: ratio must be one of {RATIOS}, got {ratio!r}")
    coff = 2 if ratio == 4 else 1
    check(isinstance(kv_score, torch.Tensor) and kv_score.dtype == torch.float32 and kv_score.dim() == 2
          and kv_score.shape[1] in (2 * coff * L.D, 2 * coff * L.INDEX_D),
          lambda: f"{op}: kv_score must be float32 [T, {2 * coff * L.D}] (attention) or [T, {2 * coff * L.INDEX_D}] "
                  f"(indexer) for ratio {ratio}, got {getattr(kv_score, 'dtype', None)} "
                  f"{tuple(getattr(kv_score, 'shape', ()))}")
    T, width = kv_score.shape
    d = width // (2 * coff)
    check(isinstance(ape, torch.Tensor) and ape.is_floating_point() and tuple(ape.shape) == (ratio, coff * d),
          lambda: f"{op}: ape must be [{ratio}, {coff * d}] (the checkpoint's layout), got "
                  f"{tuple(getattr(ape, 'shape', ()))}")
    for name, t in (("positions", positions), ("token_req", token_req), ("out_slots", out_slots)):
        check(is_int_tensor(t) and t.dim() == 1 and t.numel() == T, lambda: f"{op}: {name} must be an integer [{T}] tensor")
    check(is_int_tensor(seq_lens) and seq_lens.dim() == 1, lambda: f"{op}: seq_lens must be an integer [B] tensor")
    B = seq_lens.numel()
    check(is_int_tensor(query_start) and query_start.dim() == 1 and query_start.numel() == B + 1,
          lambda: f"{op}: query_start must be an integer [{B + 1}] tensor")
    check(isinstance(state, torch.Tensor) and state.dtype == torch.float32 and state.dim() in (2, 3)
          and state.shape[-1] == width and state.stride(-1) == 1
          and (state.dim() == 2 or state.shape[1] == 1 or state.stride(1) == width),
          lambda: f"{op}: state must be float32 [rows, {width}] or [blocks, block_rows, {width}] with dense rows "
                  f"(any block stride), got {getattr(state, 'dtype', None)} {tuple(getattr(state, 'shape', ()))}")
    check(is_int_tensor(state_table) and state_table.dim() == 2 and state_table.shape[0] == B,
          lambda: f"{op}: state_table must be an integer [{B}, width] tensor")
    for name, v in (("state_block", state_block), ("state_ring", state_ring)):
        check(isinstance(v, int) and v >= 1, lambda: f"{op}: {name} must be a positive int, got {v!r}")
    check(state_rows is None or (is_int_tensor(state_rows) and state_rows.dim() == 1 and state_rows.numel() == T),
          lambda: f"{op}: state_rows must be None or an integer [{T}] tensor")
    check(isinstance(norm_weight, torch.Tensor) and norm_weight.is_floating_point() and norm_weight.numel() == d,
          lambda: f"{op}: norm_weight must be a floating [{d}] tensor")
    check(isinstance(eps, float) and eps > 0, lambda: f"{op}: eps must be a positive float, got {eps!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        check(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 and t.shape[1] == 32,
              lambda: f"{op}: {name} must be a floating [max_pos, 32] tensor (GPT-J pairs of 64 RoPE dims)")
    (L.kv_pages if d == L.D else L.index_pages)(cache, op=op)
    check(not rotate or d == L.INDEX_D, f"{op}: rotate (the Hadamard) applies to the indexer's keys only (d 128)")
    check(index_scale in INDEX_SCALES, lambda: f"{op}: index_scale must be one of {INDEX_SCALES}, got {index_scale!r}")
    check_same_device(op, kv_score=kv_score, ape=ape, positions=positions, token_req=token_req,
                      query_start=query_start, seq_lens=seq_lens, state=state, state_table=state_table,
                      norm_weight=norm_weight, cos=cos, sin=sin, cache=cache, out_slots=out_slots,
                      state_rows=state_rows)
    kwargs = dict(state_rows=state_rows, state_has_ape=state_has_ape, rotate=rotate, index_scale=index_scale,
                  return_rows=return_rows)
    if resolve_impl(impl, kv_score.device, op) == "tilelang":
        from .tilelang_impl import compress_tilelang

        return compress_tilelang(kv_score, ape, ratio, positions, token_req, query_start, seq_lens, state,
                                 state_table, state_block, state_ring, norm_weight, eps, cos, sin, cache, out_slots,
                                 **kwargs)
    return compress_reference(kv_score, ape, ratio, positions, token_req, query_start, seq_lens, state,
                              state_table, state_block, state_ring, norm_weight, eps, cos, sin, cache, out_slots,
                              **kwargs)
