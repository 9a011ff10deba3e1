"""Drop-in replacements for FlashMLA's sparse entry points, so either engine's DeepSeek-V4 backend can swap one
call: :func:`flash_mla_with_kvcache` (sparse decode over FP8 "MODEL1" caches, FlashMLA's signature) and
:func:`flash_mla_sparse_fwd` (sparse prefill over a bf16 KV workspace). Both run :func:`.sparse_mqa`'s math.

FlashMLA's conventions, kept here: the sink scales the output by ``exp(lse) / (exp(lse) + exp(sink))`` and leaves
the returned LSE alone; a query with no valid entry gets a zero output and ``lse = +inf`` (``max_logits =
-inf``); an index is invalid if negative, past its length, or at or past the cache's slot count (the workspace's
row count for the prefill). What FlashMLA would refuse (dense mode, ``causal``, a non-FP8 cache, ``head_dim_v``
other than 512, ``num_splits``) is refused with a message naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ....platform import stream_capturing
from ..._common import check, check_same_device, resolve_impl
from .. import layout as L
from .schedule import SparseMQAPlan


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Stands in for FlashMLA's scheduler metadata, with FlashMLA's contract: the first
    :func:`flash_mla_with_kvcache` call that receives it records the call's shapes (``config``) and, where the
    scheduled program runs, makes its work plan (``tile_scheduler_metadata``: a
    :class:`~.schedule.SparseMQAPlan`); later calls with it must have the same shapes (refused otherwise) and
    the same length values (the caller's promise, as with FlashMLA: nothing is read back to check it), and reuse
    the plan. Make one per batch (and kind of layer) with :func:`get_mla_metadata`."""

    have_initialized: bool = False
    config: Optional[object] = None
    tile_scheduler_metadata: Optional[object] = None
    num_splits: Optional[torch.Tensor] = None
    # per-request lengths expanded to one per query token (s_q > 1), by (data pointer, size) of the request lengths:
    # the layers of a batch pass the same lengths, so the expansion runs once per batch
    per_token: dict = dataclasses.field(default_factory=dict, repr=False)
    # the signature (shapes, dtypes, devices) of the arguments a call with this metadata passed the full checks with:
    # the batch's later layers with the same signature skip them (their caches are still checked)
    checked: Optional[tuple] = dataclasses.field(default=None, repr=False)
    # what the calls of that signature launch on the scheduled program, fixed for the batch (see _planned_launch):
    # (has extra set, has sink, the sinks stand-in without one, the empty extra list without one); None until a
    # checked call has run the scheduled program with this metadata
    planned: Optional[tuple] = dataclasses.field(default=None, repr=False)
    # the planned launches recorded in C++ for the batch's later calls (_prepare_fast), where the compiled launch
    # is on: (the calls' non-tensor arguments, the recorded launches, the settings' generation, what they keep)
    fast: Optional[tuple] = dataclasses.field(default=None, repr=False)


def get_mla_metadata(*args, **kwargs):
    """``(FlashMLASchedMeta(), None)``, as FlashMLA's returns (its arguments are ignored, as there)."""
    return FlashMLASchedMeta(), None


