"""Launch the TileLang DeepSeek-V4 kernels: the flat byte views of the caches, the split count, the combine."""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ...._tilelang import compile_cached, launcher, tl, tl_dtype
from .... import _ffi_launch
from ....config import on_change, settings
from ....platform import features_of, get_platform, stream_capturing
from ..._common import check
from ...attention.combine_kernel import build_combine
from .. import _glue, layout as L
from .._glue import _flat_views, _no_race_check
from .mqa_kernel import build_sparse_mqa
from .rows import CLUSTER_STORE_HEADER, LOAD_HINT_HEADER

BLOCK_H = 64
BLOCK_N = 64
MAX_SPLITS = 64


# the scheduled program's word views of the caches an engine passes (each layer's, every call), by the identity of
# the tensor that owns the memory (a view's ``_base``: engines and FlashMLA's entry pass fresh views of persistent
# caches on every call) and then by the view's pointer, shape, strides and dtype. The views are made from an alias
# of the storage that holds no reference to that tensor, so when the engine drops it the weak reference's callback
# drops its views and the memory is freed; no view outlives its cache.
_WORD_VIEWS: dict = {}
_WORD_VIEWS_PER_TENSOR = 1024  # views of one buffer (an engine's layers slice one pool): the memo is cleared past it


def _storage_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s bytes, shape and strides that references its storage, not ``t`` (nor its base)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                t.stride())


def _cache_word_views(cache: torch.Tensor, device, op: str, name: str):
    """:func:`_flat_views` (``words``) of a checked KV cache view, made once per view geometry of a cache buffer."""
    root = cache if cache._base is None else cache._base
    sig = (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype)
    entry = _WORD_VIEWS.get(id(root))
    if entry is not None and entry[0]() is root:
        hit = entry[1].get(sig)
        if hit is not None:
            return hit
    made = _flat_views(L.kv_pages(_storage_alias(cache), name, op=op), device, op, name, words=True)
    if entry is None or entry[0]() is not root:
        try:
            ref = weakref.ref(root, lambda _, key=id(root): _WORD_VIEWS.pop(key, None))
        except TypeError:  # a tensor that cannot be weakly referenced: no memo
            return made
        entry = _WORD_VIEWS[id(root)] = (ref, {})
    if len(entry[1]) >= _WORD_VIEWS_PER_TENSOR:
        entry[1].clear()
    entry[1][sig] = made
    return made


PROGRAMS = ("scheduled", "paired", "paired_ws", "portable", "portable_ws", "staged_ws")
# the programs over a bf16 workspace of the call's selected rows (:mod:`.workspace`)
WORKSPACE_PROGRAMS = ("paired_ws", "portable_ws", "staged_ws")
# the programs that need warp specialisation, GEMMs reading A from registers and an FP8 conversion
HOPPER_PROGRAMS = ("scheduled", "paired", "paired_ws")


def _hopper_capable(target=None) -> bool:
    f = features_of(target)
    return bool(f["warp_specialized"] and f["gemm_a_in_registers"] and f["fp8"])


def sparse_mqa_program(target=None) -> str:
    """Which sparse MQA program ``target`` (None: this platform's) runs, as ``MUSA_ATTN_DSV4_PROGRAM`` says:
    ``auto`` is ``scheduled`` (:mod:`.sched_kernel`: a per-batch plan, FlashMLA's division of the work)
    where the target has warp specialisation, GEMMs that read A from registers and an FP8 conversion, else
    ``portable`` (:mod:`.mqa_kernel`); ``paired``, ``paired_ws``, ``portable_ws`` and ``staged_ws`` (the paired
    division, the portable program and the staged one over a bf16 workspace of the selected rows,
    :mod:`.paired_ws_kernel`, :mod:`.portable_ws_kernel`, :mod:`.staged_ws_kernel`) are selectable (how they
    compare: docs/dsv4.md). A named program the target cannot run is refused when it is built."""
    chosen = settings().dsv4_program
    if chosen != "auto":
        return chosen
    return "scheduled" if _hopper_capable(target) else "portable"


def portable_form(target=None) -> dict:
    """The portable program's tiles on ``target`` (None: this platform's): one K/V tile of ``BLOCK_N`` rows where a
    shared tile may be read in both majornesses (``platform.gemm_tile_two_majors``), else a K and a V tile of 32
    rows each (MUSA: two tiles of 64 rows would not fit beside the query tile)."""
    if features_of(target)["gemm_tile_two_majors"]:
        return {"block_N": BLOCK_N, "separate_v": False}
    return {"block_N": 32, "separate_v": True}


def sparse_mqa_block_n(target=None, program: Optional[str] = None) -> int:
    """The key tile of the sparse MQA program ``target`` runs (``program``: as :func:`sparse_mqa_kernel`)."""
    program = program or sparse_mqa_program(target)
    return BLOCK_N if program in HOPPER_PROGRAMS else portable_form(target)["block_N"]


