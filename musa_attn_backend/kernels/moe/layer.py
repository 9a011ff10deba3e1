"""The routed-experts op of a DeepSeek-V4 MoE layer, composed from the grouped GEMMs (:func:`fused_experts`), and
its float32 reference (:func:`fused_experts_reference`).

For each token ``t`` and each of its ``k`` choices ``(e, w) = (topk_ids[t, j], topk_weights[t, j])``::

    a    = fp8_groups(hidden[t])                        # 1 x 128 quantisation, amax / 448
    h    = bf16(a @ W13_e^T)                            # [2I]: gate = h[:I], up = h[I:]
    act  = silu(min(gate, L)) * clamp(up, -L, L)        # L = swiglu_limit (no clamp when None)
    y    = bf16(fp8_groups(act) @ W2_e^T)               # [H]
    out[t] = bf16(sum_j w * y)                          # float32 sum over the choices

``W13_e``, ``W2_e``: the expert's dequantised weights (128 x 128 block-scaled FP8, or MXFP4). With
``apply_router_weight_on_input`` (top-1 routing only, as the engines allow), ``hidden[t]`` is multiplied by ``w``
before the quantisation and the sum takes weight 1. A choice whose expert is not on this rank (``expert_map``
``-1``) or is out of range contributes nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .reference import (align_routing, dequantize_groups, dequantize_weights, grouped_gemm_contiguous_reference,
                        grouped_gemm_masked_reference, local_expert_ids, quantize_groups_reference)

# decode batches up to this many tokens run the masked layout (fixed shapes: CUDA-graph safe); larger ones the
# contiguous layout
MASKED_MAX_TOKENS = 64

# how the SwiGLU and GEMM2's quantisation run between the GEMMs: "torch" (torch ops on the chosen rows), "pass"
# (one swiglu_quant launch), "fused" (in GEMM1's epilogue, FP8 weights; FP4 weights take "pass").
# tests/moe/test_gpu_moe.py runs all three; bench_moe.py's layer rows time them: "pass" is the fastest from
# 8 tokens on (the fused GEMM1's 64 x 256 tile runs slower than the plain GEMM1 and the pass together)
SWIGLU_PATH = "pass"
SWIGLU_PATHS = ("torch", "pass", "fused")

# the layer's glue around the GEMMs: False, torch ops (quantize_scatter_reference, combine_reference); True, the
# TileLang programs (quantize_scatter_kernel.py: each token quantised once, written to its choices' rows;
# combine_kernel.py: each chosen row read once as bf16, no [T, k, H] float32 intermediate), the faster measured
GLUE_KERNELS = True
# the masked layout's routing (local ids, repeats merged, slots, counts): False, the torch ops of
# route_masked_reference (about twenty small launches at decode); True, one launch of route_masked_kernel.py, the
# faster measured at decode (docs/moe.md) and checked on a GPU against the reference
ROUTE_KERNEL = True


def swiglu(h: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` in float32 of ``h = [gate | up]`` (no clamp when ``limit`` is None)."""
    gate, up = h.float().chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def swiglu_quant_reference(h: torch.Tensor, rows: torch.Tensor, swiglu_limit: Optional[float] = None,
                           out: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM2's input from GEMM1's output rows: for each ``r`` of ``rows`` in ``[0, R)``, ``(q[r], s[r]) =
    quantize_groups(swiglu(h[r], swiglu_limit))`` (float32 SwiGLU, 1 x 128 e4m3); other indices are skipped and rows
    no index names are left as they are. ``h [R, 2I]``; returns ``(q [R, I] float8_e4m3fn, s [R, I/128] float32)``,
    ``out`` when given."""
    R, I = h.shape[0], h.shape[1] // 2
    q, s = out if out is not None else _rows_fp8((R,), I, h.device)
    r = rows.long()
    r = r[(r >= 0) & (r < R)]  # a boolean index: a host synchronisation, acceptable in the reference
    if r.numel():
        q[r], s[r] = quantize_groups_reference(swiglu(h[r], swiglu_limit))
    return q, s


def grouped_gemm_swiglu_contiguous_reference(a, a_scale, w13, w13_scale, grouped_layout, swiglu_limit=None,
                                             out=None):
    """GEMM1 of the contiguous layout with the SwiGLU and GEMM2's quantisation after it: the plain GEMM's bf16
    rows (:func:`.reference.grouped_gemm_contiguous_reference`, NaN rows included) through
    :func:`swiglu_quant_reference` for every row whose id is not ``-1``. Returns ``(q [M, I], s [M, I/128])``."""
    h = grouped_gemm_contiguous_reference(a, a_scale, w13, w13_scale, grouped_layout)
    return swiglu_quant_reference(h, torch.nonzero(grouped_layout >= 0).flatten(), swiglu_limit, out)


def grouped_gemm_swiglu_masked_reference(a, a_scale, w13, w13_scale, masked_m, swiglu_limit=None, out=None):
    """GEMM1 of the masked layout with the SwiGLU and GEMM2's quantisation after it: the plain GEMM's bf16 rows
    (:func:`.reference.grouped_gemm_masked_reference`) through :func:`swiglu_quant_reference` for ``m < masked_m[e]``
    (clamped to ``[0, max_m]``). Returns ``(q [E, max_m, I], s [E, max_m, I/128])``."""
    E, MM = a.shape[0], a.shape[1]
    I = w13.shape[1] // 2
    h = grouped_gemm_masked_reference(a, a_scale, w13, w13_scale, masked_m)
    out = out if out is not None else _rows_fp8((E, MM), I, a.device)
    m = torch.arange(MM, device=a.device)
    named = torch.nonzero((m < masked_m.clamp(0, MM).unsqueeze(1)).flatten()).flatten()
    swiglu_quant_reference(h.view(E * MM, h.shape[-1]), named, swiglu_limit,
                           (out[0].view(E * MM, I), out[1].view(E * MM, I // 128)))
    return out


def _scatter_rows(q: torch.Tensor, s: torch.Tensor, index: torch.Tensor, rows: int):
    """FP8 rows ``q`` and their scales ``s`` at ``index`` of new ``[rows, ...]`` buffers (an index equal to
    ``rows``, a dropped choice, writes a spare row past them; no other row is initialised)."""
    a = torch.empty(rows + 1, q.shape[1], dtype=q.dtype, device=q.device)
    sa = torch.empty(rows + 1, s.shape[1], dtype=s.dtype, device=s.device)
    a[index], sa[index] = q, s
    return a[:rows], sa[:rows]


def _rows_fp8(lead: tuple, I: int, device):
    """Uninitialised GEMM2 input buffers ``(q [*lead, I] e4m3, s [*lead, I/128] float32)``: only the chosen rows
    are written, the GEMMs write no other row of their output."""
    return (torch.empty(*lead, I, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(*lead, I // 128, dtype=torch.float32, device=device))


def _swiglu_quant_rows(h, rows, limit, path, ops):
    """GEMM2's input from GEMM1's output rows ``h [R, 2I]`` for the chosen ``rows`` (``R``: a dropped choice, no
    row): one ``swiglu_quant`` launch (``path`` "pass"), or torch ops on the chosen rows ("torch": a dropped choice
    computes some row, written to the spare)."""
    R, I = h.shape[0], h.shape[1] // 2
    if path == "pass":
        return ops.swiglu_quant(h, rows, limit, _rows_fp8((R,), I, h.device))
    return _scatter_rows(*quantize_groups_reference(swiglu(h[rows.clamp(max=R - 1)], limit)), rows, R)


def fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, *, w13_scale, w2_scale,
                            swiglu_limit=None, expert_map=None, apply_router_weight_on_input=False):
    """The module docstring's formula, per expert, in float32 (``[T, H]`` bf16)."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    ids = local_expert_ids(topk_ids, E, expert_map)
    wts = topk_weights.float()
    x = hidden.float()
    if apply_router_weight_on_input:
        x, wts = x * wts[:, :1], torch.ones_like(wts)
    acc = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids[ids < E]).tolist():
        t, j = torch.where(ids == e)
        a = dequantize_groups(*quantize_groups_reference(x[t]))
        h = (a @ dequantize_weights(w13[e], w13_scale[e]).T).to(torch.bfloat16)
        act = dequantize_groups(*quantize_groups_reference(swiglu(h, swiglu_limit)))
        y = (act @ dequantize_weights(w2[e], w2_scale[e]).T).to(torch.bfloat16)
        acc.index_add_(0, t, y.float() * wts[t, j].unsqueeze(1))
    return acc.to(torch.bfloat16)


