"""TileLang program: the block-scaled grouped GEMM, masked layout (the rule and the formats: :mod:`.reference`):
``D[e, m] = (A[e, m] * a_scale[e, m]) @ W_e^T`` for ``m < masked_m[e]``, ``W_e`` either FP8 weights times their
128 x 128 block scales or FP4 (MXFP4) weights times their UE8M0 scales (one per 32 values of a row). One program
body for both weight formats (:func:`_masked_body`), two entry points with their own signatures.

The shapes are fixed (``E x max_m`` rows whatever the batch), so a decode step under a CUDA graph launches the
same grid every time; ``masked_m`` is read on the device only. A block computes ``block_m x block_n`` of one
expert's output; a block whose rows all lie past ``masked_m[e]`` (clamped to ``[0, max_m]``) exits before reading
anything, so a step reads the weights of the experts it routes to and no others. Rows past ``masked_m[e]`` are
not written. The K loop is the contiguous program's (:mod:`.contiguous_kernel`):

- FP8 weights: per 128-wide K step, a tensor-core GEMM of the two FP8 tiles from shared memory, scaled by the
  rows' A scales and the block's B scale into a float32 accumulator;
- FP4 weights: converted in the kernel, per K step of 128, into a bf16 tile in shared memory (each value its E2M1
  value times ``2^(s - 127)``, :mod:`.fp4_tir`, exact in bf16 for every scale byte from 1 to 254), the A tile
  widened to bf16 beside it, exactly, and one bf16 tensor-core GEMM of the two shared tiles (what MUSA MP31
  lowers) into a float32 fragment scaled by the rows' A scales into the accumulator. The weights stay packed in
  memory: the program reads half the bytes of FP8 weights, no FP8 copy exists.
"""

import functools

from ..._tilelang import tl_lang as T
from .fp4_tir import bf16_operand_tiles, bf16_operands, packed_weights

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"


def _masked_body(N: int, K: int, block_m: int, block_n: int, num_stages: int, threads: int, E, MM, fp4: bool,
                 packing: str = "", scale_dtype: str = ACC):
    """``(body, KS)``: the macro ``body(A, SA, B, SB, masked_m, D)`` of both programs (``fp4``: the weights'
    format; ``packing``, ``scale_dtype``: the FP4 weights' reading, :func:`.fp4_tir.packed_weights`) and the K
    steps of 128 (the scales' columns). ``N`` a multiple of ``block_n`` (FP8 weights: a divisor of 128, so one
    weight scale covers it), ``K`` a multiple of 128."""
    assert N % block_n == 0 and (fp4 or 128 % block_n == 0) and K % 128 == 0
    block_k = 128
    KS = K // block_k
    per = packed_weights(packing)[0] if fp4 else 1
    widen = bf16_operands(block_m, block_n, block_k, threads, packing) if fp4 else None

    @T.macro
    def body(A, SA, B, SB, masked_m, D):
        with T.Kernel(N // block_n, T.ceildiv(MM, block_m), E, threads=threads) as (bx, by, e):
            A_s = T.alloc_shared((block_m, block_k), FP8)
            if fp4:
                Bq_s, Bs_s, A_w, B_w, D_s = bf16_operand_tiles(block_m, block_n, block_k, packing, scale_dtype)
                part = T.alloc_fragment((block_m, block_n), ACC)
                acc = T.alloc_fragment((block_m, block_n), ACC)
                scale = T.alloc_fragment((block_m,), ACC)
            else:
                B_s = T.alloc_shared((block_n, block_k), FP8)
                scale_s = T.alloc_shared((block_m,), ACC)
                D_s = T.alloc_shared((block_m, block_n), BF16)
                part = T.alloc_fragment((block_m, block_n), ACC)
                acc = T.alloc_fragment((block_m, block_n), ACC)

            rows = T.min(T.max(masked_m[e], 0), MM)
            row0 = by * block_m
            if row0 < rows:
                T.clear(acc)
                for k in T.Pipelined(KS, num_stages=num_stages):
                    T.copy(A[e, row0, k * block_k], A_s)
                    if fp4:
                        T.copy(B[e, bx * block_n, k * (block_k // per)], Bq_s)
                        T.copy(SB[e, bx * block_n, k * (block_k // 32)], Bs_s)
                        widen(A_s, Bq_s, Bs_s, A_w, B_w)
                        for i in T.Parallel(block_m):
                            scale[i] = T.if_then_else(row0 + i < rows, SA[e, T.min(row0 + i, MM - 1), k], 0.0)
                        T.gemm(A_w, B_w, part, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(block_m, block_n):
                            acc[i, j] += part[i, j] * scale[i]
                    else:  # the rows' scales times the block's in shared memory
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

    return body, KS


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_masked(N: int, K: int, block_m: int = 64, block_n: int = 128, num_stages: int = 4,
                              threads: int = 128):
    """FP8 weights. ``N``, ``K``: the weights' shape (multiples of 128); the expert count and ``max_m`` are
    dynamic."""
    E, MM = T.dynamic("experts"), T.dynamic("max_m")
    body, KS = _masked_body(N, K, block_m, block_n, num_stages, threads, E, MM, False)

    @T.prim_func
    def grouped_gemm_masked(
        A: T.Tensor((E, MM, K), FP8),
        SA: T.Tensor((E, MM, KS), ACC),
        B: T.Tensor((E, N, K), FP8),
        SB: T.Tensor((E, N // 128, KS), ACC),
        masked_m: T.Tensor((E,), "int32"),
        D: T.Tensor((E, MM, N), BF16),
    ):
        body(A, SA, B, SB, masked_m, D)

    return grouped_gemm_masked


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_masked_fp4(N: int, K: int, block_m: int = 64, block_n: int = 128, num_stages: int = 2,
                                  threads: int = 128, scale_dtype: str = "uint8", packing: str = "bytes"):
    """FP4 weights. ``N``, ``K``: the weights' logical shape (multiples of 128); the expert count and ``max_m`` are
    dynamic. ``scale_dtype``: ``uint8`` (UE8M0 bytes) or ``float32`` (the scales' values). ``packing``: ``bytes``
    or ``words``, how ``B``'s memory is read and converted (:func:`.fp4_tir.packed_weights`)."""
    per, packed = packed_weights(packing)
    E, MM = T.dynamic("experts"), T.dynamic("max_m")
    body, KS = _masked_body(N, K, block_m, block_n, num_stages, threads, E, MM, True, packing=packing,
                            scale_dtype=scale_dtype)

    @T.prim_func
    def grouped_gemm_masked_fp4(
        A: T.Tensor((E, MM, K), FP8),
        SA: T.Tensor((E, MM, KS), ACC),
        B: T.Tensor((E, N, K // per), packed),
        SB: T.Tensor((E, N, K // 32), scale_dtype),
        masked_m: T.Tensor((E,), "int32"),
        D: T.Tensor((E, MM, N), BF16),
    ):
        body(A, SA, B, SB, masked_m, D)

    return grouped_gemm_masked_fp4