def sparse_mqa_kernel(H: int, has_extra: bool, has_sink: bool, split: bool, q_dtype: str, target=None,
                      program: Optional[str] = None):
    """The compiled sparse MQA program (``program``: one of :data:`PROGRAMS`, default
    :func:`sparse_mqa_program`; ``split``: the portable program's split-KV form, writing float32 partials)."""
    program = program or sparse_mqa_program(target)
    _check_program(program, target)
    if program == "scheduled":
        return sched_kernel(H, has_extra, has_sink, q_dtype, target=target)
    if program == "paired":
        return paired_kernel(H, has_extra, has_sink, q_dtype, target=target)
    if program in WORKSPACE_PROGRAMS:  # one program with or without an extra set: the workspace holds both
        return _WS_KERNELS[program](H, has_sink, q_dtype, target=target)
    # the portable program: P through shared memory on every target (what MUSA needs)
    shared_p = True
    fp8_convert = _glue._fp8_convert(target)
    form = portable_form(target)
    key = ("dsv4_sparse_mqa", H, has_extra, has_sink, split, q_dtype, BLOCK_H, form["block_N"], shared_p,
           fp8_convert) + (("separate_v",) if form["separate_v"] else ())
    return compile_cached(key, lambda: build_sparse_mqa(H, has_extra, has_sink, split, q_dtype, BLOCK_H,
                                                        form["block_N"], 256, shared_p, fp8_convert,
                                                        form["separate_v"]), target=target)


def _check_program(program: str, target=None) -> None:
    check(program in PROGRAMS, lambda: f"sparse_mqa: program must be one of {PROGRAMS}, got {program!r} "
                                       f"(MUSA_ATTN_DSV4_PROGRAM or the program argument)")
    check(program not in HOPPER_PROGRAMS or _hopper_capable(target),
          lambda: f"sparse_mqa: the {program} program needs warp specialisation, GEMMs reading A from registers "
                  f"and an FP8 conversion, which this target lacks: {features_of(target)}")


def _ws_pass_configs() -> dict:
    """The warp-specialised programs sync their warp groups themselves (named barriers and mbarriers); TileLang's
    automatic syncs would put a whole-block barrier inside one warp group's code. Every read is in bounds by
    construction (index entries clamped into their rows and guarded by the length; cache rows read only for a
    valid slot; output rows guarded), so the per-access checks would only add instructions to the producer's
    loads. Rows a fragment holds in several threads are stored by each (the same value), and the score exchange's
    XOR-swizzled columns are a permutation: the race check is off."""
    return {tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
            tl.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True, **_no_race_check()}


def sched_kernel(H: int, has_extra: bool, has_sink: bool, q_dtype: str, target=None, cluster=None):
    """The compiled scheduled sparse MQA program (:mod:`.sched_kernel`); ``cluster``: its clustered form (None:
    :func:`_sched_cluster` for a call of many tokens)."""
    from .sched_kernel import build_sparse_mqa_sched

    _check_program("scheduled", target)
    check(q_dtype == "bfloat16", lambda: f"sparse_mqa: the scheduled program takes bfloat16 q, got {q_dtype}")
    pdl = _sched_pdl(target)
    cluster = _sched_cluster(H, target) if cluster is None else cluster
    hint = SCHED_LOAD_HINT and features_of(target)["load_hints"]
    prefetch = SCHED_PREFETCH and features_of(target)["load_hints"] and features_of(target)["bulk_copy"]
    key = ("dsv4_sparse_mqa_sched", H, has_extra, has_sink, q_dtype) + (("pdl", pdl) if pdl else ()) + \
        (("cluster",) if cluster else ()) + (("load_hint",) if hint else ()) + (("prefetch",) if prefetch else ())
    headers = ((CLUSTER_STORE_HEADER,) if cluster else ()) + ((LOAD_HINT_HEADER,) if hint or prefetch else ())
    return compile_cached(key, lambda: build_sparse_mqa_sched(H, has_extra, has_sink, q_dtype, pdl=pdl,
                                                              cluster=cluster, load_hint=hint, prefetch=prefetch),
                          target=target, pass_configs=_ws_pass_configs(), headers=headers)


def _sched_cluster(H: int, target, tokens=None) -> bool:
    """Whether the scheduled program runs the two head blocks of 65-128 heads as a cluster sharing the
    dequantisation (each producer makes half of every tile's rows, into both blocks' stage), where the target has
    clusters, while :data:`SCHED_CLUSTER` is on, for a call of ``tokens`` query tokens (None: a call of many)."""
    return (SCHED_CLUSTER and BLOCK_H < H <= 2 * BLOCK_H and features_of(target)["clusters"]
            and (tokens is None or tokens >= SCHED_CLUSTER_MIN_TOKENS))


# On from 32 query tokens: measured faster than the unclustered form there and slower at 1-2 tokens, where the
# cluster's start and end synchronisation outweighs the halved dequantisation (docs/dsv4.md, the clustered form)
SCHED_CLUSTER = True
SCHED_CLUSTER_MIN_TOKENS = 32


def _sched_pdl(target) -> str:
    """Where the scheduled program triggers its combine's programmatic dependent launch (:data:`SCHED_PDL`; ``""``:
    no dependent launch): where the target has it (CUDA sm_90+) and ``MUSA_ATTN_PDL`` allows it (both kernels are
    built alike)."""
    return SCHED_PDL if SCHED_PDL and settings().pdl and features_of(target)["dependent_launch"] else ""