def _per_token(lengths: Optional[torch.Tensor], b: int, s_q: int, name: str, op: str,
               meta: Optional[FlashMLASchedMeta] = None) -> Optional[torch.Tensor]:
    """FlashMLA's per-request ``(batch,)`` lengths as one per query token (``batch * s_q``); with ``meta``, an
    expansion made by an earlier call of the batch is reused (FlashMLA's contract: the lengths' values do not
    change across the calls that share ``meta``)."""
    if lengths is None:
        return None
    if meta is not None:
        key = (name, lengths.data_ptr(), lengths.numel(), s_q)
        hit = meta.per_token.get(key)
        if hit is None:
            hit = meta.per_token[key] = _per_token(lengths, b, s_q, name, op)
        return hit
    check(isinstance(lengths, torch.Tensor) and lengths.dim() == 1 and lengths.numel() == b
          and not lengths.is_floating_point(), lambda: f"{op}: {name} must be an int tensor of shape ({b},)")
    if lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32)
    return lengths if s_q == 1 else lengths.repeat_interleave(s_q)  # decode: the lengths as they are


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor] = None,
                           cache_seqlens: Optional[torch.Tensor] = None, head_dim_v: int = 512,
                           tile_scheduler_metadata=None, num_splits=None, softmax_scale: Optional[float] = None,
                           causal: bool = False, is_fp8_kvcache: bool = True, indices: Optional[torch.Tensor] = None,
                           attn_sink: Optional[torch.Tensor] = None, extra_k_cache: Optional[torch.Tensor] = None,
                           extra_indices_in_kvcache: Optional[torch.Tensor] = None,
                           topk_length: Optional[torch.Tensor] = None, extra_topk_length: Optional[torch.Tensor] = None,
                           out: Optional[torch.Tensor] = None, impl: str = "auto"):
    """FlashMLA's sparse decode: ``q [B, s_q, H, 512]`` over ``k_cache [pages, R, 1, 584]`` (uint8 or its
    float8_e4m3fn view, FP8 MODEL1 rows) at ``indices [B, s_q, K1]`` (physical slots ``page * R + row``), plus
    ``extra_k_cache`` at ``extra_indices_in_kvcache [B, s_q, K2]``; ``topk_length`` / ``extra_topk_length``
    ``(B,)``: the leftmost entries of every query of request ``b`` that count. Returns ``(out [B, s_q, H, 512],
    lse [B, H, s_q])`` (``out`` written in place if given). ``block_table`` / ``cache_seqlens`` are ignored
    (sparse mode reads neither), as FlashMLA does."""
    meta = tile_scheduler_metadata
    recorded = meta.fast if isinstance(meta, FlashMLASchedMeta) else None
    if recorded is not None:  # a later call of a batch whose launches are recorded: straight to them, if it matches
        done = _run_fast(recorded, q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                         extra_topk_length, out, _flags(head_dim_v, num_splits, softmax_scale, causal, is_fp8_kvcache,
                                                        impl, topk_length, attn_sink, extra_k_cache,
                                                        extra_indices_in_kvcache, extra_topk_length, out))
        if done is not None:
            return done
    from . import check_sparse_mqa_args

    op = "flash_mla_with_kvcache"
    sig = _signature(q, indices, extra_indices_in_kvcache, topk_length, extra_topk_length, attn_sink, softmax_scale,
                     out, causal, is_fp8_kvcache, head_dim_v, num_splits, impl, extra_k_cache is None)
    # a later layer of a batch whose arguments match the checked signature (shapes, dtypes, devices, flags) skips
    # the argument checks; its caches are checked still (once per geometry: layout._as_pages)
    fast = isinstance(meta, FlashMLASchedMeta) and meta.checked == sig
    # ... and where that signature's launches are recorded (see _planned_launch), goes straight to them
    planned = fast and meta.planned is not None and _launcher().sparse_mqa_program() == "scheduled"
    if not fast:
        _check_entry(op, q, indices, extra_indices_in_kvcache, extra_topk_length, out, causal, is_fp8_kvcache,
                     head_dim_v, num_splits, meta)
    b, s_q, h, _ = q.shape
    # FlashMLA takes the cache as uint8 or as its float8_e4m3fn view (SGLang's pool hands out the latter)
    given_caches = (k_cache, extra_k_cache)
    k_cache, extra_k_cache = (c.view(torch.uint8) if isinstance(c, torch.Tensor) and c.dtype == torch.float8_e4m3fn
                              else c for c in (k_cache, extra_k_cache))
    T = b * s_q
    qt = q.reshape(T, h, L.D)
    it = indices.reshape(T, indices.shape[2])
    xt = None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.reshape(
        T, extra_indices_in_kvcache.shape[2])
    lengths = _per_token(topk_length, b, s_q, "topk_length", op, meta)
    xlengths = _per_token(extra_topk_length, b, s_q, "extra_topk_length", op, meta)
    scale = L.D ** -0.5 if softmax_scale is None else softmax_scale
    ot = None if out is None else out.view(T, h, L.D)
    if planned:
        res, lse = _planned_launch(meta, qt, k_cache, it, lengths, extra_k_cache, xt, xlengths, attn_sink, scale, ot,
                                   op)
        if meta.fast is None:
            flags = _flags(head_dim_v, num_splits, softmax_scale, causal, is_fp8_kvcache, impl, topk_length,
                           attn_sink, extra_k_cache, extra_indices_in_kvcache, extra_topk_length, out)
            _prepare_fast(meta, op, flags, q, given_caches, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                          extra_indices_in_kvcache, extra_topk_length, out, qt, it, xt, lengths, xlengths, scale, ot)
        return res.view(b, s_q, h, L.D), lse.view(b, s_q, h).transpose(1, 2)
    if fast:
        L.check_kv_cache(k_cache, op=op)
        if extra_k_cache is not None:
            L.check_kv_cache(extra_k_cache, "extra_cache", op=op)
    else:
        check_sparse_mqa_args(qt, k_cache, it, lengths, extra_cache=extra_k_cache, extra_indices=xt,
                              extra_lengths=xlengths, sink=attn_sink, sm_scale=scale, out=ot)
        if meta is not None:  # a new signature: what the last one's calls launched is made again for this one
            meta.checked, meta.planned, meta.fast = sig, None, None
    if resolve_impl(impl, q.device, op) == "reference" or T == 0:
        from .reference import sparse_mqa_reference

        res, lse = sparse_mqa_reference(qt, k_cache, it, lengths, extra_cache=extra_k_cache, extra_indices=xt,
                                        extra_lengths=xlengths, sink=attn_sink, sm_scale=float(scale), out=ot,
                                        return_lse=True)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # FlashMLA's LSE of a query with no valid entry
    else:
        ti = _launcher()
        plan = None
        if ti.sparse_mqa_program() == "scheduled":
            plan = _sched_plan(meta, op, (b, s_q, h, it.shape[1], 0 if xt is None else xt.shape[1]),
                               lambda: ti.sparse_mqa_plan(qt, it, lengths, xt, xlengths))
        res, lse = ti.sparse_mqa_tilelang(qt, k_cache, it, lengths, extra_cache=extra_k_cache, extra_indices=xt,
                                          extra_lengths=xlengths, sink=attn_sink, sm_scale=float(scale), out=ot,
                                          return_lse=True, plan=plan, empty_lse_inf=True)
        # recorded outside graph capture only: the sinks stand-in is filled by a launch, which a capture would
        # only record (its values would exist once the graph replays)
        if plan is not None and meta is not None and meta.checked == sig and not stream_capturing(q.device):
            has_extra = xt is not None and xt.shape[1] > 0
            meta.planned = (has_extra, attn_sink is not None,
                            torch.zeros(h, dtype=torch.float32, device=q.device) if attn_sink is None else None,
                            None if has_extra else torch.empty(T, 0, dtype=torch.int32, device=q.device))
    return res.view(b, s_q, h, L.D), lse.view(b, s_q, h).transpose(1, 2)


