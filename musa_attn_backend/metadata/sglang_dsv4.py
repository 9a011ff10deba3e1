"""SGLang 0.5.23's DeepSeek-V4 index metadata, computed by torch on any device: the two steps SGLang runs as
Triton kernels (``sglang/kernels/ops/attention/dsv4/metadata_kernel.py``), with their signatures and results, so
its V4 backend's metadata builders run where Triton does not (a CPU, MUSA) and under CUDA graphs (no host sync).

* :func:`init_compression_metadata`: per query row, where a C4 / C128 compressed row is written and how many
  compressed rows the row sees; the C128 table of compressed slots.
* :func:`fill_all_compressed_indices`: every compressed slot a row sees, for rows that see at most top-k of them.

This module never imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["init_compression_metadata", "fill_all_compressed_indices"]


def _ratio_fields(seq_lens: torch.Tensor, positions: torch.Tensor, raw_out_loc: torch.Tensor, ratio: int):
    """``(out_loc [W] int64, positions [B] int32, lengths_raw [B] int32, lengths_clamp1 [B] int32)`` of one ratio.
    The write rows are the first ``W = raw_out_loc.numel()`` metadata rows (context parallelism pads the rest); a
    row whose sequence length is a multiple of ``ratio`` writes compressed row ``raw_out_loc // ratio``, others
    write slot 0, as SGLang's kernel does (the compressor skips them)."""
    w = raw_out_loc.shape[0]
    seq = seq_lens.long()
    emit = seq[:w] % ratio == 0
    out_loc = torch.where(emit, raw_out_loc.long() // ratio, torch.zeros_like(raw_out_loc, dtype=torch.long))
    pos = (positions.long() & ~(ratio - 1)).to(torch.int32)
    raw = (seq // ratio).to(torch.int32)
    return out_loc, pos, raw, raw.clamp(min=1)


def init_compression_metadata(seq_lens: torch.Tensor, positions: torch.Tensor, raw_out_loc: torch.Tensor,
                              page_table: Optional[torch.Tensor] = None, page_size: int = 0,
                              compute_page_indices: bool = True):
    """SGLang's ``init_compression_metadata``: ``(c4_out_loc, c4_positions, c4_lengths_raw, c4_lengths_clamp1,
    c128_out_loc, c128_positions, c128_lengths_raw, c128_lengths_clamp1, c128_page_indices)``.

    ``seq_lens``, ``positions`` ``[B]`` per query row (its causal length and position); ``raw_out_loc [W <= B]``
    the rows' full-pool slots. ``c128_page_indices [B, (page_size // 128) * pages]`` int32:
    ``page_table[b, j // pr] * pr + j % pr`` (``pr = page_size // 128`` compressed rows a page) for ``j`` below
    the row's C128 length, ``-1`` past it; None unless ``compute_page_indices``."""
    w, b = raw_out_loc.shape[0], seq_lens.shape[0]
    if w > b:
        raise ValueError(f"raw_out_loc has {w} rows, expected at most {b} metadata rows")
    c4 = _ratio_fields(seq_lens, positions, raw_out_loc, 4)
    c128 = _ratio_fields(seq_lens, positions, raw_out_loc, 128)
    pages = None
    if compute_page_indices:
        if page_table is None:
            raise ValueError("page_table is required when compute_page_indices=True")
        if page_size < 128 or page_size % 128:
            raise ValueError(f"page_size must be a multiple of 128 when compute_page_indices=True, got {page_size}")
        pr = page_size // 128
        width = pr * page_table.shape[1]
        j = torch.arange(width, device=seq_lens.device)
        slots = page_table.long()[:, j // pr] * pr + j % pr
        pages = torch.where(j[None, :] < c128[2].long()[:, None], slots, torch.full_like(slots, -1)).to(torch.int32)
    return (*c4, *c128, pages)


def fill_all_compressed_indices(page_table: torch.Tensor, compressed_seq_lens: torch.Tensor,
                                page_indices: torch.Tensor, *, compress_ratio: int, page_size: int,
                                raw_indices: Optional[torch.Tensor] = None) -> None:
    """SGLang's ``fill_all_compressed_indices``, in place: ``page_indices[t, j]`` = compressed slot
    ``page_table[t, j // spp] * spp + j % spp`` (``spp = page_size // compress_ratio``) for ``j`` below the row's
    compressed length and the top-k width, ``-1`` past it; ``raw_indices[t, j]`` = ``j`` there, ``-1`` past it.
    The caller guarantees the lengths are at most the width (a row's compressed rows are all taken)."""
    topk = page_indices.shape[1]
    spp = page_size // compress_ratio
    j = torch.arange(topk, device=page_indices.device)
    col = (j // spp).clamp(max=max(page_table.shape[1] - 1, 0))
    valid = j[None, :] < compressed_seq_lens.long()[:, None]
    if page_table.shape[1]:
        slots = page_table.long()[:, col] * spp + j % spp
    else:
        slots = torch.zeros(page_indices.shape, dtype=torch.long, device=page_indices.device)
    page_indices.copy_(torch.where(valid, slots, torch.full_like(slots, -1)))
    if raw_indices is not None:
        raw_indices.copy_(torch.where(valid, j[None, :].expand_as(slots), torch.full_like(slots, -1)))