# The three switches below are off: measured no faster than without them (docs/dsv4.md, "three variants").
# SCHED_PDL, where each block triggers the combine's dependent launch: "" none, "start" at its start, "end" after
# its last tile (FlashMLA's place). Either way every block of the combine waits for the program's grid (FlashMLA's
# lets a block with nothing to merge exit first; ours waits, so that the merge never completes before the program).
SCHED_PDL = ""
# the producer's cache loads with an L1 evict-last and a 256-byte L2 prefetch hint and unsigned slot arithmetic
# (FlashMLA's producer loads so); CUDA only (a force-included device function); not yet timed alone
SCHED_LOAD_HINT = False
# the producer asks L2 for the next tile's rows once it has their indices (a bulk prefetch a row; CUDA sm_90), so that
# their memory latency overlaps this tile's dequantisation
SCHED_PREFETCH = False


def paired_kernel(H: int, has_extra: bool, has_sink: bool, q_dtype: str, target=None):
    """The compiled paired sparse MQA program (:mod:`.paired_kernel`: one block a token, the key tiles in
    pairs over two math warp groups; many-token batches)."""
    from . import paired_kernel as pk

    _check_program("paired", target)
    check(q_dtype == "bfloat16", lambda: f"sparse_mqa: the paired program takes bfloat16 q, got {q_dtype}")
    rows = pk.PRODUCER_ROWS_AT_ONCE
    key = ("dsv4_sparse_mqa_paired", H, has_extra, has_sink, q_dtype) + (("rows1",) if rows == 1 else ())
    return compile_cached(key, lambda: pk.build_sparse_mqa_paired(H, has_extra, has_sink, q_dtype, rows),
                          target=target, pass_configs=_ws_pass_configs())


def paired_ws_kernel(H: int, has_sink: bool, q_dtype: str, target=None):
    """The compiled paired sparse MQA program over a bf16 workspace (:mod:`.paired_ws_kernel`)."""
    from . import paired_ws_kernel as pw

    _check_program("paired_ws", target)
    check(q_dtype == "bfloat16", lambda: f"sparse_mqa: the paired_ws program takes bfloat16 q, got {q_dtype}")
    switches = tuple(getattr(pw, attr) for attr in pw.SWITCHES.values())
    variant = tuple(name for name, on in zip(pw.SWITCHES, switches) if on)
    return compile_cached(("dsv4_sparse_mqa_paired_ws", H, has_sink, q_dtype) + variant,
                          lambda: pw.build_sparse_mqa_paired_ws(H, has_sink, q_dtype, *switches), target=target,
                          pass_configs=_ws_pass_configs(), headers=(LOAD_HINT_HEADER,) if pw.COPY_HINT else ())


from .combine_kernel import MAX_GROUPS  # noqa: E402

# the combine's blocks along the list of split tokens (a launch argument: no other build): each walks every
# SCHED_COMBINE_GROUPS-th split token, so at 64 split tokens 32 blocks walk two each where FlashMLA's merge gives a
# request a block (its merge the faster, docs/dsv4.md); a block a split token (a larger value: the grid is capped
# by parts - 1 and the tokens) is to be measured (scripts/sched_variants.py "groups")
SCHED_COMBINE_GROUPS = MAX_GROUPS

def sched_combine_kernel(H: int, has_sink: bool, q_dtype: str, target=None):
    """The compiled merge of the scheduled program's split tokens (:mod:`.combine_kernel`)."""
    from .combine_kernel import build_sparse_combine

    pdl = bool(_sched_pdl(target))
    key = ("dsv4_sparse_combine", H, has_sink, q_dtype) + (("pdl",) if pdl else ())
    return compile_cached(key, lambda: build_sparse_combine(H, has_sink, q_dtype, pdl=pdl), target=target)


def combine_kernel(H: int, has_sink: bool, q_dtype: str, target=None):
    max_splits = MAX_SPLITS if settings().chunked_combine else 0
    return compile_cached(("dsv4_combine", H, has_sink, q_dtype, max_splits),
                          lambda: build_combine(H, L.D, q_dtype, has_sink, max_splits=max_splits, sink_in_lse=False),
                          target=target)


def num_splits_for(tokens: int, heads: int, tiles: int, sm_count: int) -> int:
    """Enough splits of the index tiles that the blocks fill every SM about twice, each split keeping >= 2
    tiles; 1 when the tokens alone fill the GPU (prefill)."""
    blocks = tokens * math.ceil(heads / BLOCK_H)
    if blocks >= sm_count or tiles < 4:
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(2 * sm_count / blocks), tiles // 2))


def _lengths(lengths: Optional[torch.Tensor], T: int, K: int, device) -> torch.Tensor:
    if lengths is None:
        return torch.full((T,), K, dtype=torch.int32, device=device)
    if lengths.dtype == torch.int32 and lengths.is_contiguous():
        return lengths
    return lengths.to(torch.int32).contiguous()


def _plan_lengths(plan, K: int, device) -> torch.Tensor:
    """``[plan.tokens]`` int32 lengths of ``K`` (every entry counts) for the calls of ``plan``'s batch that pass
    none: made once per ``K`` and kept on the plan, so a batch's layers launch no fill each; made afresh while a
    graph is being captured (a tensor filled by a captured launch holds its values only once the graph replays).
    ``plan`` None: a call with no tokens."""
    if plan is None or stream_capturing(device):
        return _lengths(None, 0 if plan is None else plan.tokens, K, device)
    hit = plan.full_lengths.get(K)
    if hit is None:
        hit = plan.full_lengths[K] = _lengths(None, plan.tokens, K, device)
    return hit


