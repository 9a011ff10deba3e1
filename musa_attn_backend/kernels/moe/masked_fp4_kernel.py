"""TileLang program: the masked grouped GEMM with FP4 (MXFP4) expert weights (the rule and the formats:
:mod:`.reference`): ``D[e, m] = (A[e, m] * a_scale[e, m]) @ W_e^T`` for ``m < masked_m[e]``, ``W_e`` the expert's
E2M1 weights times their UE8M0 scales (one per 32 values of a row).

The weights are converted in the kernel, per K step of 128, into a bf16 tile in shared memory: each value is its
E2M1 value times ``2^(s - 127)`` (:mod:`.fp4_tir`), exact in bf16 for every scale byte from 1 to 254. The A tile
(FP8) is widened to bf16 beside it, exactly, and one bf16 tensor-core GEMM of the two shared tiles (what MUSA
MP31 lowers) goes into a float32 fragment that is scaled by the rows' A scales into the accumulator. The weights stay packed in memory: the program reads half the bytes of FP8 weights and converts on
the fly, no FP8 copy exists. Blocks past ``masked_m[e]`` (clamped to ``[0, max_m]``) exit before reading anything;
rows past it are not written.
"""

import functools

from ..._tilelang import tl_lang as T
from .fp4_tir import convert_words, fp4_weight, packed_weights

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_masked_fp4(N: int, K: int, block_m: int = 64, block_n: int = 128, num_stages: int = 2,
                                  threads: int = 128, scale_dtype: str = "uint8", packing: str = "bytes"):
    """``N``, ``K``: the weights' logical shape (multiples of 128); the expert count and ``max_m`` are dynamic.
    ``scale_dtype``: ``uint8`` (UE8M0 bytes) or ``float32`` (the scales' values). ``packing``: ``bytes`` or
    ``words``, how ``B``'s memory is read and converted (:func:`.fp4_tir.packed_weights`)."""
    per, packed = packed_weights(packing)
    convert = convert_words(block_n, 128, threads, BF16)
    block_k = 128
    assert N % block_n == 0 and K % block_k == 0
    E, MM = T.dynamic("experts"), T.dynamic("max_m")
    KS = K // block_k

    @T.prim_func
    def grouped_gemm_masked_fp4(
        A: T.Tensor((E, MM, K), FP8),
        SA: T.Tensor((E, MM, KS), ACC),
        B: T.Tensor((E, N, K // per), packed),
        SB: T.Tensor((E, N, K // 32), scale_dtype),
        masked_m: T.Tensor((E,), "int32"),
        D: T.Tensor((E, MM, N), BF16),
    ):
        with T.Kernel(N // block_n, T.ceildiv(MM, block_m), E, threads=threads) as (bx, by, e):
            A_s = T.alloc_shared((block_m, block_k), FP8)
            Bq_s = T.alloc_shared((block_n, block_k // per), packed)
            Bs_s = T.alloc_shared((block_n, block_k // 32), scale_dtype)
            A_w = T.alloc_shared((block_m, block_k), BF16)
            B_w = T.alloc_shared((block_n, block_k), BF16)
            D_s = T.alloc_shared((block_m, block_n), BF16)
            part = T.alloc_fragment((block_m, block_n), ACC)
            acc = T.alloc_fragment((block_m, block_n), ACC)
            scale = T.alloc_fragment((block_m,), ACC)

            rows = T.min(T.max(masked_m[e], 0), MM)
            row0 = by * block_m
            if row0 < rows:
                T.clear(acc)
                for k in T.Pipelined(KS, num_stages=num_stages):
                    T.copy(A[e, row0, k * block_k], A_s)
                    T.copy(B[e, bx * block_n, k * (block_k // per)], Bq_s)
                    T.copy(SB[e, bx * block_n, k * (block_k // 32)], Bs_s)
                    for i, j in T.Parallel(block_m, block_k):
                        A_w[i, j] = T.Cast(BF16, A_s[i, j])
                    if packing == "words":
                        convert(Bq_s, Bs_s, B_w)
                    else:
                        for n, j in T.Parallel(block_n, block_k):
                            B_w[n, j] = T.Cast(BF16, fp4_weight(Bq_s, Bs_s, n, j))
                    for i in T.Parallel(block_m):
                        scale[i] = T.if_then_else(row0 + i < rows, SA[e, T.min(row0 + i, MM - 1), k], 0.0)
                    T.gemm(A_w, B_w, part, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += part[i, j] * scale[i]
                T.copy(acc, D_s)
                for i, j in T.Parallel(block_m, block_n):
                    if row0 + i < rows:
                        D[e, row0 + i, bx * block_n + j] = D_s[i, j]

    return grouped_gemm_masked_fp4
