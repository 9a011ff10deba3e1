"""TileLang program: GEMM1 of the routed experts with V4's SwiGLU and GEMM2's FP8 quantisation in its epilogue,
contiguous layout (the rule: :func:`.layer.grouped_gemm_swiglu_contiguous_reference`): for the expert ``e`` of row
``m``'s 128-row tile and ``I`` the intermediate size::

    h        = bf16((A[m] * a_scale[m]) @ (W13_e * w13_scale_e)^T)     # [2I]: gate = h[:I], up = h[I:]
    act      = silu(min(gate, L)) * clamp(up, -L, L)                   # float32
    S[m, g]  = max(amax(act[128 g : 128 g + 128]), 1e-4) / 448
    Q[m, c]  = e4m3(act[c] / S[m, c / 128])

so the ``[M, 2I]`` bf16 output of GEMM1 never goes to memory: GEMM2 reads ``Q`` and ``S``.

A block computes 64 rows (half a layout tile) of one 128-column group of ``act``: its weight tile is the group's
128 gate rows and the matching 128 up rows of ``W13_e`` (two copies into one ``[256, 128]`` shared tile per K step),
so the SwiGLU and the group's amax need nothing from another block. The two consumer warp groups split the tile's
columns (``FullCol``: one the gate half, one the up half, an m64n128 WGMMA each), so each holds 64 x 128 float32
twice (the K step's product and the accumulator), as the plain GEMM does; the promotion scales the gate and up
halves by their own weight-block scales. The epilogue rounds the accumulator to bf16 into shared memory (the
halves meet there), then every thread computes SwiGLU, the row's group amax, the scale and the e4m3 codes
(IEEE divisions, as torch's). The layout's rules are the plain program's (:mod:`.contiguous_kernel`), with the
same branch structure for TileLang's warp specialisation: rows whose id is another expert get NaN codes and a
NaN scale, ``-1`` rows and rows past ``M`` are not written, an invalid tile reads no weight.
"""

import functools
from typing import Optional

from ..._tilelang import tl_lang as T
from .swiglu_tir import gemm1_swiglu_tile

FP8 = "float8_e4m3"
ACC = "float32"


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_swiglu_contiguous(I: int, K: int, limit: Optional[float], num_stages: int = 3,
                                         threads: int = 256):
    """``I``: the intermediate size, ``K``: the hidden size (multiples of 128); ``limit``: V4's clamp (None:
    plain SwiGLU). ``M`` and the expert count are dynamic."""
    block_m, group = 64, 128
    M, E = T.dynamic("m"), T.dynamic("experts")
    tile, KS, G = gemm1_swiglu_tile(I, K, limit, num_stages, masked=False, block_m=block_m, group=group)

    @T.prim_func
    def grouped_gemm_swiglu_contiguous(
        A: T.Tensor((M, K), FP8),
        SA: T.Tensor((M, KS), ACC),
        B: T.Tensor((E, 2 * I, K), FP8),
        SB: T.Tensor((E, 2 * G, KS), ACC),
        layout: T.Tensor((M,), "int32"),
        Q: T.Tensor((M, I), FP8),
        S: T.Tensor((M, G), ACC),
    ):
        with T.Kernel(G, T.ceildiv(M, block_m), threads=threads) as (bx, by):
            sc = T.alloc_fragment((block_m,), ACC)
            q = T.alloc_fragment((block_m, group), FP8)

            NAN_FP8 = T.reinterpret(T.uint8(0x7F), FP8)
            NAN_F32 = T.reinterpret(T.uint32(0x7FC00000), ACC)
            row0 = by * block_m
            tile0 = row0 - row0 % 128  # the layout tile's first row: its id is the tile's expert
            if T.And(layout[tile0] >= 0, layout[tile0] < E):
                tile(A, SA, B, SB, layout[tile0], row0, M, M - 1, bx, sc, q)
                for i, j in T.Parallel(block_m, group):
                    if row0 + i < M:
                        if layout[row0 + i] >= 0:
                            Q[row0 + i, bx * group + j] = T.if_then_else(layout[row0 + i] == layout[tile0], q[i, j],
                                                                         NAN_FP8)
                for i in T.Parallel(block_m):
                    if row0 + i < M:
                        if layout[row0 + i] >= 0:
                            S[row0 + i, bx] = T.if_then_else(layout[row0 + i] == layout[tile0], sc[i], NAN_F32)
            else:
                for i, j in T.Parallel(block_m, group):
                    if row0 + i < M:
                        if layout[row0 + i] >= 0:
                            Q[row0 + i, bx * group + j] = NAN_FP8
                for i in T.Parallel(block_m):
                    if row0 + i < M:
                        if layout[row0 + i] >= 0:
                            S[row0 + i, bx] = NAN_F32

    return grouped_gemm_swiglu_contiguous