def _alloc(shape, dtype, device) -> torch.Tensor:
    # MUSA_ATTN_POISON (a debug aid the tests turn on): NaN, so an element no kernel writes shows up
    if settings().poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def sparse_mqa_plan(q: torch.Tensor, indices: torch.Tensor, lengths=None, extra_indices=None, extra_lengths=None):
    """The scheduled program's plan (:mod:`.schedule`) of a :func:`sparse_mqa` call's shapes and lengths, over one
    wave of this GPU's SMs. Without lengths the plan depends on the shapes alone: it is made once per shape and
    kept (vLLM's layer passes its index lists without lengths, -1 marking the entries that do not count)."""
    from . import schedule
    from .schedule import default_parts, plan_sparse_mqa

    T, H = q.shape[0], q.shape[1]
    K2 = 0 if extra_indices is None else extra_indices.shape[1]
    parts = default_parts(H, get_platform().sm_count or 132)
    if lengths is None and (extra_lengths is None or not K2):
        key = (T, indices.shape[1], K2, parts, schedule.PLAN_SLACK, q.device)
        plan = _CAPTURED_PLANS.get(key)
        if plan is not None:
            return plan
        plan = _SHAPE_PLANS.pop(key, None)
        if plan is None:
            plan = plan_sparse_mqa(T, indices.shape[1], None, K2, None, parts=parts, device=q.device)
        if stream_capturing(q.device):
            # a graph captured now reads this plan's tensors at every replay: kept for good, never evicted (and so
            # never freed and reused) by the shapes eager calls bring later
            _CAPTURED_PLANS[key] = plan
            return plan
        _SHAPE_PLANS[key] = plan  # most recently used last
        while len(_SHAPE_PLANS) > _SHAPE_PLANS_KEPT:
            _SHAPE_PLANS.pop(next(iter(_SHAPE_PLANS)))
        return plan
    return plan_sparse_mqa(T, indices.shape[1], lengths, K2, extra_lengths if K2 else None, parts=parts,
                           device=q.device)


# plans of calls without lengths, by (tokens, topk, extra topk, parts, device): the least recently used dropped
_SHAPE_PLANS: dict = {}
_SHAPE_PLANS_KEPT = 256
on_change(_SHAPE_PLANS.clear)
# plans a graph capture used, by the same key: never evicted (a settings change leaves them: graphs may hold them)
_CAPTURED_PLANS: dict = {}


def scheduled_launch(q, cache, i1, lengths, extra_cache, i2, extra_lengths, has_extra, sinks, has_sink, sm_scale,
                     out, plan, empty_lse_inf, op):
    """``(out, lse)`` of the scheduled program on checked, contiguous arguments and ``plan`` (checked by the caller
    against the call's shapes): the lengths made int32 (None: every entry counts, kept on the plan), ``out`` (None:
    made here) and the LSE, then the launches. Shared by :func:`sparse_mqa_tilelang` and FlashMLA's entry."""
    T, H, _ = q.shape
    dev = q.device
    l1 = _lengths(lengths, T, i1.shape[1], dev) if lengths is not None else _plan_lengths(plan, i1.shape[1], dev)
    # every extra entry counts, or no extra set (no entry: lengths 0)
    l2 = (_lengths(extra_lengths, T, i2.shape[1], dev) if extra_lengths is not None
          else _plan_lengths(plan, i2.shape[1], dev))
    if T and compiled_launch_on() and not settings().poison:
        done = _scheduled_compiled(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, has_sink, sm_scale, out,
                                   plan, empty_lse_inf, op)
        if done is not None:
            return done
    out = _alloc(q.shape, q.dtype, dev) if out is None else out
    lse = _alloc((T, H), torch.float32, dev)
    if T:
        _sparse_mqa_scheduled(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, has_sink, sm_scale, out, lse,
                              plan, empty_lse_inf, op)
    return out, lse


# the compiled call's placeholders: the LSE, the partials and (when the caller passes none) the output
_ALLOCS = tuple(_ffi_launch.Alloc(i) for i in range(4))

# The scheduled program and its combine launched by one call into C++ (:mod:`musa_attn_backend._ffi_launch`), the
# LSE and partials made there (issue 38's host path): None follows MUSA_ATTN_COMPILED_LAUNCH (_ffi_launch.enabled);
# True / False force it (the tests and the benchmarks compare both)
SCHED_COMPILED_LAUNCH: Optional[bool] = None


def compiled_launch_on() -> bool:
    """Whether the scheduled program's launches go through :mod:`.._ffi_launch` now."""
    forced = SCHED_COMPILED_LAUNCH
    return _ffi_launch.enabled() if forced is None else forced


