"""TIR expressions shared by the programs that compute V4's SwiGLU and the 1 x 128 FP8 quantisation GEMM2 reads
(:mod:`.swiglu_quant_kernel`, :mod:`.contiguous_swiglu_kernel`, :mod:`.masked_swiglu_kernel`,
:mod:`.quantize_scatter_kernel`), in float32, with
the reference's order of operations (:func:`.layer.swiglu`, :func:`.reference.quantize_groups_reference`)."""

from typing import Optional

from ..._tilelang import tl_lang as T

FP8 = "float8_e4m3"
ACC = "float32"
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