_LAUNCHER = None


def _launcher():
    """:mod:`.tilelang_impl`, imported on first use (it brings TileLang; the reference path needs none)."""
    global _LAUNCHER
    if _LAUNCHER is None:
        from . import tilelang_impl

        _LAUNCHER = tilelang_impl
    return _LAUNCHER


def _planned_launch(meta: FlashMLASchedMeta, qt, k_cache, it, lengths, extra_k_cache, xt, xlengths, attn_sink,
                    scale, ot, op):
    """A later call of a batch on the scheduled program (arguments as the entry has shaped them): its signature
    passed every check with ``meta`` and its plan is ``meta``'s, so it goes straight to the launches. The caches are
    still checked, each geometry once: their word views are made (and checked) once per cache buffer and geometry,
    and a view that matches none is checked before its views are made (``tilelang_impl._cache_word_views``)."""
    has_extra, has_sink, no_sinks, no_extra = meta.planned
    return _launcher().scheduled_launch(
        qt.contiguous(), k_cache, it.contiguous(), lengths, extra_k_cache, xt.contiguous() if has_extra else no_extra,
        xlengths if has_extra else None, has_extra, attn_sink.contiguous() if has_sink else no_sinks, has_sink,
        float(scale), ot, meta.tile_scheduler_metadata, True, op)