def _compiled_pair(q, has_extra, has_sink, out, plan):
    """``((program handle, combine handle), allocs, (program, combine))`` for a compiled launch of the scheduled
    program on ``q``'s device: the allocs are the LSE, the partials and (``out`` None) the output, in
    :data:`_ALLOCS`' order. None where either kernel has no compiled entry there yet (its first launch on a
    device goes through TileLang, which makes it) or the platform launches through TileLang's wrapper."""
    T, H, _ = q.shape
    dev = q.device
    program, combine = _sched_kernels(H, has_extra, has_sink, T)
    if not (hasattr(program, "handle") and hasattr(combine, "handle")):
        return None  # kernels TileLang launches itself (its wrapper kept, or stand-ins where nothing launches)
    index = dev.index if dev.index is not None else 0 if dev.type == "cpu" else torch.cuda.current_device()
    hp, hc = program.handle(index), combine.handle(index)
    if hp is None or hc is None:
        return None
    allocs = [((T, H), torch.float32), ((plan.num_partials, H, L.D), torch.float32),
              ((plan.num_partials, H), torch.float32)] + ([] if out is not None else [(tuple(q.shape), q.dtype)])
    return (hp, hc), allocs, (program, combine)


def _scheduled_compiled(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, has_sink, sm_scale, out, plan,
                        empty_lse_inf, op):
    """:func:`scheduled_launch`'s launches through :func:`.._ffi_launch.run`: the same two kernels, arguments and
    results, the LSE, the partials and (``out`` None) the output made in C++. None where the kernels have no
    compiled entry on this device yet (their first launch there goes through TileLang, which makes it) or the
    platform launches through TileLang's wrapper."""
    found = _compiled_pair(q, has_extra, has_sink, out, plan)
    if found is None:
        return None
    (hp, hc), allocs, _ = found
    lse, o_part, l_part, made_out = _ALLOCS
    program_args, combine_args = _sched_args(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, sm_scale,
                                             made_out if out is None else out, lse, o_part, l_part, plan,
                                             empty_lse_inf, op)
    made = _ffi_launch.run([(hp, program_args), (hc, combine_args)], allocs, q)
    return (made[3] if out is None else out), made[0]


class _NotPreparable(Exception):
    pass


def prepare_scheduled(slots: list, q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, has_sink, sm_scale, out,
                      plan, empty_lse_inf, op, fixed: tuple):
    """:func:`scheduled_launch`'s compiled launches recorded for calls that differ only in the tensors of
    ``slots`` (``(caller's tensor, what the launches take of it...)`` pairs, in the order a later call passes the
    tensors; each launch tensor must be a view of its caller's tensor: the word views of a cache are named here),
    every other launch tensor one of ``fixed`` (the batch's: the plan's, the stand-ins without sinks or extra set).
    ``out`` None: the output is made per call. Returns ``(prepared, kept)`` (``prepared.run(tensors)``: see
    :func:`.._ffi_launch.prepare`; ``kept``: what must outlive it), or None where the launches cannot be recorded
    (no compiled entry on this device yet, a launch tensor that is a copy rather than a view, graph capture)."""
    dev = q.device
    if not compiled_launch_on() or settings().poison or stream_capturing(dev):
        return None
    found = _compiled_pair(q, has_extra, has_sink, out, plan)
    if found is None:
        return None
    (hp, hc), allocs, (program, combine) = found
    owner, keep = {}, []
    for k, (given, *views) in enumerate(slots):
        if any(v is cache for v in views):
            views += _cache_word_views(cache, dev, op, "cache")[0]
        if has_extra and any(v is extra_cache for v in views):
            views += _cache_word_views(extra_cache, dev, op, "extra_cache")[0]
        for v in views:
            if v.untyped_storage().data_ptr() != given.untyped_storage().data_ptr():
                return None  # a copy (made for this call): it cannot stand for later calls' tensors
            owner[id(v)] = k
            keep.append(v)
    fixed_ids = {id(t) for t in fixed}
    lse, o_part, l_part, made_out = _ALLOCS
    program_args, combine_args = _sched_args(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, sm_scale,
                                             made_out if out is None else out, lse, o_part, l_part, plan,
                                             empty_lse_inf, op)

    def recorded(args):
        for a in args:
            if isinstance(a, torch.Tensor):
                if id(a) in owner:
                    a = _ffi_launch.SlotView(owner[id(a)], a)
                elif id(a) not in fixed_ids:
                    raise _NotPreparable(a.shape)
            yield a

    try:
        calls = [(hp, tuple(recorded(program_args))), (hc, tuple(recorded(combine_args)))]
    except _NotPreparable:
        return None
    prepared = _ffi_launch.prepare(calls, allocs, [s[0] for s in slots])
    return prepared, (program, combine, keep)


def _sched_args(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, sm_scale, out, lse, o_part, l_part, plan,
                empty_lse_inf, op) -> tuple:
    """The scheduled program's and its combine's argument lists (``out``, ``lse`` and the partials as given:
    tensors, or the compiled call's placeholders)."""
    T = q.shape[0]
    dev = q.device
    main_views, main_geo = _cache_word_views(cache, dev, op, "cache")
    if has_extra:
        extra_views, extra_geo = _cache_word_views(extra_cache, dev, op, "extra_cache")
    else:
        extra_views, extra_geo = main_views, (1, 1, 0)
    empty = float("inf") if empty_lse_inf else float("-inf")
    groups = max(1, min(SCHED_COMBINE_GROUPS, plan.parts - 1, T))  # split tokens: at most parts - 1, at most T
    return ((q, *main_views, i1, l1, *extra_views, i2, l2, sinks, plan.part_meta, plan.tiles, plan.first_part,
             plan.split_row, float(sm_scale), empty, *main_geo, *extra_geo, out, lse, o_part, l_part),
            (plan.combine, plan.num_split, plan.split_row, o_part, l_part, sinks, empty, groups, out, lse))


