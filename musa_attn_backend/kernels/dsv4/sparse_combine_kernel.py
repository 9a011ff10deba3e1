"""TileLang merge of the split tokens' partials of the scheduled sparse MQA program (:mod:`.sparse_mqa_sched_kernel`,
plan: :mod:`.schedule`).

One block per (entry of the plan's combine list, query head), 128 threads, four output columns each. For token
``t`` with ``n`` pieces at partial rows ``r .. r + n``: ``m`` = the largest piece LSE (log2 units, the keys only),
``w_i = 2^(lse_i - m)``, ``o = sum_i w_i o_i / (sum_i w_i + 2^(sink log2(e) - m))`` and ``lse = (log2(sum_i w_i) + m)
/ log2(e)`` (natural log, the sink excluded, as DeepSeek-V4's attention returns it). The maximum is over the keys
alone, so the LSE stays finite beside a sink far above them (``+inf`` included: the output is then 0). A token
whose pieces saw no valid entry gets output 0 and the LSE ``empty_lse`` (an argument: ``-inf``, or FlashMLA's
``+inf``). An entry of the list with token -1 (past the split
tokens) returns at once: the grid is fixed by the plan's ``parts``, so the launch can be captured in a CUDA graph.
"""

import functools

from ..._tilelang import tl_lang as T
from ..attention.tl_common import ACC, LOG2E
from . import layout as L

THREADS = 128
CHUNK = 4  # pieces whose partial rows are loaded together


@functools.lru_cache(maxsize=None)
def build_sparse_combine(H: int, has_sink: bool, q_dtype: str = "bfloat16"):
    D = L.D
    NT = T.dynamic("num_tokens")
    PARTS = T.dynamic("num_parts")
    NP = T.dynamic("num_partials")
    NEG_INF = -T.infinity(ACC)
    per = D // THREADS

    @T.prim_func
    def sparse_combine(
        combine: T.Tensor((PARTS, 2), "int32"),
        split_row: T.Tensor((NT,), "int32"),
        O_part: T.Tensor((NP, H, D), ACC),
        L_part: T.Tensor((NP, H), ACC),
        sinks: T.Tensor((H,), "float32"),
        empty_lse: T.float32,
        O: T.Tensor((NT, H, D), q_dtype),
        LSE: T.Tensor((NT, H), "float32"),
    ):
        with T.Kernel(PARTS, H, threads=THREADS) as (c, h):
            tx = T.get_thread_binding()
            acc = T.alloc_local([per], ACC)
            m = T.alloc_var(ACC)
            keys = T.alloc_var(ACC)
            den = T.alloc_var(ACC)
            w = T.alloc_var(ACC)
            t = combine[c, 0]
            n = combine[c, 1]
            if t >= 0:
                r0 = split_row[t]
                m = NEG_INF
                for i in T.serial(n):
                    m = T.max(m, L_part[r0 + i, h])
                for v in T.vectorized(per):
                    acc[v] = 0.0
                keys = 0.0
                if m != NEG_INF:
                    for c0 in T.serial(T.ceildiv(n, CHUNK)):
                        for i in T.unroll(CHUNK):
                            # past the last piece: weight 0 on a re-read of the last row
                            w = T.if_then_else(c0 * CHUNK + i < n,
                                               T.exp2(L_part[r0 + T.min(c0 * CHUNK + i, n - 1), h] - m), 0.0)
                            keys = keys + w
                            for v in T.vectorized(per):
                                acc[v] += w * O_part[r0 + T.min(c0 * CHUNK + i, n - 1), h, tx * per + v]
                den = keys
                if has_sink:
                    den = keys + T.if_then_else(m == NEG_INF, 0.0, T.exp2(sinks[h] * LOG2E - m))
                for v in T.vectorized(per):
                    O[t, h, tx * per + v] = T.Cast(q_dtype, T.if_then_else(keys > 0.0, acc[v] / den, 0.0))
                if tx == 0:
                    LSE[t, h] = T.if_then_else(keys > 0.0, (T.log2(keys) + m) / LOG2E, empty_lse)

    return sparse_combine
