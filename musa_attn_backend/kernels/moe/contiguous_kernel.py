"""TileLang program: the block-scaled grouped GEMM, contiguous layout (the rule and the formats: :mod:`.reference`):
``D[m] = (A[m] * a_scale[m]) @ W_e^T`` for the expert ``e`` of row ``m``'s 128-row tile, ``W_e`` either FP8 weights
times their 128 x 128 block scales or FP4 (MXFP4) weights times their UE8M0 scales (one per 32 values of a row).
One program body for both weight formats (:func:`_contiguous_body`), two entry points with their own signatures.

A block computes ``block_m x block_n`` of ``D`` (``block_m`` 128: one tile of the layout). Per K step of 128:

- FP8 weights (``block_n`` a divisor of 128, so one weight scale covers it): both operands' FP8 tiles to shared
  memory (pipelined), one tensor-core GEMM of the tile into a float32 fragment, then that fragment, times the
  rows' A scales and the block's B scale (read from global memory into registers by the threads holding those
  rows; kept in shared memory, the two consumer warp groups' writes and reads of it raced under TileLang's warp
  specialisation), added to the float32 accumulator (the scales change every K step, so they cannot be applied
  after the loop).
- FP4 weights: the A tile (FP8) and the packed weight bytes with their scale bytes go to shared memory
  (pipelined); the weights are converted into a bf16 tile there (:mod:`.fp4_tir`, exact) and A widened to bf16
  beside them; one bf16 tensor-core GEMM of the two shared tiles goes into a float32 fragment that the rows' A
  scales scale into the accumulator. The weights stay packed in memory.

Both GEMM operands come from shared memory (what MUSA MP31 lowers).

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
from .fp4_tir import bf16_operand_tiles, bf16_operands, packed_weights

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"


def _contiguous_body(N: int, K: int, block_n: int, num_stages: int, threads: int, M, E, fp4: bool,
                     policy: str = "Square", swizzle: int = 0, packing: str = "", scale_dtype: str = ACC):
    """``(body, KS)``: the macro ``body(A, SA, B, SB, layout, D)`` of both programs (``fp4``: the weights' format;
    ``packing``, ``scale_dtype``: the FP4 weights' reading, :func:`.fp4_tir.packed_weights`) and the K steps of
    128 (the scales' columns). ``N`` a multiple of ``block_n`` (FP8 weights: a divisor of 128, so one weight scale
    covers it), ``K`` a multiple of 128."""
    assert N % block_n == 0 and (fp4 or 128 % block_n == 0) and K % 128 == 0
    block_m, block_k = 128, 128
    KS = K // block_k
    per = packed_weights(packing)[0] if fp4 else 1
    widen = bf16_operands(block_m, block_n, block_k, threads, packing) if fp4 else None

    @T.macro
    def body(A, SA, B, SB, layout, D):
        with T.Kernel(N // block_n, T.ceildiv(M, block_m), threads=threads) as (bx, by):
            if swizzle:
                T.use_swizzle(swizzle)
            A_s = T.alloc_shared((block_m, block_k), FP8)
            if fp4:
                Bq_s, Bs_s, A_w, B_w, D_s = bf16_operand_tiles(block_m, block_n, block_k, packing, scale_dtype)
                scale = T.alloc_fragment((block_m,), ACC)
            else:
                B_s = T.alloc_shared((block_n, block_k), FP8)
                scale = T.alloc_fragment((block_m,), ACC)
                D_s = T.alloc_shared((block_m, block_n), BF16)
            part = T.alloc_fragment((block_m, block_n), ACC)
            acc = T.alloc_fragment((block_m, block_n), ACC)

            NAN_BF16 = T.reinterpret(T.uint16(0x7FC0), BF16)
            row0 = by * block_m
            if T.And(layout[row0] >= 0, layout[row0] < E):
                T.clear(acc)
                for k in T.Pipelined(KS, num_stages=num_stages):
                    T.copy(A[row0, k * block_k], A_s)
                    if fp4:
                        T.copy(B[layout[row0], bx * block_n, k * (block_k // per)], Bq_s)
                        T.copy(SB[layout[row0], bx * block_n, k * (block_k // 32)], Bs_s)
                        widen(A_s, Bq_s, Bs_s, A_w, B_w)
                        for i in T.Parallel(block_m):
                            scale[i] = T.if_then_else(row0 + i < M, SA[T.min(row0 + i, M - 1), k], 0.0)
                        T.gemm(A_w, B_w, part, transpose_B=True, clear_accum=True)
                    else:
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

    return body, KS


def _persistent_body(N: int, K: int, block_n: int, num_stages: int, threads: int, M, E, policy: str, workers: int):
    """The FP8 program's persistent form: ``workers`` blocks (the SM count), block ``w`` computing tiles ``w, w +
    workers, ...`` in the grid's launch order (column fastest), so that its producer warps load the next tile's
    first stages while its consumers store the last one (a block a tile waits for its pipeline to fill every
    tile). TileLang 0.1.12's warp specialisation cannot lower a pipeline inside a loop (TileLang 0.1.15 can), and
    its storage-sync pass would put a whole-block barrier at the top of each tile, so that pass is off for this
    form (:func:`.tilelang_impl.contiguous_kernel`) and the consumers' two barriers around the staging of ``D``
    are written here (named barrier 3, the 256 consumer threads). The K loop runs for every tile, with no step for
    a tile whose expert is outside ``[0, E)`` (the pass requires the pipeline outside any branch); the epilogue
    writes NaN for such a tile's rows, as the other form does."""
    assert N % block_n == 0 and 128 % block_n == 0 and K % 128 == 0 and threads == 256
    block_m, block_k = 128, 128
    KS, NT = K // block_k, N // block_n

    def row0(w, t):  # the first row of block w's t-th tile (written out where used, no local: see above)
        return (w + t * workers) // NT * block_m

    def col0(w, t):  # its first column
        return (w + t * workers) % NT * block_n

    @T.macro
    def body(A, SA, B, SB, layout, D):
        with T.Kernel(workers, threads=threads) as w:
            A_s = T.alloc_shared((block_m, block_k), FP8)
            B_s = T.alloc_shared((block_n, block_k), FP8)
            D_s = T.alloc_shared((block_m, block_n), BF16)
            scale = T.alloc_fragment((block_m,), ACC)
            part = T.alloc_fragment((block_m, block_n), ACC)
            acc = T.alloc_fragment((block_m, block_n), ACC)
            NAN_BF16 = T.reinterpret(T.uint16(0x7FC0), BF16)
            # the tile's first row and column are expressions at every use: a local bound in the loop hides the
            # pipeline from the warp-specialisation pass
            for t in T.serial(T.ceildiv(T.ceildiv(M, block_m) * NT - w, workers)):
                T.clear(acc)
                for k in T.Pipelined(T.if_then_else(T.And(layout[row0(w, t)] >= 0, layout[row0(w, t)] < E), KS, 0),
                                     num_stages=num_stages):
                    T.copy(A[row0(w, t), k * block_k], A_s)
                    T.copy(B[layout[row0(w, t)], col0(w, t), k * block_k], B_s)
                    for i in T.Parallel(block_m):
                        scale[i] = (T.if_then_else(row0(w, t) + i < M, SA[T.min(row0(w, t) + i, M - 1), k], 0.0)
                                    * SB[layout[row0(w, t)], col0(w, t) // 128, k])
                    T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True,
                           policy=getattr(T.GemmWarpPolicy, policy))
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += part[i, j] * scale[i]
                T.sync_threads(3, 256)  # the last tile's reads of D_s are done
                T.copy(acc, D_s)
                T.sync_threads(3, 256)
                for i, j in T.Parallel(block_m, block_n):
                    if row0(w, t) + i < M:
                        if layout[row0(w, t) + i] >= 0:
                            D[row0(w, t) + i, col0(w, t) + j] = T.if_then_else(
                                T.And(layout[row0(w, t) + i] == layout[row0(w, t)], layout[row0(w, t)] < E),
                                D_s[i, j], NAN_BF16)

    return body, KS


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_contiguous(N: int, K: int, block_n: int = 128, num_stages: int = 4, threads: int = 256,
                                  policy: str = "Square", swizzle: int = 0, persistent: int = 0):
    """FP8 weights. ``N``, ``K``: the weights' shape (multiples of 128); ``M`` and the expert count are dynamic.
    ``policy``: how the tile GEMM splits the block among the warps (TileLang's ``GemmWarpPolicy``: ``Square``,
    ``FullRow``: each warp group whole rows of the tile, ``FullCol``). ``swizzle``: 0 launches the blocks row of
    tiles by row of tiles; a panel width launches them in panels of that many tile columns (``T.use_swizzle``),
    so blocks running together share weight tiles in L2. ``persistent``: 0 launches a block a tile; a block count
    (the SM count) launches the persistent form (:func:`_persistent_body`; TileLang 0.1.15)."""
    M, E = T.dynamic("m"), T.dynamic("experts")
    if persistent:
        body, KS = _persistent_body(N, K, block_n, num_stages, threads, M, E, policy, persistent)
    else:
        body, KS = _contiguous_body(N, K, block_n, num_stages, threads, M, E, False, policy=policy, swizzle=swizzle)

    @T.prim_func
    def grouped_gemm_contiguous(
        A: T.Tensor((M, K), FP8),
        SA: T.Tensor((M, KS), ACC),
        B: T.Tensor((E, N, K), FP8),
        SB: T.Tensor((E, N // 128, KS), ACC),
        layout: T.Tensor((M,), "int32"),
        D: T.Tensor((M, N), BF16),
    ):
        body(A, SA, B, SB, layout, D)

    return grouped_gemm_contiguous


@functools.lru_cache(maxsize=None)
def build_grouped_gemm_contiguous_fp4(N: int, K: int, block_n: int = 128, num_stages: int = 2, threads: int = 256,
                                      scale_dtype: str = "uint8", packing: str = "bytes"):
    """FP4 weights. ``N``, ``K``: the weights' logical shape (multiples of 128); ``M`` and the expert count are
    dynamic. ``scale_dtype``: ``uint8`` (UE8M0 bytes) or ``float32`` (the scales' values). ``packing``: ``bytes``
    or ``words``, how ``B``'s memory is read and converted (:func:`.fp4_tir.packed_weights`)."""
    per, packed = packed_weights(packing)
    M, E = T.dynamic("m"), T.dynamic("experts")
    body, KS = _contiguous_body(N, K, block_n, num_stages, threads, M, E, True, packing=packing,
                                scale_dtype=scale_dtype)

    @T.prim_func
    def grouped_gemm_contiguous_fp4(
        A: T.Tensor((M, K), FP8),
        SA: T.Tensor((M, KS), ACC),
        B: T.Tensor((E, N, K // per), packed),
        SB: T.Tensor((E, N, K // 32), scale_dtype),
        layout: T.Tensor((M,), "int32"),
        D: T.Tensor((M, N), BF16),
    ):
        body(A, SA, B, SB, layout, D)

    return grouped_gemm_contiguous_fp4
