"""Launch the TileLang paged-attention kernels: pick prefill or split-KV decode, tiles and split count.

The choices depend only on a batch's shape class, the settings, the platform and the tuning table, so they
are planned once and kept (the plan caches below: tilings, split counts, kernel handles): a launch of a shape
class seen before builds no candidate list and reads no file. :func:`clear_plan_caches` empties them; it runs
whenever the settings (``config.refresh`` / ``config.override``), the platform (``platform.reset``) or the
tuning table (``tuning.record`` / ``tuning.load(refresh=True)``) change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ... import tuning
from ..._tilelang import compile_cached, tl, tl_dtype
from ...config import on_change, settings
from ...metadata import PagedKVMeta
from ...paged_layout import cache_rows, token_rows
from ...platform import features_of, get_platform
from .._common import check, constant_vector, per_kv_head
from .combine_kernel import build_combine
from .decode_kernel import build_decode
from .prefill_kernel import build_prefill
from .prefill_pingpong_kernel import build_prefill_pingpong
from .tl_common import GEMM_EXTENT_CHUNK, SLOT_TILES, head_parts

SUPPORTED_Q_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
DECODE_MAX_Q = 8  # longest per-request query the split-KV decode kernel takes (speculative verify)
MAX_SPLITS = 64

_plan_caches: list = []
_kernels: dict = {}  # (getter, arguments) -> compiled kernel, for launches on this platform's target


def _planned(fn):
    """``fn`` (a pure function of its arguments, the settings, the platform and the tuning table) computed once
    per distinct arguments until :func:`clear_plan_caches`."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _plan_caches.append(cached)
    return cached


def _kernel_handle(getter):
    """``getter`` (``prefill_kernel``, ...) with its kernels kept per arguments when built for this platform's
    target (``target=None``), so a launch skips the compile-cache key and lookup; until
    :func:`clear_plan_caches`."""
    @functools.wraps(getter)
    def get(*args, **kwargs):
        if kwargs.get("target") is not None:
            return getter(*args, **kwargs)
        key = (getter, args, tuple(kwargs.items()))
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = getter(*args, **kwargs)
        return kernel
    return get


def clear_plan_caches() -> None:
    """Empty the plan caches and kernel handles: the next launch of every shape class plans again."""
    for cached in _plan_caches:
        cached.cache_clear()
    _kernels.clear()
    _supported.clear()


on_change(clear_plan_caches)


def _alloc(shape, dtype, device) -> torch.Tensor:
    # MUSA_ATTN_POISON (a debug aid the tests turn on): NaN, so an element no kernel writes shows up instead of
    # holding stale memory
    if settings().poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class PrefillConfig:
    block_M: int
    block_N: int
    num_stages: int
    threads: int
    tma: bool = False  # key tiles copied as whole blocks of one page (bulk copy) instead of row gathers
    # explicit warp specialisation: a producer warp group and two consumer warp groups that take turns on the
    # tensor cores, with asynchronous MMAs overlapping the softmax (Hopper-class); the producer copies whole
    # tiles with TMA (tma=True) or gathers rows with cp.async (tma=False)
    pingpong: bool = False
    # TMA tiles copied in chunks of this many rows of a page, each through the page table (ping-pong only; pages
    # that are a multiple of it but hold no whole key tile, e.g. vLLM's 16); 0: one copy per tile
    tma_rows: int = 0


@dataclass(frozen=True)
class DecodeConfig:
    max_q: int
    block_M: int
    block_N: int
    num_stages: int
    threads: int
    # tiles whose cache rows are resolved at once (the pipeline restarts after each run); 0: the copies resolve
    # them inline, one pipeline over all the split's tiles (a tune_decode.py candidate only: TileLang makes
    # those copies synchronous; docs/kernel-choice.md)
    slot_tiles: int = SLOT_TILES
    # every run's pipeline has the fixed trip count slot_tiles (tiles past the split's end fully masked): what
    # lets TileLang lower 3+ stages (a tune_decode.py candidate only: deeper pipelines leave room for fewer
    # blocks per SM; docs/kernel-choice.md)
    full_runs: bool = False