def quantize_scatter_reference(x: torch.Tensor, dest: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a [rows, H] e4m3, sa [rows, H/128] float32)``: token ``t``'s row :func:`.reference.quantize_groups_reference`
    of ``x [T, H]``, quantised once, at each row ``dest[t, j]`` in ``[0, rows)``; other destinations (dropped
    choices) are skipped. Rows no destination names are left uninitialised: a GEMM output row depends on its own A
    row only, and the GEMMs write none of theirs."""
    T, k = dest.shape
    q, s = quantize_groups_reference(x)
    token = torch.arange(T * k, device=x.device) // k
    d = dest.reshape(-1).long()
    return _scatter_rows(q[token], s[token], torch.where((d >= 0) & (d < rows), d, rows), rows)


def combine_reference(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = bf16(sum_j weights[t, j] * y[rows[t, j]])``: float32, in choice order; a row outside ``[0, R)``
    (a dropped choice) adds nothing. Only the rows the choices name are read: the GEMMs leave padding rows
    unwritten, whatever they hold (NaN included) never reaches ``out``."""
    T, k = weights.shape
    R = y.shape[0]
    if out is None:
        out = torch.empty(T, y.shape[1], dtype=torch.bfloat16, device=y.device)
    if R == 0:
        return out.zero_()
    rows = rows.long()
    valid = ((rows >= 0) & (rows < R)).unsqueeze(-1)
    gathered = y[rows.clamp(0, R - 1).reshape(-1)].view(T, k, y.shape[1]).float()
    out.copy_((torch.where(valid, gathered, 0.0) * weights.float().unsqueeze(-1)).sum(1))
    return out