def _flags(*args) -> tuple:
    """What a recorded call's non-tensor arguments were (the first six) and which optional tensors it passed."""
    return args[:6] + tuple(a is None for a in args[6:])


def _prepare_fast(meta: FlashMLASchedMeta, op, flags, q, given_caches, k_cache, indices, topk_length, attn_sink,
                  extra_k_cache, extra_indices, extra_topk_length, out, qt, it, xt, lengths, xlengths, scale,
                  ot) -> None:
    """After a planned call (:func:`_planned_launch`) with the compiled launch on: its launches recorded in C++
    (``tilelang_impl.prepare_scheduled``) for the batch's later calls, with the caller's tensors as they come
    (``given_caches``: the caches as passed, uint8 or float8 views of the uint8 ``k_cache`` and
    ``extra_k_cache``). Nothing is recorded where a launch tensor is a copy of the caller's (a non-contiguous
    argument, lengths of another dtype, per-token lengths expanded for s_q > 1): those calls stay on the planned
    path."""
    ti = _launcher()
    has_extra, has_sink, no_sinks, no_extra = meta.planned
    plan = meta.tile_scheduler_metadata
    qc, ic = qt.contiguous(), it.contiguous()
    xc = xt.contiguous() if has_extra else no_extra
    sinks = attn_sink.contiguous() if has_sink else no_sinks
    slots = [(q, qc), (given_caches[0], k_cache), (indices, ic)]
    if topk_length is not None:
        slots.append((topk_length, lengths))
    if attn_sink is not None:
        slots.append((attn_sink, sinks))
    if extra_k_cache is not None:
        slots.append((given_caches[1], extra_k_cache))
    if extra_indices is not None:
        slots.append((extra_indices, *([xc] if has_extra else [])))
    if extra_topk_length is not None:
        slots.append((extra_topk_length, *([xlengths] if has_extra else [])))
    if out is not None:
        slots.append((out, ot))
    l1 = ti._lengths(lengths, qc.shape[0], ic.shape[1], q.device) if lengths is not None else None
    l2 = ti._lengths(xlengths, qc.shape[0], xc.shape[1], q.device) if has_extra and xlengths is not None else None
    if (l1 is not None and l1 is not lengths) or (l2 is not None and l2 is not xlengths):
        return  # the launch takes a converted copy of the caller's lengths
    l1 = l1 if l1 is not None else ti._plan_lengths(plan, ic.shape[1], q.device)
    l2 = l2 if l2 is not None else ti._plan_lengths(plan, xc.shape[1], q.device)
    fixed = (plan.part_meta, plan.tiles, plan.first_part, plan.split_row, plan.combine, plan.num_split,
             *(t for t in (no_sinks, no_extra) if t is not None),
             *(t for t, given in ((l1, lengths), (l2, xlengths if has_extra else None)) if given is None))
    made = ti.prepare_scheduled(slots, qc, k_cache, ic, l1, extra_k_cache, xc, l2, has_extra, sinks, has_sink,
                                float(scale), ot, plan, True, op, fixed)
    if made is not None:
        b, s_q, h, _ = q.shape
        meta.fast = (flags, made[0], ti._GENERATION[0], made[1], (b, s_q, h))


