"""TIR expressions shared by the programs that compute V4's SwiGLU and the 1 x 128 FP8 quantisation GEMM2 reads
(:mod:`.swiglu_quant_kernel`, :mod:`.contiguous_swiglu_kernel`, :mod:`.masked_swiglu_kernel`,
:mod:`.quantize_scatter_kernel`), in float32, with
the reference's order of operations (:func:`.layer.swiglu`, :func:`.reference.quantize_groups_reference`); and the
epilogue-fused GEMM1's tile, both layouts' (:func:`gemm1_swiglu_tile`)."""

from typing import Optional

from ..._tilelang import tl_lang as T

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def swiglu(gate, up, limit: Optional[float]):
    """``silu(min(gate, L)) * clamp(up, -L, L)`` (no clamp when ``limit`` is None); the division is IEEE, as
    torch's. ``gate`` and ``up`` are best names bound in the program (``gate = T.Cast(...)``: TileLang makes them
    lets, loaded once and vectorised); a load passed in directly is repeated where the expression uses it."""
    if limit is not None:
        gate = T.min(gate, float(limit))
        up = T.max(T.min(up, float(limit)), -float(limit))
    return T.ieee_fdiv(gate, 1.0 + T.exp(-gate)) * up


def group_scale(amax):
    """A 128-wide group's scale from its absolute maximum: ``max(amax, 1e-4) / 448``."""
    return T.ieee_fdiv(T.max(amax, AMAX_FLOOR), FP8_MAX)


def fp8_code(x, scale):
    """``x`` in e4m3 at ``scale``: ``x / scale`` clamped to the format's range, rounded to nearest even."""
    return T.Cast(FP8, T.max(T.min(T.ieee_fdiv(x, scale), FP8_MAX), -FP8_MAX))


def quantize_rows(rows: int, cols: int):
    """A macro ``quantize(x, amax, scale, q)`` for a float32 fragment ``x [rows, cols]`` of 128-wide groups (one a
    row): ``amax [rows]`` its rows' absolute maxima, ``scale [rows]`` their :func:`group_scale`, ``q [rows, cols]``
    the e4m3 codes (:func:`fp8_code`)."""

    @T.macro
    def quantize(x, amax, scale, q):
        T.reduce_absmax(x, amax, dim=1)
        for i in T.Parallel(rows):
            scale[i] = group_scale(amax[i])
        for i, j in T.Parallel(rows, cols):
            q[i, j] = fp8_code(x[i, j], scale[i])

    return quantize


def row_steps(width: int, groups: int):
    """``(G, groups, quantize)`` for a program that quantises rows of ``width`` (a multiple of 128) ``groups``
    128-column groups a step: ``G`` the groups of a row, ``groups`` lowered to the largest divisor of ``G`` not
    above it, ``quantize`` the step's :func:`quantize_rows` macro."""
    assert width % 128 == 0
    G = width // 128
    groups = max(d for d in range(1, groups + 1) if G % d == 0)
    return G, groups, quantize_rows(groups, 128)


def step_fragments(groups: int):
    """A macro ``() -> (amax, scale, q)``: the fragments a step's :func:`quantize_rows` writes, for ``groups``
    groups."""

    @T.macro
    def alloc():
        amax = T.alloc_fragment((groups,), ACC)
        scale = T.alloc_fragment((groups,), ACC)
        q = T.alloc_fragment((groups, 128), FP8)
        return amax, scale, q

    return alloc


def swiglu_quantize_tile(rows: int, group: int, limit: Optional[float]):
    """A macro ``epilogue(acc, H_s, act, amax, sc, q)`` for the epilogue-fused GEMM1s: the float32 accumulator
    ``acc [rows, 2 group]`` (one group's gate columns, then its up columns) rounded to bf16 in ``H_s``, where the
    halves meet; their SwiGLU in ``act [rows, group]``; then :func:`quantize_rows` into ``amax``, ``sc`` and the
    codes ``q``."""
    quantize = quantize_rows(rows, group)

    @T.macro
    def epilogue(acc, H_s, act, amax, sc, q):
        T.copy(acc, H_s)
        for i, j in T.Parallel(rows, group):
            gate = T.Cast(ACC, H_s[i, j])  # bound once (a let): the halves' loads stay vectorised
            up = T.Cast(ACC, H_s[i, group + j])
            act[i, j] = swiglu(gate, up, limit)
        quantize(act, amax, sc, q)

    return epilogue


def gemm1_swiglu_tile(I: int, K: int, limit: Optional[float], num_stages: int, masked: bool, block_m: int = 64,
                      group: int = 128):
    """``(tile, KS, G)``: a macro ``tile(A, SA, B, SB, e, row0, m, last, bx, sc, q)`` for the epilogue-fused
    GEMM1s (:mod:`.contiguous_swiglu_kernel`, :mod:`.masked_swiglu_kernel`: their docstrings say how a block
    divides the work): ``block_m`` rows from ``row0`` of expert ``e``'s ``A`` (``A[row0 + i]``, or ``A[e, row0 +
    i]`` where ``masked``), rows at or past ``m`` scaled by 0 (``last``: the last row an ``SA`` read may name),
    times the 128 gate and 128 up rows of column group ``bx`` of ``W13_e``; the group's e4m3 codes into the
    fragment ``q [block_m, group]`` and its scales into ``sc [block_m]`` (:func:`swiglu_quantize_tile`). ``KS``:
    the K steps of 128 (the scales' columns), ``G``: the column groups (``I`` and ``K`` multiples of 128)."""
    block_k = 128
    assert I % group == 0 and K % block_k == 0
    KS, G = K // block_k, I // group
    epilogue = swiglu_quantize_tile(block_m, group, limit)

    def row_scale(SA, e, row, k):  # A's scale of ``row`` at K step ``k``
        return SA[e, row, k] if masked else SA[row, k]

    @T.macro
    def tile(A, SA, B, SB, e, row0, m, last, bx, sc, q):
        A_s = T.alloc_shared((block_m, block_k), FP8)
        B_s = T.alloc_shared((2 * group, block_k), FP8)
        scale_g = T.alloc_fragment((block_m,), ACC)
        scale_u = T.alloc_fragment((block_m,), ACC)
        part = T.alloc_fragment((block_m, 2 * group), ACC)
        acc = T.alloc_fragment((block_m, 2 * group), ACC)
        H_s = T.alloc_shared((block_m, 2 * group), BF16)
        act = T.alloc_fragment((block_m, group), ACC)
        amax = T.alloc_fragment((block_m,), ACC)
        T.clear(acc)
        for k in T.Pipelined(KS, num_stages=num_stages):
            if masked:
                T.copy(A[e, row0, k * block_k], A_s)
            else:
                T.copy(A[row0, k * block_k], A_s)
            T.copy(B[e, bx * group, k * block_k], B_s[0:group, :])
            T.copy(B[e, I + bx * group, k * block_k], B_s[group:2 * group, :])
            for i in T.Parallel(block_m):
                scale_g[i] = (T.if_then_else(row0 + i < m, row_scale(SA, e, T.min(row0 + i, last), k), 0.0)
                              * SB[e, bx, k])
            for i in T.Parallel(block_m):
                scale_u[i] = (T.if_then_else(row0 + i < m, row_scale(SA, e, T.min(row0 + i, last), k), 0.0)
                              * SB[e, G + bx, k])
            T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
            for i, j in T.Parallel(block_m, 2 * group):
                acc[i, j] += part[i, j] * T.if_then_else(j < group, scale_g[i], scale_u[i])
        epilogue(acc, H_s, act, amax, sc, q)

    return tile, KS, G