_supported: set = set()  # (q dtype, head dims) that passed check_tilelang_supported


def check_tilelang_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    op = "paged_attention(impl='tilelang')"
    d, dv = q.shape[2], v_cache.shape[3]
    if (q.dtype, d, dv) in _supported:
        return
    check(q.dtype in SUPPORTED_Q_DTYPES, f"{op}: q dtype must be float16 or bfloat16, got {q.dtype}")
    for name, dim in (("head_dim", d), ("v head_dim", dv)):
        check(dim % 16 == 0 and 16 <= dim <= MAX_HEAD_DIM,
              f"{op}: {name} must be a multiple of 16 in [16, {MAX_HEAD_DIM}] (64, 96, 128, 256, ...), got {dim}")
    check_v_head_dim(op, dv)
    _supported.add((q.dtype, d, dv))
    # cache layout checks: cache_rows, called before any launch


def check_v_head_dim(op: str, dv: int, target=None) -> None:
    """Refuse a value head dim the ``P V`` GEMM of ``target`` (None: this platform's) cannot take whole: on a
    target without ``platform.gemm_any_extent`` (MUSA) the V tile's contiguous extent must be at most 128 or a
    multiple of 128. (The query/key head dim is cut into such parts instead: :func:`.tl_common.head_parts`.)"""
    check(features_of(target)["gemm_any_extent"] or dv <= GEMM_EXTENT_CHUNK or dv % GEMM_EXTENT_CHUNK == 0,
          lambda: f"{op}: v head_dim {dv} is not supported on this target (its GEMMs take a 16-bit operand whose "
                  f"contiguous extent is at most {GEMM_EXTENT_CHUNK} or a multiple of {GEMM_EXTENT_CHUNK}: v head "
                  f"dims 16-128 or 256)")


def _one_copy_stage(cfg, spec: "AttnSpec", d_parts: tuple, gathers: bool):
    """``cfg`` with one pipeline stage where its row gathers copy K and V in more than one loop a stage (head dims
    D != DV, or D cut in two): TileLang 0.1.15 mis-counts the cp.async groups of a pipelined stage that commits
    more than one, and does not generate the program ("Downcast from tirx.Sub to ir.IntImm"); the single-loop
    stages (D == DV) and whole-tile copies are unaffected. Else ``cfg`` itself."""
    if gathers and cfg.num_stages > 1 and (spec.d != spec.dv or d_parts):
        return dataclasses.replace(cfg, num_stages=1)
    return cfg


def _d_parts(d: int, target) -> tuple:
    """The build argument cutting head dim ``d`` for ``target``'s GEMMs (empty: not cut; see
    :func:`.tl_common.head_parts`)."""
    parts = head_parts(d, not features_of(target)["gemm_any_extent"])
    return parts if len(parts) > 1 else ()


def _stages(is_fp8: bool) -> int:
    # FP8 tiles are converted in shared memory; TileLang 0.1.15 mis-lowers the cp.async wait counts of a
    # two-stage pipeline with that conversion, so FP8 runs one stage (loads not overlapped with math).
    return 1 if is_fp8 else 2


def _prefill_tile(d: int, dv: int) -> int:
    return 128 if max(d, dv) <= 128 else 64


def prefill_shape_class(d: int, dv: int, is_fp8: bool, page_size: int, has_window: bool) -> str:
    """What a prefill tile choice depends on (besides the device): the key of its tuning-table entry."""
    pages = ("p128" if page_size % 128 == 0 else "p64" if page_size % 64 == 0 else "p16" if page_size % 16 == 0
             else "rows")
    return tuning.shape_key(d=d, dv=dv, fp8=int(is_fp8), window=int(has_window), pages=pages)


def pingpong_smem_fits(d: int, dv: int, block_N: int, num_stages: int, smem_per_sm: int) -> bool:
    """Whether the ping-pong prefill's tiles (two 64-row Q halves + ``num_stages`` K and V tiles, 16-bit) fit
    one block's shared memory: the SM's, less 1 KB the driver reserves per block and 1 KB for the barriers."""
    need = 2 * (128 * d + num_stages * block_N * (d + dv))
    return smem_per_sm > 0 and need + 2048 <= smem_per_sm


