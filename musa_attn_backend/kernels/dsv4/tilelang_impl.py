"""Launch the TileLang DeepSeek-V4 kernels: the flat byte views of the caches, the split count, the combine."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._tilelang import compile_cached, tl, tl_dtype
from ...config import settings
from ...platform import features_of, get_platform
from .._common import check
from ..attention.combine_kernel import build_combine
from . import layout as L
from .sparse_mqa_kernel import build_sparse_mqa
from .sparse_mqa_ws_kernel import build_sparse_mqa_ws
from .write_kernel import build_write_index_k, build_write_kv_v4

BLOCK_H = 64
BLOCK_N = 64
MAX_SPLITS = 64
_EMPTY: dict = {}


def _unit_views(flat: torch.Tensor):
    """The programs' views of a cache's bytes: ``[n16, 16]`` e4m3 (uint8 where the target has no FP8
    conversion) and ``[n16, 8]`` bf16 (16-byte units), ``[n8, 8]`` uint8 (8-byte units)."""
    n16, n8 = flat.numel() // 16, flat.numel() // 8
    nope = flat[:n16 * 16] if not _fp8_convert(None) else flat[:n16 * 16].view(torch.float8_e4m3fn)
    return nope.view(n16, 16), flat[:n16 * 16].view(torch.bfloat16).view(n16, 8), flat[:n8 * 8].view(n8, 8)


def _flat_views(pages: L.Pages, device, op: str, name: str, dtypes=(torch.float8_e4m3fn, torch.bfloat16, None),
                units: bool = False):
    """Views of ``dtypes`` (None: the uint8 bytes; ``units``: :func:`_unit_views`) from the cache's first byte
    to its last page's end, and (rows, page stride in 16-byte units, slots)."""
    if pages.num_pages == 0:
        buf = _EMPTY.get(device)
        if buf is None:
            buf = _EMPTY[device] = torch.zeros(16, dtype=torch.uint8, device=device)
        views = _unit_views(buf) if units else tuple(buf if d is None else buf.view(d) for d in dtypes)
        return views, (max(pages.rows, 1), 1, 0)
    p = pages.pages
    stride = p.stride(0) if pages.num_pages > 1 else L.page_bytes(pages.rows)
    check(p.data_ptr() % 16 == 0 and stride % 16 == 0,
          lambda: f"{op}: {name} must start on a 16-byte boundary with a page stride that is a multiple of 16 "
                  f"(pointer {p.data_ptr() % 16} bytes past one, stride {stride})")
    nbytes = (pages.num_pages - 1) * stride + p.shape[1]  # even: rows of 584 bytes, pages 16-byte aligned
    flat = p.as_strided((nbytes,), (1,))  # the programs address it with 64-bit offsets: any size
    views = _unit_views(flat) if units else tuple(flat if d is None else flat.view(d) for d in dtypes)
    return views, (pages.rows, stride // 16, pages.num_slots)


PROGRAMS = ("warp_specialized", "portable")
# the warp-specialised program's producer (see build_sparse_mqa_ws): "rows" is the one measured on the H200;
# "async" (cp.async copies, widened in place) is built and awaits its first GPU run
WS_PRODUCER = "rows"
WS_PRODUCERS = ("rows", "async")


def sparse_mqa_program(target=None) -> str:
    """Which sparse MQA program ``target`` (None: this platform's) runs: ``warp_specialized``
    (:mod:`.sparse_mqa_ws_kernel`: a dequantising producer warp group, P in registers) where the target has warp
    specialisation, GEMMs that read A from registers and an FP8 conversion; else ``portable``
    (:mod:`.sparse_mqa_kernel`)."""
    f = features_of(target)
    return "warp_specialized" if f["warp_specialized"] and f["gemm_a_in_registers"] and f["fp8"] else "portable"


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
    return BLOCK_N if program == "warp_specialized" else portable_form(target)["block_N"]


def sparse_mqa_kernel(H: int, has_extra: bool, has_sink: bool, split: bool, q_dtype: str, target=None,
                      program: Optional[str] = None, producer: str = "rows"):
    """The compiled sparse MQA program (``program``: one of :data:`PROGRAMS`, default
    :func:`sparse_mqa_program`; ``producer``: the warp-specialised program's, see
    :func:`.sparse_mqa_ws_kernel.build_sparse_mqa_ws`)."""
    program = program or sparse_mqa_program(target)
    check(program in PROGRAMS, lambda: f"sparse_mqa: program must be one of {PROGRAMS}, got {program!r}")
    check(program == "portable" or sparse_mqa_program(target) == program,
          lambda: f"sparse_mqa: the {program} program needs warp specialisation, GEMMs reading A from registers "
                  f"and an FP8 conversion, which this target lacks: {features_of(target)}")
    if program == "warp_specialized":
        check(producer in WS_PRODUCERS,
              lambda: f"sparse_mqa: producer must be one of {WS_PRODUCERS}, got {producer!r}")
        # the program syncs its warp groups itself (named barriers and mbarriers); TileLang's automatic syncs
        # would put a whole-block barrier inside one warp group's code
        pc = {tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
              # every read is in bounds by construction (index entries clamped into their rows and guarded by
              # the length; cache rows read only for a valid slot; output rows guarded), so the per-access
              # checks would only add instructions to the producer's loads
              tl.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
              # the score exchange's XOR-swizzled columns are a permutation: no two threads write one word
              **_no_race_check()}
        key = ("dsv4_sparse_mqa", H, has_extra, has_sink, split, q_dtype, program, BLOCK_N, producer)
        return compile_cached(key, lambda: build_sparse_mqa_ws(H, has_extra, has_sink, split, q_dtype, BLOCK_N,
                                                               producer=producer),
                              target=target, pass_configs=pc)
    # the portable program: P through shared memory on every target (what MUSA needs)
    shared_p = True
    fp8_convert = _fp8_convert(target)
    form = portable_form(target)
    key = ("dsv4_sparse_mqa", H, has_extra, has_sink, split, q_dtype, BLOCK_H, form["block_N"], shared_p,
           fp8_convert) + (("separate_v",) if form["separate_v"] else ())
    return compile_cached(key, lambda: build_sparse_mqa(H, has_extra, has_sink, split, q_dtype, BLOCK_H,
                                                        form["block_N"], 256, shared_p, fp8_convert,
                                                        form["separate_v"]), target=target)


def _fp8_convert(target) -> bool:
    """Whether the programs for ``target`` (None: this platform's) convert e4m3 with the target's FP8
    conversion (``platform.fp8``), rather than decoding the bytes by integer arithmetic (MP22)."""
    return features_of(target)["fp8"]


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
    return lengths.to(torch.int32).contiguous()


def sparse_mqa_tilelang(q, cache, indices, lengths=None, *, extra_cache=None, extra_indices=None,
                        extra_lengths=None, sink=None, sm_scale=L.D ** -0.5, out=None, return_lse=False,
                        program: Optional[str] = None):
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.sparse_mqa` (arguments checked there;
    ``program``: see :func:`sparse_mqa_kernel`)."""
    op = "sparse_mqa(impl='tilelang')"
    check(q.dtype == torch.bfloat16, lambda: f"{op}: q must be bfloat16 (the kernels' dtype), got {q.dtype}")
    T, H, _ = q.shape
    dev = q.device
    q = q.contiguous()
    main_views, main_geo = _flat_views(L.kv_pages(cache, op=op), dev, op, "cache", units=True)
    has_extra = extra_cache is not None and extra_indices.shape[1] > 0
    if has_extra:
        extra_views, extra_geo = _flat_views(L.kv_pages(extra_cache, "extra_cache", op=op), dev, op, "extra_cache",
                                             units=True)
        i2 = extra_indices.contiguous()
        l2 = _lengths(extra_lengths, T, i2.shape[1], dev)
    else:
        extra_views, extra_geo = main_views, (1, 1, 0)
        i2 = torch.empty(T, 0, dtype=torch.int32, device=dev)
        l2 = torch.zeros(T, dtype=torch.int32, device=dev)
    i1 = indices.contiguous()
    l1 = _lengths(lengths, T, i1.shape[1], dev)
    has_sink = sink is not None
    sinks = sink.contiguous() if has_sink else torch.zeros(H, dtype=torch.float32, device=dev)
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
        sparse_mqa_kernel(H, has_extra, has_sink, False, tl_dtype(q.dtype), program=program,
                          producer=WS_PRODUCER)(*args, out, lse)
    else:
        o_part = torch.empty(splits, T, H, L.D, dtype=torch.float32, device=dev)
        l_part = torch.empty(splits, T, H, dtype=torch.float32, device=dev)
        sparse_mqa_kernel(H, has_extra, has_sink, True, tl_dtype(q.dtype), program=program,
                          producer=WS_PRODUCER)(*args, o_part, l_part)
        combine_kernel(H, has_sink, tl_dtype(q.dtype))(o_part, l_part, sinks, out, lse)
    return (out, lse) if return_lse else out


def _no_race_check() -> dict:
    """The pass config that turns off TileLang's data-race check (where this TileLang has it), for stores whose
    disjointness it cannot prove: the writers' rows (their slots come from memory: distinct slots write disjoint
    rows; duplicate slots in one call are the caller's, and which row lands is then unspecified, as in the
    engines' writers) and the sparse MQA program's XOR-swizzled score exchange."""
    key = getattr(tl.PassConfigKey, "TL_DISABLE_DATA_RACE_CHECK", None)
    return {key: True} if key is not None else {}


# the writers' tiling (tokens per block, threads), picked by the bench's --writer-tilings sweep
# (benchmarks/results/dsv4-attention-*.json): fewer, larger blocks keep more row stores in flight per SM
WRITE_KV_TILING = (32, 256)
WRITE_INDEX_K_TILING = (32, 256)


def write_kv_v4_kernel(in_dtype: str, target=None, tiling: Optional[tuple] = None):
    tiling = tuple(tiling or WRITE_KV_TILING)
    return compile_cached(("dsv4_write_kv", in_dtype) + tiling, lambda: build_write_kv_v4(in_dtype, *tiling),
                          target=target, pass_configs=_no_race_check())


def write_index_k_kernel(in_dtype: str, target=None, tiling: Optional[tuple] = None, scale_rule: str = "pow2"):
    tiling = tuple(tiling or WRITE_INDEX_K_TILING)
    exact = scale_rule == "exact"
    key = ("dsv4_write_index_k", in_dtype) + tiling + (("exact",) if exact else ())
    return compile_cached(key, lambda: build_write_index_k(in_dtype, *tiling, exact=exact), target=target,
                          pass_configs=_no_race_check())


def check_fp8(op: str, needs: str, then: str = "") -> None:
    """Refuse, naming ``op``, a platform without an FP8 conversion (MP22): ``"{op}: {needs}, which <arch>
    lacks{then}"``."""
    plat = get_platform()
    check(plat.fp8, lambda: f"{op}: {needs}, which {plat.arch} lacks{then}")


def _check_fp8_writes(op: str) -> None:
    check_fp8(op, "the TileLang writers need an FP8 conversion",
              " (MP22 reads these caches, but writing them there is not supported yet)")


def write_kv_v4_tilelang(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.write_kv_v4` (arguments checked there)."""
    op = "write_kv_v4(impl='tilelang')"
    _check_fp8_writes(op)
    views, (rows, stride16, num_slots) = _flat_views(L.kv_pages(cache, op=op), kv.device, op, "cache", units=True)
    write_kv_v4_kernel(tl_dtype(kv.dtype))(kv.contiguous(), slots.to(torch.int64).contiguous(), *views, rows,
                                           stride16, num_slots)


def write_index_k_tilelang(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale_rule: str = "pow2") -> None:
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.write_index_k` (arguments checked there)."""
    op = "write_index_k(impl='tilelang')"
    _check_fp8_writes(op)
    views, (rows, stride16, num_slots) = _flat_views(L.index_pages(cache, op=op), k.device, op, "cache",
                                                     (torch.float8_e4m3fn, torch.float32))
    views = (views[0][:views[0].numel() // 16 * 16].view(-1, 16), views[1])  # data in 16-byte units
    write_index_k_kernel(tl_dtype(k.dtype), scale_rule=scale_rule)(k.contiguous(), slots.to(torch.int64).contiguous(), *views, rows,
                                            stride16, num_slots)


def attention_slots_kernel(window: int, mode: int, target=None):
    from .slots_kernel import build_attention_slots

    return compile_cached(("dsv4_attention_slots", window, mode), lambda: build_attention_slots(window, mode),
                          target=target)


def attention_slots_tilelang(positions, req, swa_table, swa_block, window, ratio, main_table, main_rows, topk_local,
                             width):
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.slots.attention_slots` (arguments checked
    there): one launch for both sets."""
    dev = positions.device
    T = positions.numel()
    K = topk_local.shape[1] if ratio == 4 else (width if ratio == 128 else 1)  # window only: a dummy column
    win = torch.empty(T, window, dtype=torch.int32, device=dev)
    comp = torch.empty(T, K, dtype=torch.int32, device=dev)
    i32 = lambda t: t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()  # noqa: E731
    mt = i32(main_table) if main_table is not None else torch.full((1, 1), -1, dtype=torch.int32, device=dev)
    tk = i32(topk_local) if ratio == 4 else torch.empty(T, K, dtype=torch.int32, device=dev)
    attention_slots_kernel(window, ratio)(i32(positions), i32(req), i32(swa_table), mt, tk,
                                          win, comp, swa_block, max(main_rows, 1), ratio)
    return win, (comp if ratio != 1 else None)