def _sparse_mqa_scheduled(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, has_sink, sm_scale, out, lse,
                          plan, empty_lse_inf, op):
    """Launch the scheduled program and its combine (:mod:`.sched_kernel`) on ``plan``, checked by the
    caller against the call's shapes."""
    T, H, _ = q.shape
    dev = q.device
    # partials from the caching allocator on the current stream (a buffer shared across calls would race where an
    # engine runs attention on two streams)
    o_part = _alloc((plan.num_partials, H, L.D), torch.float32, dev)
    l_part = _alloc((plan.num_partials, H), torch.float32, dev)
    program_args, combine_args = _sched_args(q, cache, i1, l1, extra_cache, i2, l2, has_extra, sinks, sm_scale, out,
                                             lse, o_part, l_part, plan, empty_lse_inf, op)
    program, combine = _sched_kernels(H, has_extra, has_sink, T)
    program(*program_args)
    combine(*combine_args)


def _launch_inputs(q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink, views):
    """What the unplanned programs take besides ``q``: ``(has_extra, main, extra, sinks)``, each set ``(views of
    its cache, their geometry, indices, lengths)`` (``views(cache, name)``: the program's views; without an
    extra set, the main cache's views stand in and its lists are empty), the sinks (zeros without)."""
    T, H, _ = q.shape
    dev = q.device
    has_extra = extra_cache is not None and extra_indices.shape[1] > 0
    i1 = indices.contiguous()
    main = (*views(cache, "cache"), i1, _lengths(lengths, T, i1.shape[1], dev))
    if has_extra:
        i2 = extra_indices.contiguous()
        extra = (*views(extra_cache, "extra_cache"), i2, _lengths(extra_lengths, T, i2.shape[1], dev))
    else:
        extra = (main[0], (1, 1, 0), torch.empty(T, 0, dtype=torch.int32, device=dev),
                 torch.zeros(T, dtype=torch.int32, device=dev))
    sinks = sink.contiguous() if sink is not None else torch.zeros(H, dtype=torch.float32, device=dev)
    return has_extra, main, extra, sinks


def _sparse_mqa_paired(q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink, sm_scale, out,
                       return_lse, empty_lse_inf, op):
    """Launch the paired program (:mod:`.paired_kernel`): one block a token and 64 heads, no split."""
    T, H, _ = q.shape
    dev = q.device
    views = lambda c, name: _cache_word_views(c, dev, op, name)  # noqa: E731
    has_extra, main, extra, sinks = _launch_inputs(q, cache, indices, lengths, extra_cache, extra_indices,
                                                   extra_lengths, sink, views)
    has_sink = sink is not None
    out = _alloc(q.shape, q.dtype, dev) if out is None else out
    lse = _alloc((T, H), torch.float32, dev)
    if T:
        empty = float("inf") if empty_lse_inf else float("-inf")
        paired_kernel(H, has_extra, has_sink, "bfloat16")(q, *main[0], *main[2:], *extra[0], *extra[2:], sinks,
                                                         float(sm_scale), empty, *main[1], *extra[1], out, lse)
    return (out, lse) if return_lse else out


def portable_ws_kernel(H: int, has_sink: bool, q_dtype: str, target=None):
    """The compiled portable sparse MQA program over a bf16 workspace (:mod:`.portable_ws_kernel`), in the form
    :func:`portable_form` gives the target."""
    from . import portable_ws_kernel as pws

    _check_program("portable_ws", target)
    check(q_dtype == "bfloat16", lambda: f"sparse_mqa: the portable_ws program takes bfloat16 q, got {q_dtype}")
    form, prefetch = portable_form(target), pws.PREFETCH
    key = ("dsv4_sparse_mqa_portable_ws", H, has_sink, q_dtype, form["block_N"]) + (
        ("separate_v",) if form["separate_v"] else ()) + (("prefetch",) if prefetch else ())
    return compile_cached(key, lambda: pws.build_sparse_mqa_portable_ws(H, has_sink, q_dtype, BLOCK_H,
                                                                        form["block_N"], 256, form["separate_v"],
                                                                        prefetch), target=target)


def staged_ws_kernel(H: int, has_sink: bool, q_dtype: str, target=None):
    """The compiled staged sparse MQA program over a bf16 workspace (:mod:`.staged_ws_kernel`: a producer warp
    group staging the next tile, within MP31's rules on every target)."""
    from . import staged_ws_kernel as sws

    _check_program("staged_ws", target)
    check(q_dtype == "bfloat16", lambda: f"sparse_mqa: the staged_ws program takes bfloat16 q, got {q_dtype}")
    f = features_of(target)
    fence, regs, overlap = bool(f["async_proxy_fence"]), bool(f["warp_specialized"]), sws.OVERLAP
    return compile_cached(("dsv4_sparse_mqa_staged_ws", H, has_sink, q_dtype, fence, regs) + (
                              ("overlap",) if overlap else ()),
                          lambda: sws.build_sparse_mqa_staged_ws(H, has_sink, q_dtype, fence, regs, overlap),
                          target=target,
                          pass_configs=_ws_pass_configs())


