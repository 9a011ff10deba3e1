"""TileLang combine program: merges the split-KV decode's partial outputs and LSEs into the final output
(conventions: :mod:`.tl_common`)."""

import functools

from ..._tilelang import tl_lang as T
from .tl_common import ACC, LOG2E, NEG_INF


@functools.lru_cache(maxsize=None)
def build_combine(Hq: int, DV: int, q_dtype: str, has_sinks: bool, threads: int = 128, pdl: bool = False,
                  max_splits: int = 0, chunk: int = 8, sink_in_lse: bool = True):
    """Merge split-KV partials: ``O = sum_s 2^(lse_s - lse) o_s`` with ``lse = log2 sum_s 2^lse_s`` (+ sink;
    ``sink_in_lse=False``: the sink in the output's denominator only, the LSE over the keys alone, as
    DeepSeek-V4's attention returns it).
    ``pdl``: launched as a programmatic dependent of the decode kernel; it waits for the decode grid's
    completion (and its memory) before it reads a partial.

    ``max_splits`` (0: one split after the other, each a dependent round trip to L2): the block reads all the
    partial LSEs at once into shared memory (at most ``max_splits``, the launcher's cap), then the partial
    outputs ``chunk`` splits at a time, unrolled, so their loads are in flight together (past the last split a
    chunk re-reads it with weight 0)."""
    NT = T.dynamic("num_tokens")
    SPLITS = T.dynamic("num_splits")

    @T.prim_func
    def combine(
        O_part: T.Tensor((SPLITS, NT, Hq, DV), ACC),
        L_part: T.Tensor((SPLITS, NT, Hq), ACC),
        sinks: T.Tensor((Hq,), "float32"),
        O: T.Tensor((NT, Hq, DV), q_dtype),
        LSE: T.Tensor((NT, Hq), "float32"),
    ):
        with T.Kernel(NT, Hq, threads=threads) as (t, h):
            if pdl:
                T.pdl_sync()
            acc = T.alloc_fragment([DV], ACC)
            m = T.alloc_var(ACC)
            total = T.alloc_var(ACC)
            keys = T.alloc_var(ACC)  # the keys' part of total (without the sink)
            w = T.alloc_var(ACC)
            m = NEG_INF
            if max_splits:
                lse_s = T.alloc_shared([max_splits], ACC)
                for s in T.Parallel(max_splits):
                    lse_s[s] = T.if_then_else(s < SPLITS, L_part[T.min(s, SPLITS - 1), t, h], NEG_INF)
                for c in T.serial(T.ceildiv(SPLITS, chunk)):
                    for j in T.unroll(chunk):
                        m = T.max(m, lse_s[c * chunk + j])
            else:
                for s in T.serial(SPLITS):
                    m = T.max(m, L_part[s, t, h])
            if has_sinks and sink_in_lse:
                # the sink is part of the LSE: it takes part in the maximum (the sinks this serves are finite).
                # Without it (V4), the maximum is over the keys alone, so that the keys' LSE stays finite beside a
                # sink far above them (+inf included: FlashMLA's "+inf sink makes the output 0")
                m = T.max(m, sinks[h] * LOG2E)
            total = 0.0
            keys = 0.0
            T.fill(acc, 0)
            if m != NEG_INF:
                if max_splits:
                    for c in T.serial(T.ceildiv(SPLITS, chunk)):
                        for j in T.unroll(chunk):
                            w = T.exp2(lse_s[c * chunk + j] - m)  # 0 past the last split (its LSE is -inf)
                            total = total + w
                            for d in T.Parallel(DV):
                                acc[d] += w * O_part[T.min(c * chunk + j, SPLITS - 1), t, h, d]
                else:
                    for s in T.serial(SPLITS):
                        w = T.exp2(L_part[s, t, h] - m)
                        total = total + w
                        for d in T.Parallel(DV):
                            acc[d] += w * O_part[s, t, h, d]
                keys = total
                if has_sinks:
                    total = total + T.exp2(sinks[h] * LOG2E - m)
            for d in T.Parallel(DV):
                O[t, h, d] = T.Cast(q_dtype, T.if_then_else(total > 0.0, acc[d] / total, 0.0))
            if sink_in_lse:
                LSE[t, h] = T.if_then_else(total > 0.0, (T.log2(total) + m) / LOG2E, NEG_INF)
            else:
                LSE[t, h] = T.if_then_else(keys > 0.0, (T.log2(keys) + m) / LOG2E, NEG_INF)

    return combine
