"""TileLang program: the weighted sum of each token's expert outputs (the rule: :func:`.layer.combine_reference`, the op: :func:`combine_experts`)::

    O[t, c] = bf16( sum_j W[t, j] * Y[rows[t, j], c] )     # float32, j = 0 .. k-1 in order; rows outside [0, R): 0

One block a token and a ``block``-column slice of it; the ``k`` chosen rows are read once each, as bf16, and only
those (the GEMMs leave the other rows of ``Y`` unwritten). No intermediate ``[T, k, H]`` tensor exists.
"""

import functools

from ..._tilelang import tl_lang as T

ACC = "float32"
BF16 = "bfloat16"


@functools.lru_cache(maxsize=None)
def build_combine_experts(H: int, k: int, block: int = 1024, threads: int = 128):
    """``H``: the row width (a multiple of ``block``); ``k``: choices a token. The rows of ``Y`` and the token
    count are dynamic."""
    assert H % block == 0 and block % threads == 0
    R, n = T.dynamic("rows"), T.dynamic("tokens")

    @T.prim_func
    def combine_experts(
        Y: T.Tensor((R, H), BF16),
        rows: T.Tensor((n, k), "int32"),
        W: T.Tensor((n, k), ACC),
        O: T.Tensor((n, H), BF16),
    ):
        with T.Kernel(n, H // block, threads=threads) as (t, bx):  # tokens on x: no 65,535 cap
            acc = T.alloc_fragment((block,), ACC)
            T.clear(acc)
            for j in T.serial(k):
                if T.And(rows[t, j] >= 0, rows[t, j] < R):
                    for c in T.Parallel(block):
                        acc[c] += W[t, j] * T.Cast(ACC, Y[rows[t, j], bx * block + c])
            for c in T.Parallel(block):
                O[t, bx * block + c] = T.Cast(BF16, acc[c])

    return combine_experts
