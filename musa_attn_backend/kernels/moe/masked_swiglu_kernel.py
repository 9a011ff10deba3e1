"""TileLang program: GEMM1 of the routed experts with V4's SwiGLU and GEMM2's FP8 quantisation in its epilogue,
masked layout (the rule: :func:`.layer.grouped_gemm_swiglu_masked_reference`): for ``m < masked_m[e]`` (clamped to
``[0, max_m]``), ``Q[e, m]`` and ``S[e, m]`` are the 1 x 128 quantisation of ``silu(min(gate, L)) * clamp(up, -L,
L)`` for ``h = bf16((A[e, m] * a_scale[e, m]) @ (W13_e * w13_scale_e)^T) = [gate | up]``.

The tile, the two weight copies per K step, the split of the halves between the two consumer warp groups and the
epilogue are the contiguous program's (:mod:`.contiguous_swiglu_kernel`); the blocks are the masked GEMM's
(:mod:`.masked_kernel`): fixed shapes, ``masked_m`` read on the device only, a block past ``masked_m[e]`` exits
before reading anything, rows past it are not written. The rows' scales are held in registers by the threads
holding those rows (two consumer warp groups would race on a shared-memory copy).
"""

import functools
from typing import Optional

from ..._tilelang import tl_lang as T
from .swiglu_tir import gemm1_swiglu_tile

FP8 = "float8_e4m3"
ACC = "float32"


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_swiglu_masked(I: int, K: int, limit: Optional[float], num_stages: int = 3,
                                     threads: int = 256):
    """``I``: the intermediate size, ``K``: the hidden size (multiples of 128); ``limit``: V4's clamp (None:
    plain SwiGLU). The expert count and ``max_m`` are dynamic."""
    block_m, group = 64, 128
    E, MM = T.dynamic("experts"), T.dynamic("max_m")
    tile, KS, G = gemm1_swiglu_tile(I, K, limit, num_stages, masked=True, block_m=block_m, group=group)

    @T.prim_func
    def grouped_gemm_swiglu_masked(
        A: T.Tensor((E, MM, K), FP8),
        SA: T.Tensor((E, MM, KS), ACC),
        B: T.Tensor((E, 2 * I, K), FP8),
        SB: T.Tensor((E, 2 * G, KS), ACC),
        masked_m: T.Tensor((E,), "int32"),
        Q: T.Tensor((E, MM, I), FP8),
        S: T.Tensor((E, MM, G), ACC),
    ):
        with T.Kernel(G, T.ceildiv(MM, block_m), E, threads=threads) as (bx, by, e):
            sc = T.alloc_fragment((block_m,), ACC)
            q = T.alloc_fragment((block_m, group), FP8)

            rows = T.min(T.max(masked_m[e], 0), MM)
            row0 = by * block_m
            if row0 < rows:
                tile(A, SA, B, SB, e, row0, rows, MM - 1, bx, sc, q)
                for i, j in T.Parallel(block_m, group):
                    if row0 + i < rows:
                        Q[e, row0 + i, bx * group + j] = q[i, j]
                for i in T.Parallel(block_m):
                    if row0 + i < rows:
                        S[e, row0 + i, bx] = sc[i]

    return grouped_gemm_swiglu_masked
