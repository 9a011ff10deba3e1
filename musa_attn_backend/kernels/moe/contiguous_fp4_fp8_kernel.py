"""TileLang program: the contiguous grouped GEMM with FP4 (MXFP4) expert weights on FP8 tensor cores (the rule
and the formats: :mod:`.reference`; the layout's rules: :mod:`.contiguous_kernel`)::

    D[m, n] = sum_k (A[m, k] * a_scale[m, k / 128]) * (E2M1(B[e, n, k]) * 2^(s[e, n, k / 32] - 127))

for ``e`` the expert of row ``m``'s 128-row tile (its first row's id).

The masked FP8-tensor-core program's loop (:mod:`.masked_fp4_fp8_kernel`: the weights moved to e4m3 by bit
operations, one FP8 GEMM per 32 values of K rescaled by the weight row's and the activation row's scales,
swapped so the weights are the GEMM's M side) over ``block_m`` rows of the layout: a block is a slice of one
128-row tile. The layout's rules hold per row: a row of the tile's expert gets its product, a row of another
expert NaN, a padding row (``-1``) nothing; in a tile whose expert is out of range every non-padding row is NaN.
A slice with no row of its tile's expert (a tile's padding) computes nothing.
"""

import functools

from ..._tilelang import tl_lang as T
from .fp4_tir import SPAN, SPAN_WORDS, fp8_mma_buffers, fp8_mma_step, staged_chunk
from .reference import ALIGN as TILE  # the layout's alignment: a tile's expert is its first row's

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"
E2M1_OVER_E4M3 = 64.0


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_contiguous_fp4_fp8(N: int, K: int, block_m: int = 16, block_n: int = 128,
                                          num_stages: int = 4, spans: int = 2, threads: int = 128,
                                          scale_dtype: str = "uint8", chunk: int = 32):
    """``N``, ``K``: the weights' logical shape (multiples of 128); ``B`` is read as int32 words (the masked
    program's); ``M`` and the expert count are dynamic. ``block_m`` divides 128. ``scale_dtype``: ``uint8`` (UE8M0
    bytes) or ``float32`` (the scales' values). ``spans`` (1, 2 or 4) and ``chunk``: as in the masked program."""
    assert N % block_n == 0 and K % 128 == 0 and TILE % block_m == 0 and spans in (1, 2, 4)
    M, E = T.dynamic("m"), T.dynamic("experts")
    KS, chunk = staged_chunk(K, chunk, spans)
    step = fp8_mma_step(block_n, block_m, spans, threads, scale_dtype)

    @T.prim_func
    def grouped_gemm_contiguous_fp4_fp8(
        A: T.Tensor((M, K), FP8),
        SA: T.Tensor((M, K // 128), ACC),
        B: T.Tensor((E, N, K // 8), "int32"),
        SB: T.Tensor((E, N, KS), scale_dtype),
        layout: T.Tensor((M,), "int32"),
        D: T.Tensor((M, N), BF16),
    ):
        with T.Kernel(N // block_n, T.ceildiv(M, block_m), threads=threads) as (bx, by):
            A_s, Bw_s, B_s, SA_s, SB_s, D_s, part, acc, sb, sa = fp8_mma_buffers(block_m, block_n, spans, K, chunk,
                                                                                  scale_dtype)
            mine = T.alloc_var("int32")

            NAN_BF16 = T.reinterpret(T.uint16(0x7FC0), BF16)
            row0 = by * block_m
            n0 = bx * block_n
            tile0 = row0 - row0 % TILE
            mine = 0
            for j in T.serial(block_m):
                if row0 + j < M:
                    if layout[row0 + j] == layout[tile0]:
                        mine = mine + 1
            if T.And(T.And(layout[tile0] >= 0, layout[tile0] < E), mine > 0):
                T.copy(SA[row0, 0], SA_s)
                T.clear(acc)
                for c in T.serial(KS // chunk):
                    T.copy(SB[layout[tile0], n0, c * chunk], SB_s)
                    for kk in T.Pipelined(chunk // spans, num_stages=num_stages):
                        k = c * chunk + kk * spans  # in units of 32 values
                        T.copy(A[row0, k * SPAN], A_s)
                        T.copy(B[layout[tile0], n0, k * SPAN_WORDS], Bw_s)
                        step(Bw_s, B_s, A_s, SB_s, SA_s, kk, k, sb, sa, part, acc)
                for i, j in T.Parallel(block_n, block_m):
                    D_s[j, i] = T.Cast(BF16, acc[i, j] * E2M1_OVER_E4M3)
                for j, i in T.Parallel(block_m, block_n):
                    if row0 + j < M:
                        if layout[row0 + j] >= 0:
                            D[row0 + j, n0 + i] = T.if_then_else(layout[row0 + j] == layout[tile0], D_s[j, i],
                                                                 NAN_BF16)
            else:
                for j, i in T.Parallel(block_m, block_n):
                    if row0 + j < M:
                        if layout[row0 + j] >= 0:
                            D[row0 + j, n0 + i] = NAN_BF16

    return grouped_gemm_contiguous_fp4_fp8
