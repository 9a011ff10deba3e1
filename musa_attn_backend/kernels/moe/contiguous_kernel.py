"""TileLang program: the FP8 block-scaled grouped GEMM, contiguous layout (the rule and the formats:
:mod:`.reference`): ``D[m] = (A[m] * a_scale[m]) @ (B_e * b_scale_e)^T`` for the expert ``e`` of row ``m``'s
128-row tile.

A block computes ``block_m x block_n`` of ``D`` (``block_m`` 128: one tile of the layout; ``block_n`` a divisor of
128, so one weight scale covers it per K step). Per K step of 128: both operands' FP8 tiles to shared memory
(pipelined), one tensor-core GEMM of the tile into a float32 fragment, then that fragment, times the rows' A
scales and the block's B scale (read from global memory into registers by the threads holding those rows; kept
in shared memory, the two consumer warp groups' writes and reads of it raced under TileLang's warp
specialisation), added to the float32 accumulator (the scales change every K step, so they cannot
be applied after the loop). Both GEMM operands come from shared memory (what MUSA MP31 lowers).

The tile's expert is the id of its first row. Per row, the block writes: the result where the row's id is the
tile's expert, NaN where the id is another non-negative value, nothing where the id is ``-1`` or the row is past
``M``. A tile whose expert is outside ``[0, E)`` reads no weight and writes NaN to its rows with a non-negative
id. The K loop, its epilogue and the invalid tile's NaN rows are the two arms of one branch: TileLang's
automatic warp specialisation assigns code after a branch holding the pipeline to the producer warps, which do
not hold the accumulator. The tile's expert is read from ``layout`` wherever it is used, not kept in a local:
the same pass moves a local's initialisation past the branch that tests it.
"""

import functools

from ..._tilelang import tl_lang as T

FP8 = "float8_e4m3"
ACC = "float32"


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_contiguous(N: int, K: int, block_n: int = 128, num_stages: int = 4, threads: int = 256,
                                  policy: str = "Square", swizzle: int = 0):
    """``N``, ``K``: the weights' shape (multiples of 128); ``M`` and the expert count are dynamic. ``policy``: how
    the tile GEMM splits the block among the warps (TileLang's ``GemmWarpPolicy``: ``Square``, ``FullRow``: each
    warp group whole rows of the tile, ``FullCol``). ``swizzle``: 0 launches the blocks row of tiles by row of
    tiles; a panel width launches them in panels of that many tile columns (``T.use_swizzle``), so blocks running
    together share weight tiles in L2."""
    block_m, block_k = 128, 128
    assert N % block_n == 0 and 128 % block_n == 0 and K % block_k == 0
    M, E = T.dynamic("m"), T.dynamic("experts")
    KS = K // block_k

    @T.prim_func
    def grouped_gemm_contiguous(
        A: T.Tensor((M, K), FP8),
        SA: T.Tensor((M, KS), ACC),
        B: T.Tensor((E, N, K), FP8),
        SB: T.Tensor((E, N // 128, KS), ACC),
        layout: T.Tensor((M,), "int32"),
        D: T.Tensor((M, N), "bfloat16"),
    ):
        with T.Kernel(N // block_n, T.ceildiv(M, block_m), threads=threads) as (bx, by):
            if swizzle:
                T.use_swizzle(swizzle)
            A_s = T.alloc_shared((block_m, block_k), FP8)
            B_s = T.alloc_shared((block_n, block_k), FP8)
            scale = T.alloc_fragment((block_m,), ACC)
            D_s = T.alloc_shared((block_m, block_n), "bfloat16")
            part = T.alloc_fragment((block_m, block_n), ACC)
            acc = T.alloc_fragment((block_m, block_n), ACC)

            NAN_BF16 = T.reinterpret(T.uint16(0x7FC0), "bfloat16")
            row0 = by * block_m
            if T.And(layout[row0] >= 0, layout[row0] < E):
                T.clear(acc)
                for k in T.Pipelined(KS, num_stages=num_stages):
                    T.copy(A[row0, k * block_k], A_s)
                    T.copy(B[layout[row0], bx * block_n, k * block_k], B_s)
                    for i in T.Parallel(block_m):
                        scale[i] = (T.if_then_else(row0 + i < M, SA[T.min(row0 + i, M - 1), k], 0.0)
                                    * SB[layout[row0], bx * block_n // 128, k])
                    T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True,
                           policy=getattr(T.GemmWarpPolicy, policy))
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

    return grouped_gemm_contiguous