def _run_fast(fast, q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
              out, flags):
    """A call through the batch's recorded launches (:func:`_prepare_fast`), or None where it differs from the
    recorded one (its non-tensor arguments, which optional tensors it passes, any tensor's shape, strides, dtype,
    device or alignment) or a setting changed since: the caller then takes the checked path."""
    recorded_flags, prepared, generation, _, (b, s_q, h) = fast
    ti = _launcher()
    if flags != recorded_flags or generation != ti._GENERATION[0] or not ti.compiled_launch_on():
        return None
    tensors = [t for t in (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                           extra_topk_length, out) if t is not None]
    made = prepared.run(tensors)
    if made is None:
        return None
    res = out if out is not None else made[3].view(b, s_q, h, L.D)
    return res, made[0].view(b, s_q, h).transpose(1, 2)


def _check_entry(op, q, indices, extra_indices, extra_topk_length, out, causal, is_fp8_kvcache, head_dim_v,
                 num_splits, meta) -> None:
    """What FlashMLA's entry refuses, named, before :func:`..check_sparse_mqa_args` checks the rest."""
    check(indices is not None, f"{op}: only sparse attention is supported (pass indices); dense mode is not")
    check(not causal, f"{op}: causal must be False for sparse attention")
    check(is_fp8_kvcache, f"{op}: is_fp8_kvcache must be True: sparse attention reads FP8 MODEL1 caches")
    check(head_dim_v == L.D, lambda: f"{op}: head_dim_v must be {L.D}, got {head_dim_v}")
    check(num_splits is None, f"{op}: num_splits must be None (the split is planned per launch)")
    check(isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[3] == L.D,
          lambda: f"{op}: q must be [batch, s_q, num_heads, {L.D}], got {tuple(getattr(q, 'shape', ()))}")
    b, s_q = q.shape[0], q.shape[1]
    for name, idx in (("indices", indices), ("extra_indices_in_kvcache", extra_indices)):
        if idx is not None:
            check(isinstance(idx, torch.Tensor) and idx.dim() == 3 and tuple(idx.shape[:2]) == (b, s_q),
                  lambda: f"{op}: {name} must be [{b}, {s_q}, topk], got {tuple(getattr(idx, 'shape', ()))}")
    check(extra_topk_length is None or extra_indices is not None,
          f"{op}: extra_topk_length without extra_indices_in_kvcache")
    if out is not None:
        check(isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape) and out.is_contiguous(),
              lambda: f"{op}: out must be a contiguous {tuple(q.shape)} tensor")
    check(meta is None or isinstance(meta, FlashMLASchedMeta),
          lambda: f"{op}: tile_scheduler_metadata must come from get_mla_metadata (or be None), got "
                  f"{type(meta).__name__}")


