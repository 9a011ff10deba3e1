"""TileLang program: V4's clamped SwiGLU of GEMM1's output rows, quantised 1 x 128 for GEMM2, in one pass (the
rule: :func:`.reference.swiglu_quant_reference`): for each ``r = rows[i]`` in ``[0, R)``::

    act       = silu(min(gate, L)) * clamp(up, -L, L)     # float32, gate = H[r, :I], up = H[r, I:]
    S[r, g]   = max(amax(act[128 g : 128 g + 128]), 1e-4) / 448
    Q[r, c]   = e4m3(clamp(act[c] / S[r, c / 128], -448, 448))

One block a chosen row, ``groups`` 128-column groups a step; a row index outside ``[0, R)`` (a dropped choice) makes
its block exit before reading anything, and rows no index names are not written. The scale and the division are
IEEE (``T.ieee_fdiv``), as torch's; the sigmoid's exponential is the fast one, so ``act`` can differ from torch's
in its last bits and a value on an e4m3 rounding boundary can land one e4m3 step away.
"""

import functools
from typing import Optional

from ..._tilelang import tl_lang as T
from .swiglu_tir import row_steps, step_fragments, swiglu

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"


@functools.lru_cache(maxsize=None)
def build_swiglu_quant(I: int, limit: Optional[float], groups: int = 4, threads: int = 128):
    """``I``: the intermediate size (a multiple of 128); ``limit``: V4's clamp (None: plain SwiGLU). The row count
    ``R`` and the number of chosen rows are dynamic."""
    G, groups, quantize = row_steps(I, groups)
    fragments = step_fragments(groups)
    R, n = T.dynamic("rows"), T.dynamic("chosen")

    @T.prim_func
    def swiglu_quant(
        H: T.Tensor((R, 2 * I), BF16),
        rows: T.Tensor((n,), "int32"),
        Q: T.Tensor((R, I), FP8),
        S: T.Tensor((R, G), ACC),
    ):
        with T.Kernel(n, threads=threads) as i:
            act = T.alloc_fragment((groups, 128), ACC)
            amax, scale, q = fragments()
            r = rows[i]
            if T.And(r >= 0, r < R):
                for step in T.serial(G // groups):
                    for g, c in T.Parallel(groups, 128):
                        gate = T.Cast(ACC, H[r, (step * groups + g) * 128 + c])  # a let: vectorised loads
                        up = T.Cast(ACC, H[r, I + (step * groups + g) * 128 + c])
                        act[g, c] = swiglu(gate, up, limit)
                    quantize(act, amax, scale, q)
                    for g, c in T.Parallel(groups, 128):
                        Q[r, (step * groups + g) * 128 + c] = q[g, c]
                    for g in T.Parallel(groups):
                        S[r, step * groups + g] = scale[g]

    return swiglu_quant
