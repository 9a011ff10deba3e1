"""Sparse MQA of DeepSeek-V4 (:func:`sparse_mqa`): its argument checks, shared with FlashMLA's interface
(:mod:`.flash_mla`), and the scheduled program's per-batch plan (:func:`sparse_mqa_plan`, :mod:`.schedule`)."""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check, check_same_device, resolve_impl
from .. import layout
from ..layout import D
from .reference import sparse_mqa_reference
from .schedule import SparseMQAPlan

MAX_HEADS = 128


def _check_index_set(op: str, q, name: str, cache_name: str, cache, indices, lengths) -> None:
    layout.kv_pages(cache, cache_name, op=op)
    check(isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.dtype == torch.int32,
          lambda: f"{op}: {name} must be an int32 tensor [num_tokens, topk], got "
                  f"{getattr(indices, 'dtype', None)} {tuple(getattr(indices, 'shape', ()))}")
    check(indices.shape[0] == q.shape[0],
          lambda: f"{op}: {name} has {indices.shape[0]} rows for {q.shape[0]} query tokens")
    if lengths is not None:
        check(isinstance(lengths, torch.Tensor) and lengths.dim() == 1 and lengths.numel() == q.shape[0]
              and not lengths.is_floating_point() and lengths.dtype != torch.bool,
              lambda: f"{op}: the lengths of {name} must be a 1-D integer tensor of {q.shape[0]} entries")


def check_sparse_mqa_args(q, cache, indices, lengths=None, *, extra_cache=None, extra_indices=None,
                          extra_lengths=None, sink=None, sm_scale=None, out=None, plan=None) -> None:
    op = "sparse_mqa"
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] == D,
          lambda: f"{op}: q must be [num_tokens, num_heads, {D}], got {tuple(getattr(q, 'shape', ()))}")
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32),
          lambda: f"{op}: q dtype must be bfloat16 (float16/float32 accepted), got {q.dtype}")
    check(1 <= q.shape[1] <= MAX_HEADS, lambda: f"{op}: num_heads must be in [1, {MAX_HEADS}], got {q.shape[1]}")
    _check_index_set(op, q, "indices", "cache", cache, indices, lengths)
    check((extra_cache is None) == (extra_indices is None),
          f"{op}: extra_cache and extra_indices go together (both or neither)")
    check(extra_lengths is None or extra_indices is not None, f"{op}: extra_lengths without extra_indices")
    if extra_cache is not None:
        _check_index_set(op, q, "extra_indices", "extra_cache", extra_cache, extra_indices, extra_lengths)
    if sink is not None:
        check(isinstance(sink, torch.Tensor) and sink.dim() == 1 and sink.numel() == q.shape[1]
              and sink.dtype == torch.float32, lambda: f"{op}: sink must be a float32 tensor [{q.shape[1]}]")
    check(sm_scale is None or (isinstance(sm_scale, (int, float)) and sm_scale > 0),
          lambda: f"{op}: sm_scale must be a positive number, got {sm_scale!r}")
    if out is not None:
        check(isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype
              and out.is_contiguous(), lambda: f"{op}: out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    check_same_device(op, q=q, cache=cache, indices=indices, lengths=lengths, extra_cache=extra_cache,
                      extra_indices=extra_indices, extra_lengths=extra_lengths, sink=sink, out=out)
    if plan is not None:
        check(isinstance(plan, SparseMQAPlan), lambda: f"{op}: plan must come from sparse_mqa_plan, got "
                                                      f"{type(plan).__name__}")
        k2 = extra_indices.shape[1] if extra_indices is not None else 0
        plan.check_matches(op, q.shape[0], indices.shape[1], k2, q.device)