def prefill_smem_bytes(cfg: PrefillConfig, d: int, dv: int, is_fp8: bool, shared_p: bool) -> int:
    """Shared memory one block of the (not ping-pong) prefill kernel allocates: the query tile, ``num_stages``
    K and V tiles (FP8: FP8 staging tiles, plus one converted pair), the P tile with ``shared_p``, the
    resolved rows of the row gathers. Equal to TileLang's layout (0.1.12, sm_90a) for the tilings it was
    checked on (tests/attention/test_musa_portability.py)."""
    kv16 = cfg.block_N * (d + dv) * 2
    tiles = cfg.num_stages * kv16 // 2 + kv16 if is_fp8 else cfg.num_stages * kv16
    need = cfg.block_M * d * 2 + tiles + (cfg.block_M * cfg.block_N * 2 if shared_p else 0)
    return need + (0 if cfg.tma else SLOT_TILES * cfg.block_N * 4)


def prefill_smem_fits(cfg: PrefillConfig, d: int, dv: int, is_fp8: bool, shared_p: bool, smem_per_sm: int) -> bool:
    """Whether a prefill tiling fits one block's shared memory on a chip with ``smem_per_sm`` (0: unknown, taken
    to fit), less 1 KB the driver reserves per block and 1 KB for barriers."""
    return smem_per_sm <= 0 or prefill_smem_bytes(cfg, d, dv, is_fp8, shared_p) + 2048 <= smem_per_sm


def prefill_candidates(d: int, dv: int, is_fp8: bool = False, page_size: int = 1,
                       has_window: bool = False) -> list[PrefillConfig]:
    """Every prefill tiling valid for this shape class on this platform (what ``musa-attn tune`` tries), the
    default first."""
    return list(_prefill_candidates(d, dv, is_fp8, page_size, has_window))


@_planned
def _prefill_candidates(d: int, dv: int, is_fp8: bool, page_size: int, has_window: bool) -> tuple:
    plat = get_platform()
    opts = settings()
    tma_ok = plat.bulk_copy and not is_fp8 and not has_window
    # the ping-pong consumers keep P in registers for their asynchronous P V products
    pingpong_ok = tma_ok and plat.warp_specialized and plat.gemm_a_in_registers and d == dv and d in (64, 128)
    widths = sorted({_prefill_tile(d, dv), 64}, reverse=True)
    out = []
    # 128-key TMA tiles copied in page chunks (pages of 16s that hold no whole key tile). With 64-row chunks
    # (page 64) the default, ahead of 64-key whole-page tiles (faster than those and than the gathering
    # producer). With 16/32-row chunks (more, smaller copies from one producer thread, slower than the
    # gathering producer): tuning candidates only, last. Measurements: docs/kernel-choice.md
    chunk = next((r for r in (64, 32, 16) if page_size % r == 0), 0)
    chunked = []
    if pingpong_ok and opts.tma_chunks and page_size % 128 and chunk:
        chunked = [PrefillConfig(block_M=128, block_N=128, num_stages=stages, threads=384, tma=True, pingpong=True,
                                 tma_rows=chunk)
                   for stages in ((3, 2) if d == dv == 128 else (2, 3))
                   if stages == 2 or pingpong_smem_fits(d, dv, 128, stages, plat.smem_per_sm)]
    if chunk == 64:
        out += chunked
    for bn in widths:
        if pingpong_ok and page_size % bn == 0:
            # three stages where shared memory holds them (hd 128, 128-key tiles: 224 KB), where they were
            # measured faster than two, so first there; for the other tilings (not measured) a tuning
            # candidate after two
            three_first = d == dv == 128 and bn == 128
            for stages in ((3, 2) if three_first else (2, 3)):
                if stages == 2 or pingpong_smem_fits(d, dv, bn, stages, plat.smem_per_sm):
                    out.append(PrefillConfig(block_M=128, block_N=bn, num_stages=stages, threads=384, tma=True,
                                             pingpong=True))
    if pingpong_ok and opts.pingpong_gather:
        out.append(PrefillConfig(block_M=128, block_N=128, num_stages=2, threads=384, tma=False, pingpong=True))
    # the softmax probabilities go through a shared tile where the GEMMs take no register A (MUSA), which the
    # tilings must leave room for
    shared_p = not plat.gemm_a_in_registers
    for bn in widths:
        for tma in ((True, False) if tma_ok and page_size % bn == 0 else (False,)):
            for stages in ((2,) if tma else (1,) if is_fp8 else (2, 1)):
                cfg = PrefillConfig(block_M=128, block_N=bn, num_stages=stages, threads=256, tma=tma)
                if prefill_smem_fits(cfg, d, dv, is_fp8, shared_p, plat.smem_per_sm):
                    out.append(cfg)
    out += chunked if chunk != 64 else []
    check(bool(out), lambda: f"paged_attention: no prefill tiling of head dims {d}/{dv}"
                             f"{' (FP8 cache)' if is_fp8 else ''} fits the {plat.smem_per_sm // 1024} KB of shared "
                             f"memory of {plat.arch}")
    return tuple(out)