_WS_KERNELS = {"paired_ws": paired_ws_kernel, "portable_ws": portable_ws_kernel, "staged_ws": staged_ws_kernel}


def _ws_kernel(program: str, H: int, has_sink: bool):
    """The compiled program over a workspace (one of :data:`WORKSPACE_PROGRAMS`)."""
    return _WS_KERNELS[program](H, has_sink, "bfloat16")


def workspace_rows_kernel(target=None):
    """The compiled gather of cache rows into the paired_ws program's workspace (:mod:`.workspace_kernel`)."""
    from .workspace_kernel import build_workspace_rows

    fp8 = _glue._fp8_convert(target)
    return compile_cached(("dsv4_workspace_rows", fp8), lambda: build_workspace_rows(fp8), target=target)


def _read_rows(op: str):
    """The workspace's ``read_rows`` (:func:`.workspace.build_workspace`) through :func:`workspace_rows_kernel`."""
    def read(cache, slots, name):
        dev = slots.device
        views, geo = _flat_views(L.kv_pages(cache, name, op=op), dev, op, name, units=True)
        rows = _alloc((slots.shape[0], L.D), torch.bfloat16, dev)
        if slots.shape[0]:
            workspace_rows_kernel()(*views, slots.to(torch.int32), *geo, rows)
        return rows
    return read


def _sparse_mqa_ws(program, q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink, sm_scale,
                   out, return_lse, empty_lse_inf, op):
    """Build the call's bf16 workspace (:mod:`.workspace`: one host synchronisation) and launch ``program``
    (``paired_ws`` or ``portable_ws``) over it."""
    from .workspace import build_workspace

    T, H, _ = q.shape
    dev = q.device
    _check_program(program)  # before the workspace's gathers launch
    check(not stream_capturing(dev),
          lambda: f"{op}: the {program} program builds its workspace with a host synchronisation, which a graph "
                  f"capture cannot hold; capture with MUSA_ATTN_DSV4_PROGRAM=auto")
    out = _alloc(q.shape, q.dtype, dev) if out is None else out
    lse = _alloc((T, H), torch.float32, dev)
    if T:
        has_extra = extra_cache is not None and extra_indices.shape[1] > 0
        ws = build_workspace(cache, indices, lengths, extra_cache=extra_cache if has_extra else None,
                             extra_indices=extra_indices if has_extra else None,
                             extra_lengths=extra_lengths if has_extra else None, op=op, read_rows=_read_rows(op))
        _launch_ws(program, q, ws.rows, ws.indices, ws.lengths, sink, sm_scale,
                   float("inf") if empty_lse_inf else float("-inf"), out, lse, _alloc((T, H), torch.float32, dev))
    return (out, lse) if return_lse else out


def _launch_ws(program, q, rows, indices, lengths, sink, sm_scale, empty_lse, out, lse, max_logits) -> None:
    """Launch ``program`` (``paired_ws`` or ``portable_ws``) over the bf16 ``rows`` (a stand-in row where there
    are none: every entry is then invalid) with the tokens' lists ``indices [T, K]`` and ``lengths [T]``."""
    H, dev = q.shape[1], q.device
    rows = rows if rows.shape[0] else torch.zeros(1, L.D, dtype=torch.bfloat16, device=dev)
    sinks = sink.float().contiguous() if sink is not None else torch.zeros(H, dtype=torch.float32, device=dev)
    _ws_kernel(program, H, sink is not None)(q.contiguous(), rows.contiguous(), indices.contiguous(),
                                             lengths.contiguous(), sinks, float(sm_scale), empty_lse, out, lse,
                                             max_logits)


def sparse_prefill_program(target=None) -> str:
    """The program FlashMLA's sparse prefill entry runs over a caller's bf16 rows: the workspace program
    ``MUSA_ATTN_DSV4_PROGRAM`` names (one of :data:`WORKSPACE_PROGRAMS`), else ``paired_ws`` where the target runs
    the Hopper programs and ``portable_ws`` where it does not (MUSA)."""
    chosen = settings().dsv4_program
    if chosen in WORKSPACE_PROGRAMS:
        return chosen
    return "paired_ws" if _hopper_capable(target) else "portable_ws"


def sparse_prefill_bf16(q, kv, indices, lengths, sink, sm_scale):
    """FlashMLA's sparse prefill on :func:`sparse_prefill_program`'s program over the caller's bf16 rows ``kv
    [S_kv, 512]`` (the workspace an engine builds for FlashMLA): ``(out, max_logits, lse)`` by FlashMLA's
    conventions (``lse = +inf``, ``max_logits = -inf`` for a query with no valid entry). Arguments checked by
    :func:`.flash_mla.flash_mla_sparse_fwd`; ``indices [S, K]`` int32, ``lengths [S]`` int32 or None."""
    T, H, _ = q.shape
    dev = q.device
    program = sparse_prefill_program()
    _check_program(program)
    out = _alloc(q.shape, q.dtype, dev)
    lse = _alloc((T, H), torch.float32, dev)
    max_logits = _alloc((T, H), torch.float32, dev)
    if T:
        n = (torch.full((T,), indices.shape[1], dtype=torch.int32, device=dev) if lengths is None
             else lengths.to(torch.int32))
        _launch_ws(program, q, kv, indices, n, sink, sm_scale, float("inf"), out, lse, max_logits)
    return out, max_logits, lse


