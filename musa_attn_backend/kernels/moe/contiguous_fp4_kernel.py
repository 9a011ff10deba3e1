"""TileLang program: the contiguous grouped GEMM with FP4 (MXFP4) expert weights (the rule and the formats:
:mod:`.reference`; the layout's rules: :mod:`.contiguous_kernel`): ``D[m] = (A[m] * a_scale[m]) @ W_e^T`` for the
expert ``e`` of row ``m``'s 128-row tile, ``W_e`` the expert's E2M1 weights times their UE8M0 scales.

Per K step of 128: the A tile (FP8) and the packed weight bytes with their scale bytes go to shared memory
(pipelined); the weights are converted into a bf16 tile there (:mod:`.fp4_tir`, exact) and A widened to bf16
beside them; one bf16 tensor-core GEMM of the two shared tiles (what MUSA MP31 lowers) goes into a float32
fragment that the rows' A scales (held in registers) scale into the accumulator. The weights stay packed in
memory. The branch on the tile's expert holds the K loop with its epilogue in one arm and the NaN rows of an
invalid tile in the other, and the expert is read from ``layout`` where it is used, for the reasons the FP8
program gives.
"""

import functools

from ..._tilelang import tl_lang as T
from .fp4_tir import convert_words, fp4_weight, packed_weights

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_contiguous_fp4(N: int, K: int, block_n: int = 128, num_stages: int = 2, threads: int = 256,
                                      scale_dtype: str = "uint8", packing: str = "bytes"):
    """``N``, ``K``: the weights' logical shape (multiples of 128); ``M`` and the expert count are dynamic.
    ``scale_dtype``: ``uint8`` (UE8M0 bytes) or ``float32`` (the scales' values). ``packing``: ``bytes`` or
    ``words``, how ``B``'s memory is read and converted (:func:`.fp4_tir.packed_weights`)."""
    per, packed = packed_weights(packing)
    convert = convert_words(block_n, 128, threads, BF16)
    block_m, block_k = 128, 128
    assert N % block_n == 0 and K % block_k == 0
    M, E = T.dynamic("m"), T.dynamic("experts")
    KS = K // block_k

    @T.prim_func
    def grouped_gemm_contiguous_fp4(
        A: T.Tensor((M, K), FP8),
        SA: T.Tensor((M, KS), ACC),
        B: T.Tensor((E, N, K // per), packed),
        SB: T.Tensor((E, N, K // 32), scale_dtype),
        layout: T.Tensor((M,), "int32"),
        D: T.Tensor((M, N), BF16),
    ):
        with T.Kernel(N // block_n, T.ceildiv(M, block_m), threads=threads) as (bx, by):
            A_s = T.alloc_shared((block_m, block_k), FP8)
            Bq_s = T.alloc_shared((block_n, block_k // per), packed)
            Bs_s = T.alloc_shared((block_n, block_k // 32), scale_dtype)
            A_w = T.alloc_shared((block_m, block_k), BF16)
            B_w = T.alloc_shared((block_n, block_k), BF16)
            D_s = T.alloc_shared((block_m, block_n), BF16)
            scale = T.alloc_fragment((block_m,), ACC)
            part = T.alloc_fragment((block_m, block_n), ACC)
            acc = T.alloc_fragment((block_m, block_n), ACC)

            NAN_BF16 = T.reinterpret(T.uint16(0x7FC0), BF16)
            row0 = by * block_m
            if T.And(layout[row0] >= 0, layout[row0] < E):
                T.clear(acc)
                for k in T.Pipelined(KS, num_stages=num_stages):
                    T.copy(A[row0, k * block_k], A_s)
                    T.copy(B[layout[row0], bx * block_n, k * (block_k // per)], Bq_s)
                    T.copy(SB[layout[row0], bx * block_n, k * (block_k // 32)], Bs_s)
                    for i, j in T.Parallel(block_m, block_k):
                        A_w[i, j] = T.Cast(BF16, A_s[i, j])
                    if packing == "words":
                        convert(Bq_s, Bs_s, B_w)
                    else:
                        for n, j in T.Parallel(block_n, block_k):
                            B_w[n, j] = T.Cast(BF16, fp4_weight(Bq_s, Bs_s, n, j))
                    for i in T.Parallel(block_m):
                        scale[i] = T.if_then_else(row0 + i < M, SA[T.min(row0 + i, M - 1), k], 0.0)
                    T.gemm(A_w, B_w, part, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += part[i, j] * scale[i]
                T.copy(acc, D_s)
                for i, j in T.Parallel(block_m, block_n):
                    if row0 + i < M:
                        if layout[row0 + i] >= 0:
                            D[row0 + i, bx * block_n + j] = T.if_then_else(layout[row0 + i] == layout[row0], D_s[i, j],
                                                                           NAN_BF16)
            else:
                for i, j in T.Parallel(block_m, block_n):
                    if row0 + i < M:
                        if layout[row0 + i] >= 0:
                            D[row0 + i, bx * block_n + j] = NAN_BF16

    return grouped_gemm_contiguous_fp4
