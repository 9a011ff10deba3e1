"""Launch the TileLang MoE grouped GEMMs (arguments checked by :mod:`musa_attn_backend.kernels.moe`)."""

from __future__ import annotations

import torch

from ..._tilelang import compile_cached
from .contiguous_fp4_kernel import build_grouped_gemm_contiguous_fp4
from .contiguous_kernel import build_grouped_gemm_contiguous
from .masked_fp4_kernel import build_grouped_gemm_masked_fp4
from .masked_kernel import build_grouped_gemm_masked

# the tilings: the contiguous layout's tile is 128 rows (its alignment); masked decode batches are small, so 64
CONTIGUOUS = dict(block_n=128, num_stages=4, threads=256, policy="Square")
MASKED = dict(block_m=64, block_n=128, num_stages=4, threads=128)
MASKED_FP4 = dict(block_m=64, block_n=128, num_stages=2, threads=128)
CONTIGUOUS_FP4 = dict(block_n=128, num_stages=2, threads=256)


def contiguous_kernel(N: int, K: int, target=None, **tiling):
    cfg = {**CONTIGUOUS, **tiling}
    key = ("moe_fp8_contiguous", N, K, *sorted(cfg.items()))
    return compile_cached(key, lambda: build_grouped_gemm_contiguous(N, K, **cfg), target=target)


def masked_kernel(N: int, K: int, target=None, **tiling):
    cfg = {**MASKED, **tiling}
    key = ("moe_fp8_masked", N, K, *sorted(cfg.items()))
    return compile_cached(key, lambda: build_grouped_gemm_masked(N, K, **cfg), target=target)


def contiguous_fp4_kernel(N: int, K: int, target=None, **tiling):
    cfg = {**CONTIGUOUS_FP4, **tiling}
    key = ("moe_fp4_contiguous", N, K, *sorted(cfg.items()))
    return compile_cached(key, lambda: build_grouped_gemm_contiguous_fp4(N, K, **cfg), target=target)


def masked_fp4_kernel(N: int, K: int, target=None, **tiling):
    cfg = {**MASKED_FP4, **tiling}
    key = ("moe_fp4_masked", N, K, *sorted(cfg.items()))
    return compile_cached(key, lambda: build_grouped_gemm_masked_fp4(N, K, **cfg), target=target)


def grouped_gemm_contiguous_tilelang(a, a_scale, b, b_scale, grouped_layout, out, fp4=False):
    if a.shape[0]:
        build = contiguous_fp4_kernel if fp4 else contiguous_kernel
        build(b.shape[1], a.shape[1])(a, a_scale, b, b_scale, grouped_layout, out)
    return out


def grouped_gemm_masked_tilelang(a, a_scale, b, b_scale, masked_m, out, fp4=False):
    if a.shape[1]:
        build = masked_fp4_kernel if fp4 else masked_kernel
        build(b.shape[1], a.shape[2])(a, a_scale, b, b_scale, masked_m, out)
    return out