def _signature(*args) -> tuple:
    """What the full argument check of a call depends on, besides its caches: each tensor's shape, strides, dtype
    and device (None stays None), the scale as given."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig += (a.shape, a.stride(), a.dtype, a.get_device())
        else:
            sig += (type(a), a)
    return tuple(sig)


def _sched_plan(meta: Optional[FlashMLASchedMeta], op: str, config: tuple, make):
    """The plan ``meta`` holds for calls of ``config`` (batch, s_q, heads, topk, extra topk), made by ``make`` on
    the first call (each call makes its own when ``meta`` is None)."""
    if meta is None:
        return make()
    if not meta.have_initialized or not isinstance(meta.tile_scheduler_metadata, SparseMQAPlan):
        meta.have_initialized, meta.config, meta.tile_scheduler_metadata = True, config, make()
    check(meta.config == config,
          lambda: f"{op}: tile_scheduler_metadata was made for (batch, s_q, heads, topk, extra_topk) = "
                  f"{meta.config}, this call has {config}; make one per batch with get_mla_metadata")
    return meta.tile_scheduler_metadata


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                         impl: str = "auto"):
    """FlashMLA's sparse prefill: ``q [S, H, 512]`` bf16 over the bf16 workspace ``kv [S_kv, 1, 512]`` at
    ``indices [S, 1, K]`` (rows of ``kv``; negative, past ``topk_length [S]`` or ``>= S_kv``: invalid). Returns
    ``(out [S, H, 512] bf16, max_logits [S, H], lse [S, H])``, float32, natural log, ``max_logits`` the largest
    scaled score (``-inf`` and ``lse = +inf`` for a query with no valid entry). ``impl``: ``auto`` (on a GPU the
    paired_ws program, or portable_ws where the target has no Hopper programs: :func:`.tilelang_impl.
    sparse_prefill_bf16`; the reference on a CPU), ``tilelang`` or ``reference``."""
    from .reference import valid_entries

    op = "flash_mla_sparse_fwd"
    check(d_v == L.D, lambda: f"{op}: d_v must be {L.D}, got {d_v}")
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] == L.D and q.dtype == torch.bfloat16,
          lambda: f"{op}: q must be a bfloat16 [s_q, num_heads, {L.D}] tensor")
    check(isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] == L.D
          and kv.dtype == torch.bfloat16, lambda: f"{op}: kv must be a bfloat16 [s_kv, 1, {L.D}] tensor")
    check(isinstance(indices, torch.Tensor) and indices.dim() == 3 and indices.shape[0] == q.shape[0]
          and indices.shape[1] == 1 and indices.dtype == torch.int32,
          lambda: f"{op}: indices must be an int32 [{q.shape[0]}, 1, topk] tensor")
    check(sm_scale > 0, lambda: f"{op}: sm_scale must be positive, got {sm_scale}")
    check(attn_sink is None or (isinstance(attn_sink, torch.Tensor) and attn_sink.shape == (q.shape[1],)),
          lambda: f"{op}: attn_sink must be [{q.shape[1]}] float32")
    check(topk_length is None or (isinstance(topk_length, torch.Tensor) and topk_length.shape == (q.shape[0],)),
          lambda: f"{op}: topk_length must be [{q.shape[0]}] int32")
    check_same_device(op, q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
    if resolve_impl(impl, q.device, op) == "tilelang":
        from .tilelang_impl import sparse_prefill_bf16

        return sparse_prefill_bf16(q, kv.reshape(kv.shape[0], L.D), indices[:, 0], topk_length, attn_sink, sm_scale)
    S, H, _ = q.shape
    out = torch.empty_like(q)
    max_logits = torch.empty(S, H, dtype=torch.float32, device=q.device)
    lse = torch.empty(S, H, dtype=torch.float32, device=q.device)
    for t0 in range(0, S, 256):  # 256 queries at a time: the gathered rows stay small
        t1 = min(S, t0 + 256)
        idx = indices[t0:t1, 0]
        ok = valid_entries(idx, None if topk_length is None else topk_length[t0:t1], kv.shape[0])
        rows = kv[:, 0][torch.where(ok, idx, 0).long()].float()  # [t, K, 512]
        rows = rows.masked_fill(~ok[..., None], 0.0)
        s = torch.einsum("shd,skd->shk", q[t0:t1].float(), rows) * sm_scale
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        lse_t = torch.logsumexp(s, dim=-1)
        tot = lse_t if attn_sink is None else torch.logaddexp(lse_t, attn_sink.float()[None, :])
        p = torch.exp(s - tot.masked_fill(torch.isneginf(tot), float("inf"))[..., None])
        out[t0:t1] = torch.einsum("shk,skd->shd", p, rows).to(torch.bfloat16)
        max_logits[t0:t1] = s.amax(dim=-1)
        lse[t0:t1] = lse_t.masked_fill(torch.isneginf(lse_t), float("inf"))
    return out, max_logits, lse
