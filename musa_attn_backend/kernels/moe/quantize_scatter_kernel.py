"""TileLang program: each token's activation row quantised 1 x 128 once and written to the rows of its choices
(the rule: :func:`.layer.quantize_scatter_reference`, the op: :func:`quantize_scatter`)::

    S[t, g]   = max(amax(X[t, 128 g : 128 g + 128]), 1e-4) / 448        # float32
    Q[t, c]   = e4m3(clamp(X[t, c] / S[t, c / 128], -448, 448))
    A[r], SA[r] = Q[t], S[t]   for each r = dest[t, j] in [0, R)

One block a token, ``groups`` 128-column groups a step; the quantised groups are written to each named row while
they are in registers. A destination outside ``[0, R)`` (a dropped choice) is skipped, and rows no destination
names are not written. The divisions are IEEE, as torch's (:mod:`.swiglu_tir`).
"""

import functools

from ..._tilelang import tl_lang as T
from .swiglu_tir import row_steps, step_fragments

FP8 = "float8_e4m3"
ACC = "float32"
BF16 = "bfloat16"


@functools.lru_cache(maxsize=None)
def build_quantize_scatter(H: int, k: int, groups: int = 4, threads: int = 128):
    """``H``: the row width (a multiple of 128); ``k``: choices a token. The token count and ``R`` are dynamic."""
    G, groups, quantize = row_steps(H, groups)
    fragments = step_fragments(groups)
    n, R = T.dynamic("tokens"), T.dynamic("rows")

    @T.prim_func
    def quantize_scatter(
        X: T.Tensor((n, H), BF16),
        dest: T.Tensor((n, k), "int32"),
        A: T.Tensor((R, H), FP8),
        SA: T.Tensor((R, G), ACC),
    ):
        with T.Kernel(n, threads=threads) as t:
            x = T.alloc_fragment((groups, 128), ACC)
            amax, scale, q = fragments()
            for step in T.serial(G // groups):
                for g, c in T.Parallel(groups, 128):
                    x[g, c] = T.Cast(ACC, X[t, (step * groups + g) * 128 + c])
                quantize(x, amax, scale, q)
                for j in T.serial(k):
                    if T.And(dest[t, j] >= 0, dest[t, j] < R):
                        for g, c in T.Parallel(groups, 128):
                            A[dest[t, j], (step * groups + g) * 128 + c] = q[g, c]
                        for g in T.Parallel(groups):
                            SA[dest[t, j], step * groups + g] = scale[g]

    return quantize_scatter