_SCHED_KERNELS: dict = {}
on_change(_SCHED_KERNELS.clear)
# bumped when a setting changes: launches recorded before (prepare_scheduled) are not replayed after
_GENERATION = [0]
on_change(lambda: _GENERATION.__setitem__(0, _GENERATION[0] + 1))


def _sched_kernels(H: int, has_extra: bool, has_sink: bool, tokens=None) -> tuple:
    """The scheduled program (clustered or not, :func:`_sched_cluster` for ``tokens`` query tokens) and its combine
    for this platform, looked up once per shape (a launch then costs no compile-cache key), each as its
    :func:`~musa_attn_backend._tilelang.launcher` (the compiled entry without TileLang's Python wrapper where the
    platform allows it: an eager decode step launches both on every layer)."""
    cluster = _sched_cluster(H, None, tokens)
    key = (H, has_extra, has_sink, cluster, SCHED_PDL, SCHED_LOAD_HINT, SCHED_PREFETCH)
    hit = _SCHED_KERNELS.get(key)
    if hit is None:
        hit = _SCHED_KERNELS[key] = (launcher(sched_kernel(H, has_extra, has_sink, "bfloat16", cluster=cluster)),
                                     launcher(sched_combine_kernel(H, has_sink, "bfloat16")))
    return hit


def sparse_mqa_tilelang(q, cache, indices, lengths=None, *, extra_cache=None, extra_indices=None,
                        extra_lengths=None, sink=None, sm_scale=L.D ** -0.5, out=None, return_lse=False,
                        program: Optional[str] = None, plan=None, empty_lse_inf: bool = False):
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.sparse_mqa` (arguments checked there;
    ``program``: see :func:`sparse_mqa_kernel`; ``plan``: the scheduled program's, made here when None, ignored
    by the other programs; ``empty_lse_inf``: a token with no valid entry gets LSE ``+inf`` (FlashMLA's
    convention) rather than ``-inf``)."""
    op = "sparse_mqa(impl='tilelang')"
    check(q.dtype == torch.bfloat16, lambda: f"{op}: q must be bfloat16 (the kernels' dtype), got {q.dtype}")
    T, H, _ = q.shape
    dev = q.device
    q = q.contiguous()
    program = program or sparse_mqa_program()
    if program == "scheduled":
        has_extra = extra_cache is not None and extra_indices.shape[1] > 0
        i1 = indices.contiguous()
        i2 = extra_indices.contiguous() if has_extra else torch.empty(T, 0, dtype=torch.int32, device=dev)
        if plan is None and T:
            plan = sparse_mqa_plan(q, i1, lengths, i2 if has_extra else None, extra_lengths if has_extra else None)
        if T:  # before the plan's kept lengths are used: they are the plan's token count long
            plan.check_matches(op, T, i1.shape[1], i2.shape[1], dev)
        has_sink = sink is not None
        sinks = sink.contiguous() if has_sink else torch.zeros(H, dtype=torch.float32, device=dev)
        out, lse = scheduled_launch(q, cache, i1, lengths, extra_cache, i2, extra_lengths if has_extra else None,
                                    has_extra, sinks, has_sink, sm_scale, out, plan, empty_lse_inf, op)
        return (out, lse) if return_lse else out
    if program in WORKSPACE_PROGRAMS:
        return _sparse_mqa_ws(program, q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink,
                              sm_scale, out, return_lse, empty_lse_inf, op)
    if program == "paired":
        return _sparse_mqa_paired(q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink,
                                  sm_scale, out, return_lse, empty_lse_inf, op)
    views = lambda c, name: _flat_views(L.kv_pages(c, name, op=op), dev, op, name, units=True)  # noqa: E731
    has_extra, (main_views, main_geo, i1, l1), (extra_views, extra_geo, i2, l2), sinks = _launch_inputs(
        q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink, views)
    has_sink = sink is not None
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return (out, lse) if return_lse else out
    bn = sparse_mqa_block_n(program=program)
    tiles = math.ceil(i1.shape[1] / bn) + math.ceil(i2.shape[1] / bn)
    splits = num_splits_for(T, H, tiles, get_platform().sm_count or 132)
    args = (q, *main_views, i1, l1, *extra_views, i2, l2, sinks, float(sm_scale), *main_geo, *extra_geo, splits)
    if splits == 1:
        sparse_mqa_kernel(H, has_extra, has_sink, False, tl_dtype(q.dtype), program=program)(*args, out, lse)
    else:
        o_part = torch.empty(splits, T, H, L.D, dtype=torch.float32, device=dev)
        l_part = torch.empty(splits, T, H, dtype=torch.float32, device=dev)
        sparse_mqa_kernel(H, has_extra, has_sink, True, tl_dtype(q.dtype), program=program)(*args, o_part, l_part)
        combine_kernel(H, has_sink, tl_dtype(q.dtype))(o_part, l_part, sinks, out, lse)
    if empty_lse_inf:
        lse.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=float("inf"))
    return (out, lse) if return_lse else out


