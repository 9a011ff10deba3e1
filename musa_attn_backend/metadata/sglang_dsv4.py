"""SGLang 0.5.23's DeepSeek-V4 index metadata, computed by torch on any device: the two steps SGLang runs as
Triton kernels (``sglang/kernels/ops/attention/dsv4/metadata_kernel.py``), with their signatures and results, so
its V4 backend's metadata builders run where Triton does not (a CPU, MUSA) and under CUDA graphs (no host sync).

* :func:`init_compression_metadata`: per query row, where a C4 / C128 compressed row is written and how many
  compressed rows the row sees; the C128 table of compressed slots.
* :func:`fill_all_compressed_indices`: every compressed slot a row sees, for rows that see at most top-k of them.
* :func:`compress_call`, :func:`checkpoint_ape`, :func:`rope_table`: what :func:`..kernels.dsv4.compress` takes,
  from SGLang's batch, its compressor state pool and its compressor module's parameters.

This module never imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["init_compression_metadata", "fill_all_compressed_indices", "checkpoint_ape", "compress_call", "rope_table",
           "slots_of_positions"]


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


def checkpoint_ape(ape: torch.Tensor, ratio: int, relaid: bool) -> torch.Tensor:
    """A C4 compressor's ``ape [4, 2d]`` in the checkpoint's layout. SGLang lays it out again at load
    (``_apply_ape_hotfix``: the halves stacked, so that row ``i`` of its ``[8, d]`` view is window slot ``i``'s
    bias); ``relaid`` says it did. C128's has one half and is never changed."""
    if ratio != 4 or not relaid:
        return ape
    rows = ape.reshape(2 * ratio, -1)
    return torch.cat([rows[:ratio], rows[ratio:]], dim=1)


def compress_call(*, ratio: int, positions: torch.Tensor, extend_lens: torch.Tensor,
                  req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, full_to_swa: Optional[torch.Tensor],
                  swa_page_size: int, ring: int, request_scoped: bool) -> dict:
    """The addressing arguments of :func:`..kernels.dsv4.compress` for one SGLang batch (no host sync).

    - Tokens: ``positions [T]``, request ``b``'s ``extend_lens[b]`` of them packed in order (every request has at
      least one); its sequence ends after its last token's position.
    - The state is SGLang's ``CompressStatePool``: request-scoped rings (C128: row ``req * ring + pos % ring``) or
      rings per SWA page (C4: row ``(s // page) * ring + s % ring`` of the token's SWA slot ``s``; as SGLang's
      pages hold 256 positions at their offsets, that is the table of each request page's SWA page).
    - ``state_rows``: the rows this call keeps, by SGLang's rule, so later calls find what they read: positions
      from the last window start before the sequence end on (``min(floor(seq / r) * r - (4 for C4), seq - pad)``,
      ``pad = ring - window + 2`` where speculation widened the ring), and for C4 each SWA page's last 4 (the
      window a request sharing the page as a prefix reads). Within a call no two kept positions share a row.
    """
    dev = positions.device
    B, T = extend_lens.shape[0], positions.shape[0]
    lens = extend_lens.to(torch.int32)
    query_start = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    query_start[1:] = torch.cumsum(lens, 0)
    token_req = torch.repeat_interleave(torch.arange(B, dtype=torch.int32, device=dev), lens, output_size=T)
    pos = positions.long()
    last = (query_start[1:].long() - 1).clamp(min=0, max=max(T - 1, 0))
    seq_lens = (pos[last] + 1).to(torch.int32) if T else torch.zeros(B, dtype=torch.int32, device=dev)
    if request_scoped:
        table = req_pool_indices.to(torch.int32)[:, None]
        block = 1 << 30  # one column: every position's ring is the request's
    else:
        cols = torch.arange(0, req_to_token.shape[1], swa_page_size, device=dev)
        full = req_to_token[req_pool_indices.long()][:, cols].long()
        swa = full_to_swa[full.clamp(0, full_to_swa.numel() - 1)].long()
        table = torch.where(swa >= 0, swa // swa_page_size, torch.full_like(swa, -1)).to(torch.int32)
        block = swa_page_size
    win = 8 if ratio == 4 else ratio
    pad = ring - win + 2 if ring > win else 0
    seq = seq_lens.long()[token_req.long()]
    keep = pos >= torch.minimum((seq // ratio) * ratio - (4 if ratio == 4 else 0), seq - pad)
    if ratio == 4 and not request_scoped:
        keep |= pos % swa_page_size >= swa_page_size - 4
    entry = table.long()[token_req.long(), (pos.clamp(min=0) // block).clamp(max=table.shape[1] - 1)]
    rows = torch.where(keep & (entry >= 0) & (pos >= 0), entry * ring + pos.clamp(min=0) % ring,
                       torch.full_like(pos, -1))
    return dict(positions=pos, token_req=token_req, query_start=query_start, seq_lens=seq_lens, state_table=table,
                state_block=block, state_ring=ring, state_rows=rows)


_rope_tables: dict = {}


def rope_table(freqs_cis: torch.Tensor):
    """``(cos, sin) [max_pos, 32]`` float32 from SGLang's complex ``freqs_cis [max_pos, 32]`` (GPT-J pairs), made
    once per table: the model's tables live as long as the process, and each entry holds its table, so an address
    is never taken by another one while cached."""
    key = (freqs_cis.data_ptr(), tuple(freqs_cis.shape), str(freqs_cis.device))
    entry = _rope_tables.get(key)
    if entry is None or entry[0] is not freqs_cis:
        parts = torch.view_as_real(freqs_cis) if freqs_cis.is_complex() else freqs_cis.view(freqs_cis.shape[0], -1, 2)
        entry = (freqs_cis, parts[..., 0].float().contiguous(), parts[..., 1].float().contiguous())
        _rope_tables[key] = entry
    return entry[1], entry[2]


def slots_of_positions(positions: torch.Tensor, page_table: torch.Tensor, page_rows: int) -> torch.Tensor:
    """Compressed positions ``[T, k]`` (``-1``: none) as cache slots through each row's page table (``page_rows``
    rows a page): ``page_table[t, i // page_rows] * page_rows + i % page_rows``, ``-1`` for none, for a position
    past the table or at a negative entry (SGLang's ``topk_transform``)."""
    i = positions.long().clamp(min=0)
    col = i // page_rows
    entry = page_table.long().gather(1, col.clamp(max=max(page_table.shape[1] - 1, 0)))
    ok = (positions >= 0) & (col < page_table.shape[1]) & (entry >= 0)
    return torch.where(ok, entry * page_rows + i % page_rows, torch.full_like(i, -1)).to(positions.dtype)