@_planned
def prefill_config(d: int, dv: int, is_fp8: bool = False, page_size: int = 1,
                   has_window: bool = False) -> PrefillConfig:
    """Prefill tiling: the tuning table's choice for this shape class on this device (``musa-attn tune``) if
    there is a valid one, else the default (the first whole-tile candidate of :func:`prefill_candidates`, else
    the first). On Hopper-class GPUs, for a bf16/fp16 cache without a window and head dim 64/128, that is the
    ping-pong kernel: with TMA tiles where pages hold whole 128-key tiles, from 64-row page chunks where pages
    are a multiple of 64, else with a gathering producer. Else, with a bulk-copy engine (TMA / TME) and the
    same cache conditions, one block copy per tile; else row gathers (128-key tiles up to head dim 128). The
    order follows the H200 measurements in docs/kernel-choice.md."""
    valid = _prefill_candidates(d, dv, is_fp8, page_size, has_window)
    tuned = tuning.lookup("prefill", prefill_shape_class(d, dv, is_fp8, page_size, has_window))
    if tuned:
        try:
            cfg = PrefillConfig(**tuned)
        except TypeError:
            cfg = None  # a table from another version of this package: ignore the entry
        if cfg in valid:
            return cfg
    # the default: the ping-pong kernel where the platform and pages allow it (it comes first), else the widest
    # TMA tiling, else the widest row gather
    return valid[0] if valid[0].pingpong else next((c for c in valid if c.tma and not c.tma_rows), valid[0])


