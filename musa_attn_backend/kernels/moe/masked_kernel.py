"""TileLang program: the FP8 block-scaled grouped GEMM, masked layout (the rule and the formats:
:mod:`.reference`): ``D[e, m] = (A[e, m] * a_scale[e, m]) @ (B_e * b_scale_e)^T`` for ``m < masked_m[e]``.

The shapes are fixed (``E x max_m`` rows whatever the batch), so a decode step under a CUDA graph launches the
same grid every time; ``masked_m`` is read on the device only. A block computes ``block_m x block_n`` of one
expert's output; a block whose rows all lie past ``masked_m[e]`` (clamped to ``[0, max_m]``) exits before reading
anything, so a step reads the weights of the experts it routes to and no others. The K loop is the contiguous
program's (:mod:`.contiguous_kernel`): per 128-wide K step, a tensor-core GEMM of the two FP8 tiles from shared
memory, scaled by the rows' A scales and the block's B scale into a float32 accumulator. Rows past ``masked_m[e]``
are not written.
"""

import functools

from ..._tilelang import tl_lang as T

FP8 = "float8_e4m3"
ACC = "float32"


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_masked(N: int, K: int, block_m: int = 64, block_n: int = 128, num_stages: int = 4,
                              threads: int = 128):
    """``N``, ``K``: the weights' shape (multiples of 128); the expert count and ``max_m`` are dynamic."""
    block_k = 128
    assert N % block_n == 0 and 128 % block_n == 0 and K % block_k == 0
    E, MM = T.dynamic("experts"), T.dynamic("max_m")
    KS = K // block_k

    @T.prim_func
    def grouped_gemm_masked(
        A: T.Tensor((E, MM, K), FP8),
        SA: T.Tensor((E, MM, KS), ACC),
        B: T.Tensor((E, N, K), FP8),
        SB: T.Tensor((E, N // 128, KS), ACC),
        masked_m: T.Tensor((E,), "int32"),
        D: T.Tensor((E, MM, N), "bfloat16"),
    ):
        with T.Kernel(N // block_n, T.ceildiv(MM, block_m), E, threads=threads) as (bx, by, e):
            A_s = T.alloc_shared((block_m, block_k), FP8)
            B_s = T.alloc_shared((block_n, block_k), FP8)
            scale_s = T.alloc_shared((block_m,), ACC)
            D_s = T.alloc_shared((block_m, block_n), "bfloat16")
            part = T.alloc_fragment((block_m, block_n), ACC)
            acc = T.alloc_fragment((block_m, block_n), ACC)

            rows = T.min(T.max(masked_m[e], 0), MM)
            row0 = by * block_m
            if row0 < rows:
                T.clear(acc)
                for k in T.Pipelined(KS, num_stages=num_stages):
                    T.copy(A[e, row0, k * block_k], A_s)
                    T.copy(B[e, bx * block_n, k * block_k], B_s)
                    for i in T.Parallel(block_m):
                        scale_s[i] = (T.if_then_else(row0 + i < rows, SA[e, T.min(row0 + i, MM - 1), k], 0.0)
                                      * SB[e, bx * block_n // 128, k])
                    T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += part[i, j] * scale_s[i]
                T.copy(acc, D_s)
                for i, j in T.Parallel(block_m, block_n):
                    if row0 + i < rows:
                        D[e, row0 + i, bx * block_n + j] = D_s[i, j]

    return grouped_gemm_masked
