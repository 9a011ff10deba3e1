"""Launch the TileLang compressor (:mod:`.kernel`): the rows (and the writers' slots: -1 where a token
emits none), then the writers' quantised store, then the state writes. Three launches and no other device work
when the arguments come in the kernels' dtypes, so a decode step costs little beyond its reads. Arguments arrive
checked by :mod:`.compressor`."""

from __future__ import annotations

import torch

from ...._tilelang import compile_cached, tl
from ..._common import check
from .. import layout as L
from .kernel import build_compress_rows, build_save_state


def _pass_configs() -> dict:
    """The compressor places its barriers itself (under conditions the whole block shares)."""
    return {tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def compress_rows_kernel(d: int, ratio: int, rotate: bool, state_has_ape: bool, out_dtype: str, target=None):
    return compile_cached(("dsv4_compress_rows", d, ratio, rotate, state_has_ape, out_dtype),
                          lambda: build_compress_rows(d, ratio, rotate, state_has_ape, out_dtype), target=target,
                          pass_configs=_pass_configs())


def save_state_kernel(width: int, ratio: int, state_has_ape: bool, from_table: bool, target=None):
    return compile_cached(("dsv4_save_state", width, ratio, state_has_ape, from_table),
                          lambda: build_save_state(width, ratio, state_has_ape, from_table), target=target)


def _state_view(op: str, state: torch.Tensor):
    """(flat float32 view from the state's first element, rows a block, block stride in elements, rows)."""
    blocks = state[:, None] if state.dim() == 2 else state
    nb, br, width = blocks.shape
    check(br == 1 or blocks.stride(1) == width, lambda: f"{op}: the state's rows must be dense within a block")
    bstride = blocks.stride(0) if nb > 1 else br * width
    span = max(nb - 1, 0) * bstride + br * width
    return state.as_strided((span,), (1,)), br, bstride, nb * br


def compress_tilelang(kv_score, ape, ratio, positions, token_req, query_start, seq_lens, state, state_table,
                      state_block, state_ring, norm_weight, eps, cos, sin, cache, out_slots, *, state_rows,
                      state_has_ape, rotate, index_scale, return_rows):
    from ..writers import write_index_k, write_kv_v4

    op = "compress(impl='tilelang')"
    T_, width = kv_score.shape
    coff = 2 if ratio == 4 else 1
    d = width // (2 * coff)
    dev = kv_score.device
    exact = d == L.INDEX_D and index_scale == "exact"
    out_dtype = torch.float32 if exact else torch.bfloat16
    flat, br, bstride, nrows = _state_view(op, state)
    pos = positions.to(torch.int64).contiguous()
    req = token_req.to(torch.int32).contiguous()
    slots = out_slots.to(torch.int64).contiguous()
    table = state_table.to(torch.int32).contiguous()
    if table.shape[1] == 0:  # no position kept anywhere: one column of -1 says so without an empty read
        table = torch.full((table.shape[0], 1), -1, dtype=torch.int32, device=dev)
    ape32 = ape.float().contiguous()
    rows = torch.empty(T_, d, dtype=out_dtype, device=dev)
    run = T_ > 0 and seq_lens.numel() > 0  # with no request every token is padding: nothing to emit or keep
    write_slots = (torch.empty(T_, dtype=torch.int64, device=dev) if run
                   else torch.full((T_,), -1, dtype=torch.int64, device=dev))
    if run:
        compress_rows_kernel(d, ratio, rotate, state_has_ape, "float32" if exact else "bfloat16")(
            kv_score.contiguous(), ape32, pos, req, query_start.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), flat, table, slots, norm_weight.float().contiguous(),
            cos.float().contiguous(), sin.float().contiguous(), state_block, state_ring, br, bstride, nrows,
            float(eps), rows, write_slots)
    if d == L.D:
        write_kv_v4(rows, cache, write_slots)
    else:
        write_index_k(rows, cache, write_slots, scale=index_scale)
    if run:
        srows = slots if state_rows is None else state_rows.to(torch.int64).contiguous()  # slots: any [T] int64
        save_state_kernel(width, ratio, state_has_ape, state_rows is None)(
            kv_score.contiguous(), ape32, pos, srows, req, table, flat, state_block, state_ring, br, bstride, nrows)
    if not return_rows:
        return None
    return rows.float().masked_fill_((write_slots < 0)[:, None], float("nan"))