@_planned
def decode_config(max_q: int, group: int, is_fp8: bool = False, dv: int = 128) -> Optional[DecodeConfig]:
    """A decode tiling for ``max_q`` tokens x ``group`` heads per KV head, or None (use prefill)."""
    if max_q > DECODE_MAX_Q:
        return None
    q_pad = 1 << (max_q - 1).bit_length()  # 1, 2, 4, 8: few compiled variants
    rows = q_pad * group
    if rows <= 16:
        # 16-row mma.sync tiles, warps splitting the columns: each warp needs 8+ output columns
        warps = max(1, min(4, dv // 8))
        return DecodeConfig(max_q=q_pad, block_M=16, block_N=64, num_stages=_stages(is_fp8), threads=32 * warps)
    if rows <= 64:
        return DecodeConfig(max_q=q_pad, block_M=64, block_N=64, num_stages=_stages(is_fp8), threads=128)
    if rows <= 128:
        return DecodeConfig(max_q=q_pad, block_M=128, block_N=64, num_stages=_stages(is_fp8), threads=256)
    return None


@_planned
def decode_ctas_per_sm(dcfg: DecodeConfig, d: int, dv: int, is_fp8: bool, smem_per_sm: int) -> int:
    """How many decode blocks of this tiling one SM holds at once (shared memory, registers, threads): an
    estimate from the tile buffers, for sizing the split-KV grid."""
    kv = dcfg.block_N * (d + dv)
    smem = dcfg.num_stages * kv * (1 if is_fp8 else 2) + (kv * 2 if is_fp8 else 0)  # (fp8: + converted tiles)
    shared_p = dcfg.block_M < 64 or not get_platform().gemm_a_in_registers
    smem += dcfg.block_M * d * 2 + (dcfg.block_M * dcfg.block_N * 2 if shared_p else 0)
    # resolved rows; reduction scratch; the per-block reserve. Checked against TileLang's layout of the
    # bf16 and FP8 16-row, 64-row and 128-row tilings (0.1.12, sm_90a): within 1 KB.
    smem += dcfg.slot_tiles * dcfg.block_N * 4 + 2048 + 1024
    regs = min(255, (dcfg.block_M * dv + dcfg.block_M * dcfg.block_N * 3 // 2) // dcfg.threads + 40)
    by_smem = (smem_per_sm or 228 * 1024) // smem
    return max(1, min(by_smem, 65536 // (regs * dcfg.threads), 2048 // dcfg.threads, 32))


SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the split counts measured (tune_decode.py)


@_planned
def num_splits_for(batch: int, num_kv_heads: int, max_seqlen_k: int, block_N: int, sm_count: int,
                   ctas_per_sm: int = 1) -> int:
    """Split count for split-KV decode, from a wave model: ``n = batch x kv heads x splits`` blocks run in
    ``ceil(n / slots)`` waves of ``slots = sm_count x ctas_per_sm`` resident blocks (a part-filled last wave
    costs a whole one); a wave takes (tiles per block) x (its resident blocks / 80% of the slots, at least 1:
    the share of the memory bandwidth each gets) + 1 tile of fixed cost. The fewest splits within 6% of the
    least modelled time win; each split keeps >= 2 tiles.

    The constants were fitted to an H200 sweep of split counts (``benchmarks/tune_decode.py``; the fit and
    the rule it replaced: docs/kernel-choice.md). Splitting once the blocks outnumber the SMs matters: a
    part-filled last wave costs a whole one."""
    blocks = max(1, batch * num_kv_heads)
    slots = max(1, sm_count * ctas_per_sm)
    tiles = max(1, math.ceil(max_seqlen_k / block_N))
    cost = {}
    for s in SPLIT_COUNTS:
        if s > 1 and (s > tiles // 2 or s > MAX_SPLITS):
            break
        n = blocks * s
        cost[s] = math.ceil(n / slots) * (math.ceil(tiles / s) * max(1.0, min(n, slots) / (0.8 * slots)) + 1)
    least = min(cost.values())
    return min(s for s, t in cost.items() if t <= 1.06 * least)


@dataclass(frozen=True)
class AttnSpec:
    """Everything a compiled attention kernel is specialised on (besides tiling and causal/split)."""

    hq: int
    hkv: int
    d: int
    dv: int
    q_dtype: str  # TileLang dtype names
    kv_dtype: str
    has_window: bool = False
    has_softcap: bool = False
    has_sinks: bool = False
    k_layout: tuple = ()  # (width, row stride, head stride) of the K cache rows
    v_layout: tuple = ()

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype.startswith("float8")

    @property
    def group(self) -> int:
        return self.hq // self.hkv


# the spec of a launch (the same object for the same arguments: one per shape class), and one with other K/V
# row layouts (the new-K/V prefill's)
_attn_spec = _planned(AttnSpec)
_with_layouts = _planned(lambda spec, k_layout, v_layout: dataclasses.replace(spec, k_layout=k_layout,
                                                                              v_layout=v_layout))


@_kernel_handle
def prefill_kernel(spec: AttnSpec, causal: bool, page_size: int = 1, target=None,
                   cfg: Optional[PrefillConfig] = None, ragged: bool = False):
    """The prefill/extend kernel for ``spec`` (``cfg``: a tiling, default :func:`prefill_config`). ``ragged``:
    the whole-tile TMA kernel reading the batch's new K/V rows instead of a paged cache (``spec``'s layouts are
    theirs; see :func:`new_kv_prefill_config`)."""
    cfg = cfg or prefill_config(spec.d, spec.dv, spec.is_fp8, page_size, spec.has_window)
    assert not ragged or (cfg.tma and not cfg.tma_rows), f"ragged: whole TMA tiles, not {cfg}"
    if cfg.pingpong:
        # fast math (exp2 as one ex2.approx.ftz, no denormal fix-ups): the softmax is what the tensor cores
        # wait on here, and the error stays the same (docs/kernel-choice.md)
        pc = {tl.PassConfigKey.TL_ENABLE_FAST_MATH: True}
        if not cfg.tma:
            # the gathering producer syncs its warp group itself (one named barrier per tile); TileLang's
            # automatic syncs would put one before every row copy
            pc[tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC] = True
            # and its bounds checks are redundant: rows are clamped into the sequence, page-table columns
            # into the table, output stores guarded by hand. Without them a 16-byte row copy is 7 PTX
            # instructions instead of 11, in warps that share issue slots with the softmax
            pc[tl.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS] = True
        check(features_of(target)["gemm_a_in_registers"],
              lambda: f"prefill_kernel: {cfg} keeps P in registers, which this target's GEMMs cannot read")
        return compile_cached(("prefill", spec, causal, cfg) + (("ragged",) if ragged else ()),
                              lambda: build_prefill_pingpong(
            spec.hq, spec.hkv, spec.d, spec.dv, spec.q_dtype, causal, spec.has_softcap, spec.has_sinks,
            spec.k_layout, spec.v_layout, cfg.block_N, cfg.num_stages, gather=not cfg.tma, tma_rows=cfg.tma_rows,
            ragged=ragged), target=target, pass_configs=pc)
    shared_p = _shared_p(target)
    check_v_head_dim("prefill_kernel", spec.dv, target)
    d_parts = _d_parts(spec.d, target)
    cfg = _one_copy_stage(cfg, spec, d_parts, gathers=not cfg.tma)
    return compile_cached(("prefill", spec, causal, cfg) + (("ragged",) if ragged else ())
                          + (("shared_p",) if shared_p else ()) + ((("d_parts", d_parts),) if d_parts else ()),
                          lambda: build_prefill(
        spec.hq, spec.hkv, spec.d, spec.dv, spec.q_dtype, spec.kv_dtype, causal, spec.has_window,
        spec.has_softcap, spec.has_sinks, spec.is_fp8, spec.k_layout, spec.v_layout,
        cfg.block_M, cfg.block_N, cfg.num_stages, cfg.threads, cfg.tma, ragged, shared_p, d_parts), target=target)


@_planned
def new_kv_prefill_config(d: int, dv: int, has_window: bool = False) -> Optional[PrefillConfig]:
    """The tiling for a prefill that reads the batch's new K/V rows (contiguous per request) instead of the
    paged cache: the whole-tile TMA tiling of pages of 128 (tuned or default; on Hopper the ping-pong kernel,
    on MUSA MP31 TME tiles) where this platform has bulk copies for these head dims, else None (the cache
    path)."""
    if has_window or not settings().new_kv_prefill:
        return None
    cfg = prefill_config(d, dv, False, 128, False)
    return cfg if cfg.tma and not cfg.tma_rows else None


def _new_kv_rows(new_kv, nt: int, hkv: int, d: int, dv: int, dtype: torch.dtype, op: str):
    """``(k_rows, v_rows, k_layout, v_layout)`` of the batch's new K/V ``[num_tokens, num_kv_heads, dim]``
    (any row stride), or None where they do not fit the TMA kernel (shape, dtype, alignment): the cache path."""
    if new_kv is None:
        return None
    out = []
    for x, w in zip(new_kv, (d, dv)):
        if x is None or x.dtype != dtype or x.shape[0] < nt or (x.dim() == 2 and x.shape[1] != hkv * w):
            return None
        if x.dim() == 2:  # [tokens, heads * dim], any row stride: heads lie dim elements apart
            s_tok, s_head, s_dim = x.stride(0), w, x.stride(1)
        elif tuple(x.shape[1:]) == (hkv, w):
            s_tok, s_head, s_dim = x.stride()
        else:
            return None
        try:  # rows nt.. (left over) are not part of the view; the cache's layout checks apply as they are
            out.append(token_rows(x, nt, s_tok, s_head, s_dim, hkv, w, "new K/V", op=op))
        except ValueError:
            return None
    (k_rows, k_layout), (v_rows, v_layout) = out
    return k_rows, v_rows, k_layout, v_layout


def _pdl(target) -> bool:
    """Programmatic dependent launch between the split-KV decode and its combine kernel: where the compile
    target has it (CUDA sm_90+; ``target``: None for this platform's, or one :func:`platform.parse_target`
    reads) and ``MUSA_ATTN_PDL`` allows it."""
    return settings().pdl and features_of(target)["dependent_launch"]


def _shared_p(target) -> bool:
    """Whether the attention programs for ``target`` (None: this platform's) stage P through shared memory:
    where its GEMMs read no A operand from registers, or ``MUSA_ATTN_SHARED_P`` asks for it."""
    return not features_of(target)["gemm_a_in_registers"]


@_kernel_handle
def decode_kernel(spec: AttnSpec, dcfg: DecodeConfig, split: bool, target=None):
    pdl = split and _pdl(target)
    shared_p = _shared_p(target)
    check_v_head_dim("decode_kernel", spec.dv, target)
    d_parts = _d_parts(spec.d, target)
    dcfg = _one_copy_stage(dcfg, spec, d_parts, gathers=True)
    return compile_cached(("decode", spec, split, dcfg) + (("pdl",) if pdl else ())
                          + (("shared_p",) if shared_p else ()) + ((("d_parts", d_parts),) if d_parts else ()),
                          lambda: build_decode(
        spec.hq, spec.hkv, spec.d, spec.dv, spec.q_dtype, spec.kv_dtype, dcfg.max_q, spec.has_window,
        spec.has_softcap, spec.has_sinks, spec.is_fp8, split, spec.k_layout, spec.v_layout,
        dcfg.block_M, dcfg.block_N, dcfg.num_stages, dcfg.threads, dcfg.slot_tiles, dcfg.full_runs, pdl,
        shared_p, d_parts), target=target)


@_kernel_handle
def combine_kernel(spec: AttnSpec, target=None):
    pdl = _pdl(target)
    # the split loop in chunks of 8 with their loads in flight together (default; MUSA_ATTN_CHUNKED_COMBINE)
    max_splits = MAX_SPLITS if settings().chunked_combine else 0
    return compile_cached(("combine", spec.hq, spec.dv, spec.q_dtype, spec.has_sinks) + (("pdl",) if pdl else ())
                          + ((("splits", max_splits),) if max_splits else ()),
                          lambda: build_combine(spec.hq, spec.dv, spec.q_dtype, spec.has_sinks, pdl=pdl,
                                                  max_splits=max_splits), target=target)


def paged_attention_tilelang(q, k_cache, v_cache, meta, *, causal=True, sm_scale=None, sliding_window=None,
                             logit_softcap=None, sinks=None, k_scale=None, v_scale=None, return_lse=False,
                             new_kv=None, out: Optional[torch.Tensor] = None,
                             prefill_cfg: Optional[PrefillConfig] = None):
    """The TileLang path of :func:`musa_attn_backend.kernels.paged_attention` (``out``: the caller's output,
    checked there, written in place; ``prefill_cfg``: force a prefill tiling, for the tuner)."""
    check_tilelang_supported(q, k_cache, v_cache)
    q = q.contiguous()
    nt, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    dev = q.device
    op = "paged_attention(impl='tilelang')"
    k_rows, k_layout = cache_rows(k_cache, "k_cache", op=op)
    v_rows, v_layout = cache_rows(v_cache, "v_cache", op=op)
    spec = _attn_spec(hq, hkv, d, dv, tl_dtype(q.dtype), tl_dtype(k_cache.dtype), sliding_window is not None,
                      logit_softcap is not None, sinks is not None, k_layout, v_layout)
    if prefill_cfg is not None:
        valid = prefill_candidates(d, dv, spec.is_fp8, meta.page_size, spec.has_window)
        check(prefill_cfg in valid, f"{op}: prefill_cfg {prefill_cfg} is not valid for head dims {d}/{dv}, page size "
                                    f"{meta.page_size}, this cache and platform; valid: {valid}")
    scalars = (
        sinks.float().contiguous() if spec.has_sinks else constant_vector("zeros", hq, dev),
        per_kv_head(k_scale if spec.is_fp8 else None, hkv, dev),
        per_kv_head(v_scale if spec.is_fp8 else None, hkv, dev),
        float(sm_scale) if sm_scale is not None else d ** -0.5,
        float(logit_softcap) if spec.has_softcap else 0.0,
        int(sliding_window) if spec.has_window else 0,
    )
    if out is None:
        out = _alloc((nt, hq, dv), q.dtype, dev)
    else:  # the kernels index O as a contiguous [nt, hq, dv]: anything else would be written wrongly
        check(tuple(out.shape) == (nt, hq, dv) and out.dtype == q.dtype and out.device == dev
              and out.is_contiguous(), f"{op}: out must be a contiguous [{nt}, {hq}, {dv}] {q.dtype} tensor on {dev}")
    lse = _alloc((nt, hq), torch.float32, dev)
    if nt == 0:
        return (out, lse) if return_lse else out

    def args(m: PagedKVMeta, qq: torch.Tensor, kv=None):
        return (qq, *(kv or (k_rows, v_rows)), m.cu_seqlens_q, m.seqlens_k, m.page_table, *scalars, m.page_size)

    # a batch (or the part after its leading decodes) in which no request has a cached prefix: its keys are
    # the new tokens, contiguous per request, so whole-tile TMA copies of them serve any page size
    ncfg = new_kv_prefill_config(d, dv, spec.has_window) if new_kv is not None and meta.new_kv_only \
        and not spec.is_fp8 and prefill_cfg is None else None
    nkv = _new_kv_rows(new_kv, nt, hkv, d, dv, q.dtype, op) if ncfg is not None else None

    def run_prefill(m: PagedKVMeta, cfg=None):
        # the flag covers the requests after the leading decodes: a batch that still holds them (not split,
        # e.g. not causal) reads the cache
        if nkv is not None and m.new_kv_only and m.num_decodes == 0:
            nspec = _with_layouts(spec, nkv[2], nkv[3])
            prefill_kernel(nspec, causal, m.page_size, cfg=ncfg, ragged=True)(
                *args(m, q, nkv[:2]), int(m.max_seqlen_q), out, lse)
        else:
            prefill_kernel(spec, causal, m.page_size, cfg=cfg)(*args(m, q), int(m.max_seqlen_q), out, lse)

    def run_decode(m: PagedKVMeta, dcfg: DecodeConfig, qq, oo, ll):
        plat = get_platform()
        splits = num_splits_for(m.batch_size, hkv, m.max_seqlen_k, dcfg.block_N, plat.sm_count or 132,
                                decode_ctas_per_sm(dcfg, d, dv, spec.is_fp8, plat.smem_per_sm))
        if splits == 1:
            decode_kernel(spec, dcfg, split=False)(*args(m, qq), 1, oo, ll)
        else:
            o_part = _alloc((splits, qq.shape[0], hq, dv), torch.float32, dev)
            l_part = _alloc((splits, qq.shape[0], hq), torch.float32, dev)
            decode_kernel(spec, dcfg, split=True)(*args(m, qq), splits, o_part, l_part)
            combine_kernel(spec)(o_part, l_part, scalars[0], oo, ll)

    dcfg = decode_config(meta.max_seqlen_q, spec.group, spec.is_fp8, spec.dv) if causal else None
    nd = meta.num_decodes if causal and prefill_cfg is None and settings().split_mixed else 0
    one = decode_config(1, spec.group, spec.is_fp8, spec.dv) if 0 < nd < meta.batch_size else None
    if dcfg is not None and prefill_cfg is None:
        run_decode(meta, dcfg, q, out, lse)
    elif one is not None:
        # decodes first (rows 0..nd-1 of q): the decode kernel for them, the prefill kernel for the rest; both
        # index q / out by absolute row, so they write disjoint rows of the same output. The two sub-batches'
        # metadata is built once per batch, not once per layer.
        decodes, rest = meta.decode_split()
        run_decode(decodes, one, q[:nd], out[:nd], lse[:nd])
        run_prefill(rest)
    else:
        run_prefill(meta, prefill_cfg)
    return (out, lse) if return_lse else out