def sparse_mqa(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
               *, extra_cache: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
               extra_lengths: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
               sm_scale: Optional[float] = None, out: Optional[torch.Tensor] = None, return_lse: bool = False,
               plan: Optional[SparseMQAPlan] = None, impl: str = "auto"):
    """Sparse multi-query attention of DeepSeek-V4, decode and prefill alike.

    Query token ``t`` (``q [T, H, 512]``) attends to the rows of ``cache`` at ``indices[t, :K1]`` (physical slots
    ``page * rows + row``) and, where given, the rows of ``extra_cache`` at ``extra_indices[t, :K2]``: the
    window rows and the compressed rows of a V4 layer. Entry ``j`` counts only if ``j < lengths[t]`` (all entries
    when ``lengths`` is None), and the index is ``>= 0`` and below its cache's slot count; any other entry is
    skipped and its row never read. One softmax runs over the union of both sets and the per-head ``sink``:
    ``o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h})`` with ``s_j = sm_scale * q . k_j`` and ``k_j = v_j``
    the dequantised 512-d row (``sm_scale`` default ``512 ** -0.5``). Returns ``o [T, H, 512]`` in q's dtype
    (written into ``out`` if given) and, with ``return_lse``, ``lse [T, H]`` float32: the natural-log
    ``log(sum_j e^{s_j})``, sink excluded (FlashMLA's convention); a token with no valid entry gets ``o = 0``,
    ``lse = -inf``.

    ``plan``: the work plan of the scheduled program (``MUSA_ATTN_DSV4_PROGRAM=scheduled``), from
    :func:`sparse_mqa_plan` for this batch's shapes and lengths, so that layers of one kind share it (made per
    call when None; checked against the call's shapes, ignored by the other programs and the reference).
    """
    check_sparse_mqa_args(q, cache, indices, lengths, extra_cache=extra_cache, extra_indices=extra_indices,
                          extra_lengths=extra_lengths, sink=sink, sm_scale=sm_scale, out=out, plan=plan)
    which = resolve_impl(impl, q.device, "sparse_mqa")
    kwargs = dict(extra_cache=extra_cache, extra_indices=extra_indices, extra_lengths=extra_lengths, sink=sink,
                  sm_scale=D ** -0.5 if sm_scale is None else float(sm_scale), out=out, return_lse=return_lse)
    if which == "reference" or q.shape[0] == 0:
        return sparse_mqa_reference(q, cache, indices, lengths, **kwargs)
    from .tilelang_impl import sparse_mqa_tilelang

    return sparse_mqa_tilelang(q, cache, indices, lengths, plan=plan, **kwargs)


def sparse_mqa_plan(q: torch.Tensor, indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                    extra_indices: Optional[torch.Tensor] = None,
                    extra_lengths: Optional[torch.Tensor] = None) -> SparseMQAPlan:
    """The scheduled program's work plan (:mod:`.schedule`) for :func:`sparse_mqa` calls of these shapes and
    lengths (the tensors' values are read on the device; nothing synchronises): make it once per batch and pass it
    to every layer whose index lists have these lengths."""
    op = "sparse_mqa_plan"
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] == D,
          lambda: f"{op}: q must be [num_tokens, num_heads, {D}], got {tuple(getattr(q, 'shape', ()))}")
    for name, idx, lens in (("indices", indices, lengths), ("extra_indices", extra_indices, extra_lengths)):
        if idx is None:
            check(lens is None, lambda: f"{op}: {name} lengths without {name}")
            continue
        check(isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[0] == q.shape[0],
              lambda: f"{op}: {name} must be [{q.shape[0]}, topk]")
        check(lens is None or (isinstance(lens, torch.Tensor) and lens.dim() == 1 and lens.numel() == q.shape[0]),
              lambda: f"{op}: the lengths of {name} must be a 1-D tensor of {q.shape[0]} entries")
    from .tilelang_impl import sparse_mqa_plan as make

    return make(q, indices, lengths, extra_indices if extra_indices is not None and extra_indices.shape[1] else None,
                extra_lengths if extra_indices is not None and extra_indices.shape[1] else None)