def fused_experts_contiguous(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, swiglu_limit,
                             expert_map, gemm, out, path="torch", ops=None):
    """The contiguous layout: rows grouped by expert (:func:`.reference.align_routing`), two grouped GEMMs. Each
    token is quantised once and its FP8 row scattered into its choices' rows. The layout is sized for the worst
    routing, so most of its rows can be padding: the torch work before and between the GEMMs touches the ``T x k``
    chosen rows only (gathered and scattered by each choice's row); padding rows stay uninitialised, and the
    GEMMs write none of them."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    dev = hidden.device
    row_src, layout = align_routing(topk_ids, E, expert_map)
    M = layout.numel()
    src = row_src.long()
    # each choice's row (M: a dropped choice, whose spare row is never read back)
    row_of_choice = torch.full((T * k + 1,), M, dtype=torch.long, device=dev)
    row_of_choice[torch.where(src >= 0, src, T * k)] = torch.arange(M, device=dev)
    rows = row_of_choice[:T * k]
    a, sa = ops.quantize_scatter(hidden, rows.view(T, k), M)
    if path == "fused":
        a2, sa2 = ops.gemm_swiglu(a, sa, w13, w13_scale, layout, swiglu_limit, _rows_fp8((M,), w13.shape[1] // 2, dev))
    else:
        h = gemm(a, sa, w13, w13_scale, layout, torch.empty(M, w13.shape[1], dtype=torch.bfloat16, device=dev))
        a2, sa2 = _swiglu_quant_rows(h, rows, swiglu_limit, path, ops)
    y = gemm(a2, sa2, w2, w2_scale, layout, torch.empty(M, w2.shape[1], dtype=torch.bfloat16, device=dev))
    return ops.combine(y, rows.view(T, k), topk_weights, out)


def merge_repeated_choices(ids: torch.Tensor, weights: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, weights)`` of a routing where no token names an expert twice: a choice that repeats an earlier
    choice of its token is dropped (its id becomes ``E``) and its weight added to the first one's (float32), so
    the token still gets the sum of both choices. ``ids [T, k]`` local (``E``: none), ``weights [T, k]``. The
    masked layout gives each expert ``T`` rows, one a token; a second row for one token would run into the next
    expert's rows. Torch ops on the device, no host read."""
    k = ids.shape[1]
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [T, j, i]: choices j and i name one expert
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)  # i < j
    repeat = (same & earlier).any(-1) & (ids < E)
    merged = (same * weights.float().unsqueeze(1)).sum(-1)
    return torch.where(repeat, E, ids), torch.where(repeat, 0.0, merged)


