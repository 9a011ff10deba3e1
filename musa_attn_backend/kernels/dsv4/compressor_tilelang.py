"""Launch the TileLang compressor (:mod:`.compress_kernel`): the rows, then the writers' quantised store at the
slots of the tokens that emit one, then the state writes. Arguments arrive checked by :mod:`.compressor`."""

from __future__ import annotations

import torch

from ..._tilelang import compile_cached, tl
from .._common import check
from . import layout as L
from .compress_kernel import build_compress_rows, build_save_state
from .compressor_reference import default_state_rows


def _pass_configs() -> dict:
    """The compressor places its barriers itself (under conditions the whole block shares)."""
    return {tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def compress_rows_kernel(d: int, ratio: int, rotate: bool, state_has_ape: bool, out_dtype: str, target=None):
    return compile_cached(("dsv4_compress_rows", d, ratio, rotate, state_has_ape, out_dtype),
                          lambda: build_compress_rows(d, ratio, rotate, state_has_ape, out_dtype), target=target,
                          pass_configs=_pass_configs())


def save_state_kernel(width: int, ratio: int, state_has_ape: bool, target=None):
    return compile_cached(("dsv4_save_state", width, ratio, state_has_ape),
                          lambda: build_save_state(width, ratio, state_has_ape), target=target)


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
    from . import write_index_k, write_kv_v4

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
    ape32 = ape.float().contiguous()
    rows = torch.empty(T_, d, dtype=out_dtype, device=dev)
    if T_:
        compress_rows_kernel(d, ratio, rotate, state_has_ape, "float32" if exact else "bfloat16")(
            kv_score.contiguous(), ape32, pos, req, query_start.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), flat, table, slots, norm_weight.float().contiguous(),
            cos.float().contiguous(), sin.float().contiguous(), state_block, state_ring, br, bstride, nrows,
            float(eps), rows)
    emit = (req >= 0) & (req < seq_lens.numel()) & ((pos + 1) % ratio == 0) & (slots >= 0)
    write_slots = torch.where(emit, slots, torch.full_like(slots, -1))
    if d == L.D:
        write_kv_v4(rows, cache, write_slots)
    else:
        write_index_k(rows, cache, write_slots, scale=index_scale)
    if state_rows is None:
        srows = default_state_rows(req, pos, table, state_block, state_ring, nrows)
    else:
        srows = state_rows.to(torch.int64).contiguous()
    if T_:
        save_state_kernel(width, ratio, state_has_ape)(kv_score.contiguous(), ape32, pos, srows, flat, br, bstride,
                                                       nrows)
    if not return_rows:
        return None
    return rows.float().masked_fill_(~emit[:, None], float("nan"))
