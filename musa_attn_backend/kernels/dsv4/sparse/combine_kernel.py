"""TileLang merge of the split tokens' partials of the scheduled sparse MQA program (:mod:`.sched_kernel`,
plan: :mod:`.schedule`).

For token ``t`` with ``n`` pieces at partial rows ``r .. r + n``: ``m`` = the largest piece LSE (log2 units, the keys
only), ``w_i = 2^(lse_i - m)``, ``o = sum_i w_i o_i / (sum_i w_i + 2^(sink log2(e) - m))`` and ``lse = (log2(sum_i
w_i) + m) / log2(e)`` (natural log, the sink excluded, as DeepSeek-V4's attention returns it). The maximum is over the
keys alone, so the LSE stays finite beside a sink far above them (``+inf`` included: the output is then 0). A token
whose pieces saw no valid entry gets output 0 and the LSE ``empty_lse`` (an argument: ``-inf``, or FlashMLA's
``+inf``).

The pieces are taken ``CHUNK`` at a time, each chunk's LSEs and partial rows loaded together (independent loads,
one memory round trip a chunk), the maximum carried across chunks as an online softmax carries it (the sums so far
scaled by ``2^(m_old - m_new)``; with at most ``CHUNK`` pieces, the common decode case, that scale is never applied
to anything but zeros). The form before (one load of an LSE at a time for the maximum, then the chunks; 4083e77)
measured 0.6-1.4 µs slower (docs/dsv4.md).

The grid is fixed by the launch's shapes (so it can be captured in a CUDA graph) and small: ``groups`` blocks
along the plan's combine list, each walking every ``groups``-th of its ``num_split`` entries (a count on the device:
walking all ``parts`` rows, most of them past the list's end, made serial loads the one-token decode's largest
cost; docs/dsv4.md), times blocks of 8 heads, one warp a head and 16 output columns a lane. A batch with no split
token costs a few blocks that read one count each.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E
from .. import layout as L

HEADS_PER_BLOCK = 8  # a warp a head
MAX_GROUPS = 32  # blocks along the combine list
THREADS = 32 * HEADS_PER_BLOCK
COLS = L.D // 32  # output columns a lane
CHUNK = 4  # pieces whose partial rows are loaded together


@functools.lru_cache(maxsize=None)
def build_sparse_combine(H: int, has_sink: bool, q_dtype: str = "bfloat16", pdl: bool = False):
    """The merge for ``H`` heads; ``pdl``: launched as a programmatic dependent of the scheduled program, every
    block waits for that grid's completion (and its writes) at its start, so that the merge's completion (what the
    stream's next kernel waits for) follows the program's, whose unsplit tokens' outputs it does not touch."""
    D = L.D
    NT = T.dynamic("num_tokens")
    PARTS = T.dynamic("num_parts")
    NP = T.dynamic("num_partials")
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + HEADS_PER_BLOCK - 1) // HEADS_PER_BLOCK

    @T.prim_func
    def sparse_combine(
        combine: T.Tensor((PARTS, 2), "int32"),
        num_split: T.Tensor((1,), "int32"),
        split_row: T.Tensor((NT,), "int32"),
        O_part: T.Tensor((NP, H, D), ACC),
        L_part: T.Tensor((NP, H), ACC),
        sinks: T.Tensor((H,), "float32"),
        empty_lse: T.float32,
        groups: T.int32,
        O: T.Tensor((NT, H, D), q_dtype),
        LSE: T.Tensor((NT, H), "float32"),
    ):
        with T.Kernel(groups, head_blocks, threads=THREADS) as (g, hb):
            if pdl:  # every block, even one with no token to merge: the grid then completes after the program's
                T.pdl_sync()
            tx = T.get_thread_binding()
            h = hb * HEADS_PER_BLOCK + tx // 32
            lane = tx % 32
            acc = T.alloc_local([COLS], ACC)
            lv = T.alloc_local([CHUNK], ACC)  # a chunk's piece LSEs
            ov = T.alloc_local([CHUNK, COLS], ACC)  # and their partial rows' columns of this lane
            mn = T.alloc_var(ACC)
            m = T.alloc_var(ACC)
            keys = T.alloc_var(ACC)
            den = T.alloc_var(ACC)
            w = T.alloc_var(ACC)
            listed = T.min(num_split[0], PARTS)  # the split tokens (at most parts - 1)
            for c in T.serial(T.ceildiv(T.max(listed - g, 0), groups)):
                t = combine[g + c * groups, 0]
                n = combine[g + c * groups, 1]
                if T.And(t >= 0, h < H):
                    r0 = split_row[t]
                    m = NEG_INF
                    for v in T.vectorized(COLS):
                        acc[v] = 0.0
                    keys = 0.0
                    for c0 in T.serial(T.ceildiv(n, CHUNK)):
                        # past the last piece: LSE -inf (weight 0) on a re-read of the last row
                        for i in T.unroll(CHUNK):
                            lv[i] = T.if_then_else(c0 * CHUNK + i < n,
                                                   L_part[r0 + T.min(c0 * CHUNK + i, n - 1), h], NEG_INF)
                            for v in T.vectorized(COLS):
                                ov[i, v] = O_part[r0 + T.min(c0 * CHUNK + i, n - 1), h, lane * COLS + v]
                        mn = m
                        for i in T.unroll(CHUNK):
                            mn = T.max(mn, lv[i])
                        if mn != NEG_INF:  # else every piece so far saw no valid entry: nothing to add
                            w = T.exp2(m - mn)  # 0 at the first chunk with a valid piece (m = -inf)
                            keys = keys * w
                            for v in T.vectorized(COLS):
                                acc[v] = acc[v] * w
                            for i in T.unroll(CHUNK):
                                w = T.exp2(lv[i] - mn)
                                keys = keys + w
                                for v in T.vectorized(COLS):
                                    acc[v] += w * ov[i, v]
                            m = mn
                    den = keys
                    if has_sink:
                        den = keys + T.if_then_else(m == NEG_INF, 0.0, T.exp2(sinks[h] * LOG2E - m))
                    for v in T.vectorized(COLS):
                        O[t, h, lane * COLS + v] = T.Cast(q_dtype, T.if_then_else(keys > 0.0, acc[v] / den, 0.0))
                    if lane == 0:
                        LSE[t, h] = T.if_then_else(keys > 0.0, (T.log2(keys) + m) / LOG2E, empty_lse)

    return sparse_combine
