"""TileLang gather of DeepSeek-V4 cache rows into a bf16 workspace (:mod:`.workspace`): row ``n`` of the output is
the dequantised row at slot ``slots[n]`` of the cache (``e4m3 * 2^(exponent - 127)`` for the 448 nope values, the
64 RoPE values as stored; exact in bf16), or zeros where the slot is negative or at or past the cache's slots.

The cache comes in as :mod:`.mqa_kernel` takes it (views of its storage in 16-byte units for the data and 8-byte
units for the scale exponents, the geometry as arguments), so every read is one bounds-checked vector. A block
takes ``ROWS`` rows: their unit offsets into shared memory first (an invalid row's below the buffer), then the
nope values, the RoPE values, each an element a thread in a parallel loop the compiler vectorises. Memory-bound:
584 bytes read and 1,024 written a row.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC
from .. import layout as L
from .mqa_kernel import INVALID16, ROPE16, ROW16, e4m3_to_float

ROWS = 16  # rows a block
THREADS = 256


@functools.lru_cache(maxsize=None)
def build_workspace_rows(fp8_convert: bool = True):
    """The gather for a cache of any geometry. ``fp8_convert``: the e4m3 bytes become values through the target's
    FP8 conversion, else by their fields (as :func:`.mqa_kernel.build_sparse_mqa`)."""
    N = T.dynamic("ws_rows")
    NU = T.dynamic("cache_units16", "int64")
    NS = T.dynamic("cache_units8", "int64")
    nope_dtype = "float8_e4m3" if fp8_convert else "uint8"

    @T.prim_func
    def workspace_rows(
        C8: T.Tensor((NU, 16), nope_dtype), CH: T.Tensor((NU, 8), "bfloat16"), CS: T.Tensor((NS, 8), "uint8"),
        slots: T.Tensor((N,), "int32"),
        rows: T.int32, stride16: T.int64, num_slots: T.int32,  # the cache's geometry (see _glue._flat_views)
        W: T.Tensor((N, L.D), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(N, ROWS), threads=THREADS) as b:
            base_s = T.alloc_shared([ROWS], "int64", scope="shared")
            scale_at_s = T.alloc_shared([ROWS], "int64", scope="shared")
            S8_s = T.alloc_shared([ROWS, L.SCALE_BYTES], "uint8")
            for j in T.Parallel(ROWS):
                s = T.if_then_else(b * ROWS + j < N, slots[T.min(b * ROWS + j, N - 1)], -1)
                ok = T.And(s >= 0, s < num_slots)
                page = T.Cast("int64", T.if_then_else(ok, s // rows, 0))
                row = T.Cast("int64", T.if_then_else(ok, s % rows, 0))
                base_s[j] = T.if_then_else(ok, page * stride16 + row * ROW16, INVALID16)
                scale_at_s[j] = T.if_then_else(ok, page * stride16 * 2 + rows * (L.DATA_BYTES // 8) + row, INVALID16)
            for j, g in T.Parallel(ROWS, L.SCALE_BYTES):
                S8_s[j, g] = T.if_then_else(scale_at_s[j] >= 0, CS[T.max(scale_at_s[j], 0), g], T.Cast("uint8", 0))
            for j, d in T.Parallel(ROWS, L.D_NOPE):
                if b * ROWS + j < N:
                    W[b * ROWS + j, d] = T.if_then_else(
                        base_s[j] >= 0,
                        T.Cast("bfloat16", e4m3_to_float(C8[T.max(base_s[j], 0) + d // 16, d % 16], fp8_convert)
                               * T.exp2(T.Cast(ACC, S8_s[j, d // L.TILE]) - 127.0)),
                        T.Cast("bfloat16", 0))
            for j, d in T.Parallel(ROWS, L.D_ROPE):
                if b * ROWS + j < N:
                    W[b * ROWS + j, L.D_NOPE + d] = T.if_then_else(
                        base_s[j] >= 0, CH[T.max(base_s[j], 0) + ROPE16 + d // 8, d % 8], T.Cast("bfloat16", 0))

    return workspace_rows
