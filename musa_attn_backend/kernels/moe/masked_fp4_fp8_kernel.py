"""TileLang program: the masked grouped GEMM with FP4 (MXFP4) expert weights on FP8 tensor cores, for decode
(the rule and the formats: :mod:`.reference`)::

    D[e, m, n] = sum_k (A[e, m, k] * a_scale[e, m, k / 128]) * (E2M1(B[e, n, k]) * 2^(s[e, n, k / 32] - 127))

for ``m < masked_m[e]`` (clamped to ``[0, max_m]``).

Every E2M1 value is an e4m3 value times 64: the nibble ``s eem`` read as the byte ``s 000 0ee m00`` (exponent bias
7 against 1, the subnormals of both formats aligned) is ``E2M1 / 64``. So the weights become FP8 by bit moves
(:func:`.fp4_tir.e4m3_quads`: integer operations on whole words, no table, no float), and the
activations stay FP8: one FP8 tensor-core GEMM of two shared tiles (what MUSA MP31 lowers) per 32 values of K,
the span of one weight scale. Its float32 result is scaled into the accumulator by the weight row's scale and the
activation row's scale; the factor 64 is applied once, to the output.

The tile is swapped (weights as the GEMM's M side, ``block_n`` rows; activations as its N side, ``block_m``
tokens): a decode batch has few tokens an expert, and the per-32 rescale then touches ``block_n x block_m``
values, not 64 padded rows. The weights stay packed in memory (half the bytes of FP8 weights, no FP8 copy).
Blocks past ``masked_m[e]`` exit before reading anything; rows past it are not written. An output column
depends on its own activation row only, so rows between ``masked_m[e]`` and the tile's end (whatever they hold)
reach no written value.
"""

import functools

from ..._tilelang import tl_lang as T
from .fp4_tir import SPAN, SPAN_WORDS, fp8_mma_buffers, fp8_mma_step, staged_chunk

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"
E2M1_OVER_E4M3 = 64.0


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_masked_fp4_fp8(N: int, K: int, block_m: int = 16, block_n: int = 128, num_stages: int = 4,
                                      spans: int = 2, threads: int = 128, scale_dtype: str = "uint8", chunk: int = 32):
    """``N``, ``K``: the weights' logical shape (multiples of 128); ``B`` is read as int32 words (eight values
    each: value ``8q + i`` in bits ``4i .. 4i + 3`` of word ``q``, the bytes' little-endian order); the expert count
    and ``max_m`` are dynamic. ``scale_dtype``: ``uint8`` (UE8M0 bytes) or ``float32`` (the scales' values).

    Each pipelined step covers ``spans`` (1, 2 or 4) x 32 values of K: one convert, one barrier and ``spans`` FP8
    GEMMs (:func:`.fp4_tir.fp8_mma_step`). The scales are staged in shared memory ahead of their use, as the K loop
    would otherwise wait on a global load of them every 32 values: the activation rows' whole ``K / 128`` scales
    once, the weight rows' ``chunk`` columns at a time (``chunk`` x 32 values, a multiple of the step's)."""
    assert N % block_n == 0 and K % 128 == 0 and spans in (1, 2, 4)
    E, MM = T.dynamic("experts"), T.dynamic("max_m")
    KS, chunk = staged_chunk(K, chunk, spans)
    step = fp8_mma_step(block_n, block_m, spans, threads, scale_dtype)

    @T.prim_func
    def grouped_gemm_masked_fp4_fp8(
        A: T.Tensor((E, MM, K), FP8),
        SA: T.Tensor((E, MM, K // 128), ACC),
        B: T.Tensor((E, N, K // 8), "int32"),
        SB: T.Tensor((E, N, KS), scale_dtype),
        masked_m: T.Tensor((E,), "int32"),
        D: T.Tensor((E, MM, N), BF16),
    ):
        with T.Kernel(N // block_n, T.ceildiv(MM, block_m), E, threads=threads) as (bx, by, e):
            A_s, Bw_s, B_s, SA_s, SB_s, D_s, part, acc, sb, sa = fp8_mma_buffers(block_m, block_n, spans, K, chunk,
                                                                                  scale_dtype)

            rows = T.min(T.max(masked_m[e], 0), MM)
            row0 = by * block_m
            n0 = bx * block_n
            if row0 < rows:
                T.copy(SA[e, row0, 0], SA_s)
                T.clear(acc)
                for c in T.serial(KS // chunk):
                    T.copy(SB[e, n0, c * chunk], SB_s)
                    for kk in T.Pipelined(chunk // spans, num_stages=num_stages):
                        k = c * chunk + kk * spans  # in units of 32 values
                        T.copy(A[e, row0, k * SPAN], A_s)
                        T.copy(B[e, n0, k * SPAN_WORDS], Bw_s)
                        step(Bw_s, B_s, A_s, SB_s, SA_s, kk, k, sb, sa, part, acc)
                for i, j in T.Parallel(block_n, block_m):
                    D_s[j, i] = T.Cast(BF16, acc[i, j] * E2M1_OVER_E4M3)
                for j, i in T.Parallel(block_m, block_n):
                    if row0 + j < rows:
                        D[e, row0 + j, n0 + i] = D_s[j, i]

    return grouped_gemm_masked_fp4_fp8
