"""TileLang program: the cache slots a DeepSeek-V4 layer's query tokens attend to, in one launch (the rule:
:func:`.slots.attention_slots_reference`).

One block per query token. Window entry ``j`` is position ``p - window + 1 + j`` of the token's request,
translated through the SWA block table; compressed entry ``j`` is the request-local row ``topk[t, j]`` (``mode``
4: the indexer's choice) or ``j`` while ``j < (p + 1) // ratio`` (``mode`` 128: every row the token sees),
translated through the main block table. An entry whose position or row is negative, whose request is ``-1``,
whose block is past its table, or whose table entry is negative is ``-1``; no table read is out of bounds.
"""

import functools

from ...._tilelang import tl_lang as T


@functools.lru_cache(maxsize=None)
def build_attention_slots(window: int, mode: int, threads: int = 128):
    """``mode``: 1 (window only), 4 (window + the indexer's rows), 128 (window + every compressed row)."""
    NT, B1, W1 = T.dynamic("num_tokens"), T.dynamic("swa_rows"), T.dynamic("swa_width")
    B2, W2, K = T.dynamic("main_rows"), T.dynamic("main_width"), T.dynamic("topk")

    def translate(local, r, table, width, rows):
        """Slot of request-local row ``local`` of request ``r`` (``-1`` as described above)."""
        blk = local // rows
        ok = T.And(T.And(local >= 0, r >= 0), blk < width)
        entry = T.if_then_else(ok, table[T.max(r, 0), T.min(T.max(blk, 0), width - 1)], -1)
        return T.if_then_else(T.And(ok, entry >= 0), entry * rows + local % rows, -1)

    @T.prim_func
    def attention_slots(
        P: T.Tensor((NT,), "int32"),
        R: T.Tensor((NT,), "int32"),
        ST: T.Tensor((B1, W1), "int32"),
        MT: T.Tensor((B2, W2), "int32"),
        TK: T.Tensor((NT, K), "int32"),
        WS: T.Tensor((NT, window), "int32"),
        CS: T.Tensor((NT, K), "int32"),
        swa_block: T.int32,
        main_rows: T.int32,
        ratio: T.int32,
    ):
        with T.Kernel(NT, threads=threads) as t:
            seen = T.alloc_local([1], "int32")  # compressed rows the token sees (mode 128)
            r = R[t]
            p = P[t]
            seen[0] = T.if_then_else(p >= 0, (p + 1) // ratio, 0)
            for c in T.serial(T.ceildiv(window, threads)):
                for i in T.Parallel(threads):
                    j = c * threads + i
                    if j < window:
                        loc = T.if_then_else(p >= 0, p - (window - 1) + j, -1)
                        WS[t, j] = translate(loc, r, ST, W1, swa_block)
            if mode != 1:
                for c in T.serial(T.ceildiv(K, threads)):
                    for i in T.Parallel(threads):
                        j = c * threads + i
                        if j < K:
                            if mode == 4:  # a padding row (position -1) names no row, whatever topk holds
                                CS[t, j] = T.if_then_else(p >= 0, translate(TK[t, j], r, MT, W2, main_rows), -1)
                            else:
                                CS[t, j] = T.if_then_else(j < seen[0], translate(j, r, MT, W2, main_rows), -1)

    return attention_slots
