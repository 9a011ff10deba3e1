"""DeepSeek-V4's indexer: the FP8 logits of the C4 layers' query rows against the indexer keys (contiguous for
prefill, paged for decode), and the top-k of those logits as request-local positions or cache slots.

Math: :mod:`.reference` (also the path on a CPU). Every op checks its arguments before anything runs and
names the one it refuses; none reads a device value on the host (no synchronisation: CUDA-graph safe).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check, check_same_device, is_int_tensor, resolve_impl
from .. import layout as L
from .reference import (indexer_logits_reference, indexer_q_reference, indexer_topk_reference,
                                paged_indexer_logits_reference)

INDEX_HEADS = (16, 32, 64)  # indexer heads per rank (V4: 64; a tensor-parallel split of them)
MAX_NEXT_N = 2  # query rows per request in paged decode (MTP: 2)
MAX_TOPK = 2048


def _check_q_w(op: str, q, w, rows: int, heads_dim: int) -> int:
    check(isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn and q.shape[-1] == L.INDEX_D,
          lambda: f"{op}: q must be float8_e4m3fn [..., heads, {L.INDEX_D}], got "
                  f"{getattr(q, 'dtype', None)} {tuple(getattr(q, 'shape', ()))}")
    H = q.shape[heads_dim]
    check(H in INDEX_HEADS, lambda: f"{op}: the number of indexer heads must be one of {INDEX_HEADS}, got {H}")
    check(isinstance(w, torch.Tensor) and w.dtype == torch.float32 and tuple(w.shape) == (rows, H),
          lambda: f"{op}: w must be float32 [{rows}, {H}] (the per-row q scale folded in), got "
                  f"{getattr(w, 'dtype', None)} {tuple(getattr(w, 'shape', ()))}")
    return H


def indexer_logits(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, starts: torch.Tensor,
                   ends: torch.Tensor, *, clean: bool = True, impl: str = "auto") -> torch.Tensor:
    """Prefill indexer logits: ``[T, S]`` float32 with ``logit[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) *
    k_scale[s]`` for ``s`` in ``[starts[t], ends[t])``, ``-inf`` elsewhere (``clean=False``: elsewhere is left
    unwritten, as DeepGEMM's ``fp8_mqa_logits`` with ``clean_logits=False``).

    ``q [T, H, 128]`` float8_e4m3fn (``H`` one of :data:`INDEX_HEADS`), ``w [T, H]`` float32, ``k [S, 128]``
    float8_e4m3fn, ``k_scale [S]`` float32, ``starts`` / ``ends [T]`` int32 (a range is cut to ``[0, S)``).
    """
    op = "indexer_logits"
    check(isinstance(q, torch.Tensor) and q.dim() == 3, lambda: f"{op}: q must be [T, heads, 128]")
    T = q.shape[0]
    _check_q_w(op, q, w, T, 1)
    check(isinstance(k, torch.Tensor) and k.dtype == torch.float8_e4m3fn and k.dim() == 2
          and k.shape[1] == L.INDEX_D, lambda: f"{op}: k must be float8_e4m3fn [S, {L.INDEX_D}], got "
                                               f"{getattr(k, 'dtype', None)} {tuple(getattr(k, 'shape', ()))}")
    S = k.shape[0]
    check(isinstance(k_scale, torch.Tensor) and k_scale.dtype == torch.float32 and k_scale.numel() == S,
          lambda: f"{op}: k_scale must be float32 [{S}]")
    for name, t in (("starts", starts), ("ends", ends)):
        check(is_int_tensor(t) and t.dim() == 1 and t.numel() == T, lambda: f"{op}: {name} must be an integer [{T}] tensor")
    check_same_device(op, q=q, w=w, k=k, k_scale=k_scale, starts=starts, ends=ends)
    if resolve_impl(impl, q.device, op) == "reference" or T == 0 or S == 0:
        return indexer_logits_reference(q, w, k, k_scale.reshape(S), starts, ends, clean=clean)
    from .tilelang_impl import indexer_logits_tilelang

    return indexer_logits_tilelang(q, w, k, k_scale.reshape(S), starts, ends, clean)


def paged_indexer_logits(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, max_len: int, *, clean: bool = True,
                         impl: str = "auto") -> torch.Tensor:
    """Decode indexer logits over the paged indexer-key cache: ``[B * next_n, max_len]`` float32.

    ``q [B, next_n, H, 128]`` float8_e4m3fn (``next_n`` 1 or 2: MTP), ``w [B * next_n, H]`` float32,
    ``cache``: 132-byte rows in pages of 64 (:mod:`.layout`; page stride read from the tensor), ``context_lens``
    int32 ``[B]`` (``next_n == 1``) or ``[B, next_n]``: the number of keys row ``(b, j)`` sees, keys
    ``block_table[b, i // 64]``'s row ``i % 64`` for ``i < length``. Columns at or past a row's length, and keys
    whose page entry is negative or past the cache, read nothing and hold ``-inf`` (``clean=False``: columns at
    or past the length are left unwritten, as DeepGEMM's ``fp8_paged_mqa_logits``; a bad page entry still gives
    ``-inf``). Page entries past a row's length are never read.
    """
    op = "paged_indexer_logits"
    check(isinstance(q, torch.Tensor) and q.dim() == 4, lambda: f"{op}: q must be [B, next_n, heads, 128]")
    B, next_n = q.shape[:2]
    check(1 <= next_n <= MAX_NEXT_N, lambda: f"{op}: next_n must be in [1, {MAX_NEXT_N}], got {next_n}")
    _check_q_w(op, q, w, B * next_n, 2)
    pages = L.index_pages(cache, op=op)
    check(pages.rows == 64, lambda: f"{op}: the indexer-key cache must have 64 rows a page, got {pages.rows}")
    check(is_int_tensor(context_lens) and (tuple(context_lens.shape) == (B, next_n)
                                     or (next_n == 1 and tuple(context_lens.shape) == (B,))),
          lambda: f"{op}: context_lens must be an integer [{B}, {next_n}] tensor (or [{B}] when next_n is 1): each "
                  f"query row's own key count; got {tuple(getattr(context_lens, 'shape', ()))}")
    check(is_int_tensor(block_table) and block_table.dim() == 2 and block_table.shape[0] == B,
          lambda: f"{op}: block_table must be an integer [{B}, pages] tensor")
    check(isinstance(max_len, int) and 0 <= max_len <= block_table.shape[1] * 64,
          lambda: f"{op}: max_len must be an int in [0, {block_table.shape[1] * 64}] (the block table's keys), "
                  f"got {max_len!r}")
    check_same_device(op, q=q, w=w, cache=cache, context_lens=context_lens, block_table=block_table)
    if resolve_impl(impl, q.device, op) == "reference" or B == 0 or max_len == 0:
        return paged_indexer_logits_reference(q, w, cache, context_lens, block_table, max_len, clean=clean)
    from .tilelang_impl import paged_indexer_logits_tilelang

    return paged_indexer_logits_tilelang(q, w, cache, context_lens, block_table, max_len, clean)


def indexer_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, *, starts: Optional[torch.Tensor] = None,
                 page_table: Optional[torch.Tensor] = None, page_rows: int = 64,
                 out: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """The top-k of each row of the indexer logits: ``int32 [T, k]``.

    Row ``t`` ranks the columns ``[starts[t], starts[t] + lengths[t])`` of ``logits [T, N]`` float32 (``starts``
    None: from column 0; a range is cut at ``N``; a length <= 0 selects nothing). It returns the positions
    ``i - starts[t]`` of its ``k`` largest values in any order or, when the range holds at most ``k`` columns,
    all of them in position order; ``-1`` pads. Ties at the k-th value: any of the tied positions. NaN ranks
    below every number (-inf included). With ``page_table [T, P]`` int32 the positions come back as cache slots
    ``page_table[t, i // page_rows] * page_rows + i % page_rows`` (SGLang's ``topk_transform_paged``), ``-1`` where
    the position's page entry is negative or past ``P``. ``out``: a contiguous int32 ``[T, k]`` to write into.
    """
    op = "indexer_topk"
    check(isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 and logits.dim() == 2
          and (logits.shape[1] <= 1 or logits.stride(1) == 1),
          lambda: f"{op}: logits must be a float32 [T, N] tensor with unit column stride, got "
                  f"{getattr(logits, 'dtype', None)} {tuple(getattr(logits, 'shape', ()))}")
    T = logits.shape[0]
    check(isinstance(k, int) and 1 <= k <= MAX_TOPK, lambda: f"{op}: k must be an int in [1, {MAX_TOPK}], got {k!r}")
    check(is_int_tensor(lengths) and lengths.dim() == 1 and lengths.numel() == T,
          lambda: f"{op}: lengths must be an integer [{T}] tensor")
    check(starts is None or (is_int_tensor(starts) and starts.dim() == 1 and starts.numel() == T),
          lambda: f"{op}: starts must be an integer [{T}] tensor")
    if page_table is not None:
        check(is_int_tensor(page_table) and page_table.dim() == 2 and page_table.shape[0] == T,
              lambda: f"{op}: page_table must be an integer [{T}, pages] tensor")
        check(isinstance(page_rows, int) and page_rows >= 1 and page_rows & (page_rows - 1) == 0,
              lambda: f"{op}: page_rows must be a power of two, got {page_rows!r}")
    if out is not None:
        check(isinstance(out, torch.Tensor) and out.dtype == torch.int32 and tuple(out.shape) == (T, k)
              and out.is_contiguous(), lambda: f"{op}: out must be a contiguous int32 [{T}, {k}] tensor")
    check_same_device(op, logits=logits, lengths=lengths, starts=starts, page_table=page_table, out=out)
    if resolve_impl(impl, logits.device, op) == "reference" or T == 0 or logits.shape[1] == 0:
        res = indexer_topk_reference(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows)
        if out is None:
            return res
        out.copy_(res)
        return out
    from .tilelang_impl import indexer_topk_tilelang

    return indexer_topk_tilelang(logits, lengths, k, starts, page_table, page_rows, out)


def indexer_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, *, weight_scale: Optional[float] = None, rotate: bool = True, scale: str = "exact",
              bf16_rope: bool = False, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's FP8 query rows and weights, from ``q [T, H, 128]`` (``wq_b``'s output) and ``weights
    [T, H]`` (``weights_proj``'s): RoPE of dims 64..127 at ``positions [T]`` (``cos``, ``sin [max_pos, 32]``,
    GPT-J pairs), the Hadamard rotation, per (token, head) FP8 quantisation, the q scale and ``weight_scale``
    (default ``128 ** -0.5 * H ** -0.5``: the softmax scale and the head count) folded into the weights.
    Defaults as SGLang's ``fused_q_indexer_rope_hadamard_quant``; vLLM's ``fused_indexer_q_rope_quant``:
    ``rotate=False, scale="pow2", bf16_rope=True``. Returns ``(q e4m3fn [T, H, 128], w float32 [T, H])``, the
    inputs of :func:`indexer_logits` / :func:`paged_indexer_logits`."""
    op = "indexer_q"
    check(isinstance(q, torch.Tensor) and q.is_floating_point() and q.dim() == 3 and q.shape[2] == L.INDEX_D,
          lambda: f"{op}: q must be a floating [T, heads, {L.INDEX_D}] tensor, got {tuple(getattr(q, 'shape', ()))}")
    T, H, _ = q.shape
    check(H in INDEX_HEADS, lambda: f"{op}: the number of indexer heads must be one of {INDEX_HEADS}, got {H}")
    check(isinstance(weights, torch.Tensor) and weights.is_floating_point() and tuple(weights.shape) == (T, H),
          lambda: f"{op}: weights must be a floating [{T}, {H}] tensor")
    check(is_int_tensor(positions) and positions.dim() == 1 and positions.numel() == T,
          lambda: f"{op}: positions must be an integer [{T}] tensor")
    for name, t in (("cos", cos), ("sin", sin)):
        check(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 and t.shape[1] == 32,
              lambda: f"{op}: {name} must be a floating [max_pos, 32] tensor")
    check(scale in ("exact", "pow2"), lambda: f"{op}: scale must be 'exact' or 'pow2', got {scale!r}")
    check_same_device(op, q=q, weights=weights, positions=positions, cos=cos, sin=sin)
    ws = (L.INDEX_D ** -0.5) * (H ** -0.5) if weight_scale is None else float(weight_scale)
    if resolve_impl(impl, q.device, op) == "tilelang":
        from .tilelang_impl import indexer_q_tilelang

        return indexer_q_tilelang(q, weights, positions, cos, sin, ws, rotate, scale, bf16_rope)
    return indexer_q_reference(q, weights, positions, cos, sin, weight_scale=ws, rotate=rotate, scale=scale,
                               bf16_rope=bf16_rope)
