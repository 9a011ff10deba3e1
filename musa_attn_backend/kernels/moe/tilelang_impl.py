"""Launch the TileLang MoE grouped GEMMs (arguments checked by :mod:`musa_attn_backend.kernels.moe`)."""

from __future__ import annotations

import re

import torch

from .._common import check
from ..._tilelang import compile_cached, tilelang_version, tl
from ...platform import features_of
from .combine_kernel import build_combine_experts
from .contiguous_fp4_fp8_kernel import build_grouped_gemm_contiguous_fp4_fp8
from .contiguous_kernel import build_grouped_gemm_contiguous_fp4
from .contiguous_kernel import build_grouped_gemm_contiguous
from .contiguous_swiglu_kernel import build_grouped_gemm_swiglu_contiguous
from .layer import _rows_fp8
from .masked_fp4_fp8_kernel import build_grouped_gemm_masked_fp4_fp8
from .masked_kernel import build_grouped_gemm_masked_fp4
from .masked_kernel import build_grouped_gemm_masked
from .masked_swiglu_kernel import build_grouped_gemm_swiglu_masked
from .quantize_scatter_kernel import build_quantize_scatter
from .route_masked_kernel import build_route_masked
from .reference import ALIGN
from .swiglu_quant_kernel import build_swiglu_quant

# the tilings: the contiguous layout's tile is 128 rows (its alignment); masked decode batches are small, so 64.
# Contiguous: each consumer warp group takes 64 whole rows of the tile (FullRow: one m64n128 WGMMA a k-slice),
# four stages, three from LARGE_M_STAGES' row count on (bench_moe.py's tiling runs: docs/moe.md)
CONTIGUOUS = dict(block_n=128, num_stages=4, threads=256, policy="FullRow")
LARGE_M_STAGES = (98304, 3)
# masked: 64-column weight panels (twice the blocks of 128 at decode sizes, where an expert has few rows and the
# grid is otherwise too small to keep every SM reading weights; bench_moe.py --masked-tiling, docs/moe.md)
MASKED = dict(block_m=64, block_n=64, num_stages=4, threads=128)
# FP4 weights, by how the programs read and convert them ("packing"): "bytes" or "words" (the same memory as int32
# words, eight values converted at a time), both to bf16 for a bf16 GEMM; "fp8", words moved to e4m3 for FP8
# tensor cores (masked_fp4_fp8_kernel.py, contiguous_fp4_fp8_kernel.py; tiled by *_FP4_FP8: swapped, block_m
# rows). The defaults are the fastest measured (bench_moe.py's forms columns: docs/moe.md). Contiguous "auto":
# "fp8" while the layout holds at most FP4_FP8_MAX_ROWS_PER_EXPERT rows an expert (each 16-row slice of a tile
# converts the expert's weights again, so the form pays off for few rows an expert), "words" above
FP4_PACKINGS = ("bytes", "words", "fp8")
MASKED_FP4 = dict(block_m=64, block_n=128, num_stages=2, threads=128, packing="fp8")
MASKED_FP4_FP8 = dict(block_m=16, block_n=128, num_stages=4, spans=2, threads=128)
CONTIGUOUS_FP4 = dict(block_n=128, num_stages=2, threads=256, packing="auto")
CONTIGUOUS_FP4_FP8 = dict(block_m=16, block_n=128, num_stages=4, spans=2, threads=128)
FP4_FP8_MAX_ROWS_PER_EXPERT = 32
SWIGLU_QUANT = dict(groups=4, threads=128)
CONTIGUOUS_SWIGLU = dict(num_stages=3, threads=256)
MASKED_SWIGLU = dict(num_stages=3, threads=256)