def route_masked_reference(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                           expert_map: Optional[torch.Tensor] = None) -> tuple:
    """The masked layout's routing: ``(slot [T, k], weights [T, k] float32, counts [E] int32)``. A token's
    repeated choices of one expert are merged first (:func:`merge_repeated_choices`); choice ``(t, j)`` of expert
    ``e`` goes to row ``e * T + r`` of the ``[E * T]`` rows, ``r`` its earlier choices of ``e`` in flat order;
    a choice with no local expert (or merged away) to the spare row ``E * T``. Torch ops, no host read."""
    T, k = topk_ids.shape
    E = num_experts
    ids, weights = merge_repeated_choices(local_expert_ids(topk_ids, E, expert_map), topk_weights, E)
    ids = ids.reshape(-1)
    keep = ids < E
    e = ids.clamp(max=E - 1)
    # the choices of each expert, one-hot (a scatter: F.one_hot checks the ids' range on the host)
    onehot = torch.zeros(T * k, E + 1, dtype=torch.long, device=ids.device).scatter_(
        1, torch.where(keep, ids, E).unsqueeze(1), 1)[:, :E]
    rank = (torch.cumsum(onehot, 0) - onehot).gather(1, e.unsqueeze(1)).squeeze(1)  # earlier choices of e
    counts = onehot.sum(0).to(torch.int32)
    slot = torch.where(keep, e * T + rank, E * T)  # E * T: a spare row for dropped choices
    return slot.view(T, k), weights, counts


def fused_experts_masked(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, swiglu_limit, expert_map,
                         gemm, out, path="torch", ops=None):
    """The masked layout: each expert's rows at ``[e, 0 .. count)`` of ``[E, T, K]`` buffers (a token's repeated
    choices of one expert merged first, :func:`merge_repeated_choices`, so ``T`` rows always suffice), two masked
    grouped GEMMs. Fixed shapes, no host sync. The
    torch work between the GEMMs touches the ``T x k`` chosen rows only (gathered from and scattered into the
    buffers by each choice's slot); the buffers' other rows are never initialised, and the GEMMs read and write
    no row at or past an expert's count."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    dev = hidden.device
    slot, topk_weights, counts = ops.route_masked(topk_ids, topk_weights, E, expert_map)
    a, sa = (t.view(E, T, -1) for t in ops.quantize_scatter(hidden, slot, E * T))
    if path == "fused":
        a2, sa2 = ops.gemm_swiglu_masked(a, sa, w13, w13_scale, counts, swiglu_limit,
                                         _rows_fp8((E, T), w13.shape[1] // 2, dev))
    else:
        h = gemm(a, sa, w13, w13_scale, counts, torch.empty(E, T, w13.shape[1], dtype=torch.bfloat16, device=dev))
        a2, sa2 = (t.view(E, T, -1) for t in _swiglu_quant_rows(h.view(E * T, -1), slot.reshape(-1), swiglu_limit,
                                                                   path, ops))
    y = gemm(a2, sa2, w2, w2_scale, counts, torch.empty(E, T, w2.shape[1], dtype=torch.bfloat16, device=dev))
    return ops.combine(y.view(E * T, -1), slot, topk_weights, out)