def _fp4_pass_configs() -> dict:
    """The FP4 programs are pipelined by every thread, without TileLang's warp specialisation: its producer
    released the scale bytes' shared slot when the consumers had finished converting the A tile, not the weights
    that read them, so the next stage's scales overwrote a slot still being read (wrong results on the H200 with
    TileLang 0.1.15)."""
    return {tl.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def _kernel(name: str, build, tiling: dict, args: tuple, target, overrides: dict, pass_configs=None):
    """``build(*args, **tiling)`` compiled once per (name, args, tiling, target); ``overrides`` replace entries
    of the default ``tiling``."""
    cfg = {**tiling, **overrides}
    return compile_cached((name, *args, *sorted(cfg.items())), lambda: build(*args, **cfg), target=target,
                          pass_configs=pass_configs)


def _limit(limit):
    return None if limit is None else float(limit)


def contiguous_kernel(N: int, K: int, target=None, **tiling):
    """The contiguous FP8 program under ``CONTIGUOUS`` with ``tiling``'s overrides. ``persistent`` (a block count)
    takes the persistent form, which TileLang 0.1.15 lowers and 0.1.12 cannot (refused here with the reason);
    its pipeline is synchronised by its own barriers (:func:`.contiguous_kernel._persistent_body`)."""
    cfg = {**CONTIGUOUS, **tiling}
    if not cfg.get("persistent"):
        return _kernel("moe_fp8_contiguous", build_grouped_gemm_contiguous, CONTIGUOUS, (N, K), target, tiling)
    check(_tl_version() >= (0, 1, 15), lambda: f"grouped_gemm_fp8: the persistent contiguous program needs "
                                               f"TileLang >= 0.1.15 (a pipeline inside a loop under warp "
                                               f"specialisation), this is {tilelang_version()}; set persistent=0")
    return _kernel("moe_fp8_contiguous", build_grouped_gemm_contiguous, CONTIGUOUS, (N, K), target, tiling,
                   pass_configs={tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})


def _tl_version() -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", tilelang_version())[:3])


def masked_kernel(N: int, K: int, target=None, **tiling):
    # 256 threads where the target prints no float vector wider than 8 lanes (MUSA: platform.wide_float_vectors):
    # with 128, its vectoriser makes the rescale of the accumulator by the rows' scales 16 lanes wide
    forms = {} if features_of(target)["wide_float_vectors"] else {"threads": 256}
    return _kernel("moe_fp8_masked", build_grouped_gemm_masked, MASKED, (N, K), target, {**forms, **tiling})


def _fp4_kernel(name: str, build, tiling_default: dict, build_fp8, tiling_fp8: dict, args: tuple, target,
                tiling: dict):
    """An FP4 program under ``tiling_default``'s ``packing`` (or ``tiling``'s): ``bytes`` or ``words``, ``build``
    (the weights converted to bf16); ``fp8``, ``build_fp8`` tiled by ``tiling_fp8`` (the weights read as words and
    converted to e4m3 for FP8 tensor cores). Both built without warp specialisation."""
    packing = {**tiling_default, **tiling}["packing"]
    if packing not in FP4_PACKINGS:
        raise ValueError(f"{name}: packing must be one of {FP4_PACKINGS}, got {packing!r}")
    if packing == "fp8":
        # one span a step where the target's GEMMs read whole tiles only (MUSA: platform.gemm_tile_slices)
        forms = {} if features_of(target)["gemm_tile_slices"] else {"spans": 1}
        return _kernel(f"{name}_fp8", build_fp8, tiling_fp8, args, target,
                       {**forms, **{k: v for k, v in tiling.items() if k != "packing"}}, _fp4_pass_configs())
    return _kernel(name, build, tiling_default, args, target, tiling, _fp4_pass_configs())


def contiguous_fp4_kernel(N: int, K: int, target=None, **tiling):
    """The contiguous FP4 program (:func:`_fp4_kernel`: contiguous_kernel.py, contiguous_fp4_fp8_kernel.py);
    ``auto`` is resolved by the caller, who knows the layout's size (:func:`_contiguous_fp4_overrides`)."""
    return _fp4_kernel("moe_fp4_contiguous", build_grouped_gemm_contiguous_fp4, CONTIGUOUS_FP4,
                       build_grouped_gemm_contiguous_fp4_fp8, CONTIGUOUS_FP4_FP8, (N, K), target, tiling)


def masked_fp4_kernel(N: int, K: int, target=None, **tiling):
    """The masked FP4 program (:func:`_fp4_kernel`: masked_kernel.py, masked_fp4_fp8_kernel.py)."""
    return _fp4_kernel("moe_fp4_masked", build_grouped_gemm_masked_fp4, MASKED_FP4,
                       build_grouped_gemm_masked_fp4_fp8, MASKED_FP4_FP8, (N, K), target, tiling)


def swiglu_quant_kernel(I: int, limit, target=None, **tiling):
    return _kernel("moe_swiglu_quant", build_swiglu_quant, SWIGLU_QUANT, (I, _limit(limit)), target, tiling)


def contiguous_swiglu_kernel(I: int, K: int, limit, target=None, **tiling):
    return _kernel("moe_fp8_contiguous_swiglu", build_grouped_gemm_swiglu_contiguous, CONTIGUOUS_SWIGLU,
                   (I, K, _limit(limit)), target, tiling)


def masked_swiglu_kernel(I: int, K: int, limit, target=None, **tiling):
    return _kernel("moe_fp8_masked_swiglu", build_grouped_gemm_swiglu_masked, MASKED_SWIGLU, (I, K, _limit(limit)),
                   target, tiling)


def combine_kernel(H: int, k: int, target=None, **tiling):
    # the widest block H allows (H: a multiple of 128), 8 columns a thread: one 16-byte load a row
    block = max(b for b in (1024, 512, 256, 128) if H % b == 0)
    return _kernel("moe_combine", build_combine_experts, {"block": block, "threads": block // 8}, (H, k), target,
                   tiling)


def quantize_scatter_kernel(H: int, k: int, target=None, **tiling):
    return _kernel("moe_quantize_scatter", build_quantize_scatter, {}, (H, k), target, tiling)


def route_masked_kernel(E: int, k: int, ids_dtype: str, weights_dtype: str, has_map: bool, target=None, **tiling):
    return _kernel("moe_route_masked", build_route_masked, {}, (E, k, ids_dtype, weights_dtype, has_map), target,
                   tiling)


def route_masked_tilelang(ids, weights, E, expert_map):
    """``(slot [T, k] int32, weights [T, k] float32, counts [E] int32)`` in one launch."""
    T, k = ids.shape
    dev = ids.device
    slot = torch.empty(T, k, dtype=torch.int32, device=dev)
    merged = torch.empty(T, k, dtype=torch.float32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    emap = expert_map
    if emap is None:  # the program reads no map then: one uninitialised entry per device, made once
        emap = _NO_MAP.get(dev)
        if emap is None:
            emap = _NO_MAP[dev] = torch.empty(1, dtype=torch.int32, device=dev)
    route_masked_kernel(E, k, str(ids.dtype).split(".")[-1], str(weights.dtype).split(".")[-1],
                        expert_map is not None)(ids, weights, emap, slot, merged, counts)
    return slot, merged, counts


_NO_MAP: dict = {}  # a one-entry map per device for calls without one (the program does not read it then)


def quantize_scatter_tilelang(x, dest, rows):
    """``(a, sa)`` with ``rows`` rows (uninitialised where no destination names them)."""
    a, sa = _rows_fp8((rows,), x.shape[1], x.device)
    if x.shape[0] and rows:
        quantize_scatter_kernel(x.shape[1], dest.shape[1])(x, dest, a, sa)
    return a, sa


def combine_tilelang(y, rows, weights, out):
    if out.shape[0]:
        combine_kernel(y.shape[1], rows.shape[1])(y, rows, weights, out)
    return out


def _fp4_scales(b_scale) -> dict:
    return {"scale_dtype": "float32"} if b_scale.dtype == torch.float32 else {}


def _fp4_bytes(b, tiling: dict):
    """The packed weights as the FP4 programs under ``tiling`` read them: the bytes, or ("words", "fp8") the same
    memory as int32 words (contiguous, ``K / 2`` a multiple of 64: no copy)."""
    return b.view(torch.int32) if tiling.get("packing") in ("words", "fp8") else b


def _contiguous_fp4_overrides(M: int, E: int) -> dict:
    """The contiguous FP4 program's ``packing`` for a layout of ``M`` rows over ``E`` experts (host values, no
    sync): ``CONTIGUOUS_FP4``'s, or under ``auto`` the rule above, the layout's choices bounded by
    ``M - E * (ALIGN - 1)`` (:func:`.reference.align_routing` sizes it for the worst routing)."""
    packing = CONTIGUOUS_FP4["packing"]
    if packing == "auto":
        packing = "fp8" if M - E * (ALIGN - 1) <= FP4_FP8_MAX_ROWS_PER_EXPERT * E else "words"
    return {"packing": packing}


def _contiguous_overrides(M: int) -> dict:
    """The contiguous FP8 tiling's overrides for ``M`` rows of A (a host value: the layout's size, no sync)."""
    return {} if LARGE_M_STAGES is None or M < LARGE_M_STAGES[0] else {"num_stages": LARGE_M_STAGES[1]}


def grouped_gemm_contiguous_tilelang(a, a_scale, b, b_scale, grouped_layout, out, fp4=False):
    if a.shape[0]:
        if fp4:
            tiling = _contiguous_fp4_overrides(a.shape[0], b.shape[0])
            contiguous_fp4_kernel(b.shape[1], a.shape[1], **_fp4_scales(b_scale), **tiling)(
                a, a_scale, _fp4_bytes(b, tiling), b_scale, grouped_layout, out)
        else:
            contiguous_kernel(b.shape[1], a.shape[1], **_contiguous_overrides(a.shape[0]))(
                a, a_scale, b, b_scale, grouped_layout, out)
    return out


def grouped_gemm_masked_tilelang(a, a_scale, b, b_scale, masked_m, out, fp4=False):
    if a.shape[1]:
        if fp4:
            masked_fp4_kernel(b.shape[1], a.shape[2], **_fp4_scales(b_scale))(
                a, a_scale, _fp4_bytes(b, MASKED_FP4), b_scale, masked_m, out)
        else:
            masked_kernel(b.shape[1], a.shape[2])(a, a_scale, b, b_scale, masked_m, out)
    return out


def swiglu_quant_tilelang(h, rows, limit, out):
    q, s = out
    if rows.numel() and h.shape[0]:
        swiglu_quant_kernel(h.shape[1] // 2, limit)(h, rows.to(torch.int32), q, s)
    return q, s


def grouped_gemm_swiglu_contiguous_tilelang(a, a_scale, w13, w13_scale, grouped_layout, limit, out):
    q, s = out
    if a.shape[0]:
        contiguous_swiglu_kernel(w13.shape[1] // 2, a.shape[1], limit)(a, a_scale, w13, w13_scale, grouped_layout,
                                                                       q, s)
    return q, s


def grouped_gemm_swiglu_masked_tilelang(a, a_scale, w13, w13_scale, masked_m, limit, out):
    q, s = out
    if a.shape[1]:
        masked_swiglu_kernel(w13.shape[1] // 2, a.shape[2], limit)(a, a_scale, w13, w13_scale, masked_m, q, s)
    return q, s
