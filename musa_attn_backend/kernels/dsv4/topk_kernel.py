"""TileLang top-k of the indexer logits (the semantics: :mod:`.indexer_reference`): one block per row, an exact
radix select on the logits' order-preserving 32-bit keys.

A row whose range holds at most ``k`` columns writes its positions in order. Otherwise four passes over the
row, 8 bits at a time from the top, histogram the keys that share the prefix found so far and pick the bin that
holds the k-th largest key; after them the prefix is that key (``tau``) and ``need`` says how many keys equal to
it belong to the top-k. A last pass writes every position whose key is above ``tau`` (there are exactly
``k - need``) and the first ``need`` positions equal to it. Each pass reads the row from global memory: no
staging buffer whose size a skewed row could overflow, so every distribution is handled the same way.

Keys: ``u = bits(x)``; ``key = ~u`` for negative ``x``, ``u | 2^31`` otherwise, so that keys order as the
values do; NaN gets key 0, below ``-inf``. Synchronisation is placed by hand (TileLang's automatic placement is
off): the histogram, the scan and the selection are separated by block-wide barriers outside any branch.
"""

import functools

from ..._tilelang import tl_lang as T

RADIX = 256


def order_key(u):
    """The order-preserving key of a float32's bits ``u`` (uint32); NaN (exponent all ones, mantissa not zero:
    tested on the bits, which no floating-point simplification can drop) gets 0."""
    key = T.if_then_else(u >= T.Cast("uint32", 0x80000000), ~u, u | T.Cast("uint32", 0x80000000))
    return T.if_then_else((u & T.Cast("uint32", 0x7FFFFFFF)) > T.Cast("uint32", 0x7F800000), T.Cast("uint32", 0), key)


@functools.lru_cache(maxsize=None)
def build_indexer_topk(k: int, page_rows: int = 0, threads: int = 512, unroll: int = 8):
    """Top-``k`` positions of each row of ``Logits`` (a flat view, rows ``row_stride`` apart) over the columns
    ``[starts[t], starts[t] + lengths[t])`` cut to ``[0, num_cols)``; ``page_rows`` > 0: returned as slots through
    ``table`` (``page_rows`` a page; ``-1`` where the position's entry is negative or past the table). A pass
    loads ``unroll`` logits a thread (coalesced, all in flight) before it histograms them."""
    U = unroll
    paged = page_rows > 0
    NT, NL, P = T.dynamic("num_rows"), T.dynamic("logits_elems"), T.dynamic("table_width")

    def slot_of(table, t, i):
        """What a chosen position ``i`` of row ``t`` is returned as: itself, or its slot through the table."""
        if not paged:
            return i
        entry = table[t, T.min(i // page_rows, P - 1)]
        return T.if_then_else(T.And(i // page_rows < P, entry >= 0), entry * page_rows + i % page_rows, -1)

    @T.prim_func
    def indexer_topk(
        Logits: T.Tensor((NL,), "float32"),
        lengths: T.Tensor((NT,), "int32"),
        starts: T.Tensor((NT,), "int32"),
        table: T.Tensor((NT, P), "int32"),
        row_stride: T.int32,
        num_cols: T.int32,
        Out: T.Tensor((NT, k), "int32"),
    ):
        with T.Kernel(NT, threads=threads) as t:
            tx = T.get_thread_binding()
            hist = T.alloc_shared([RADIX], "int32", scope="shared")
            suf = T.alloc_shared([RADIX + 1], "int32", scope="shared")  # suf[b]: keys in bins >= b
            pick = T.alloc_shared([2], "int32", scope="shared")  # the chosen bin, the keys above it
            count = T.alloc_shared([2], "int32", scope="shared")  # positions written above tau / equal to it
            prefix = T.alloc_var("uint32")
            bits = T.alloc_local([U], "uint32")  # logits' bits, loaded once (at indices kept inside the buffer)
            key = T.alloc_var("uint32")
            need = T.alloc_var("int32")
            v = T.alloc_var("int32")

            s0 = T.max(T.min(starts[t], num_cols), 0)
            n = T.max(T.min(lengths[t], num_cols - s0), 0)
            base = t * row_stride + s0

            if n <= k:
                for c in T.serial(T.ceildiv(k, threads)):
                    i = c * threads + tx
                    if i < k:
                        Out[t, i] = T.if_then_else(i < n, slot_of(table, t, i), -1)
            else:
                prefix = T.Cast("uint32", 0)
                need = k
                for p in T.serial(4):
                    shift = T.Cast("uint32", 24 - 8 * p)
                    above = ~(T.Cast("uint32", 0xFFFFFFFF) >> T.Cast("uint32", 8 * p))  # the bits fixed so far
                    if tx < RADIX:
                        hist[tx] = 0
                    T.sync_threads()
                    for c in T.serial(T.ceildiv(n, threads * U)):
                        for u in T.unroll(U):
                            bits[u] = T.reinterpret(Logits[T.min(base + (c * U + u) * threads + tx, NL - 1)],
                                                    "uint32")
                        for u in T.unroll(U):
                            if (c * U + u) * threads + tx < n:
                                key = order_key(bits[u])
                                # the keys whose bits above this pass's byte equal the prefix found so far
                                if (key & above) == prefix:
                                    T.atomic_add(hist[T.Cast("int32", (key >> shift) & T.Cast("uint32", 255))], 1)
                    T.sync_threads()
                    if tx < RADIX:
                        suf[tx] = hist[tx]
                    if tx == 0:
                        suf[RADIX] = 0
                    T.sync_threads()
                    for step in T.unroll(8):  # suffix sums, Hillis-Steele
                        if tx < RADIX:
                            v = suf[tx] + T.if_then_else(tx + (1 << step) < RADIX, suf[T.min(tx + (1 << step),
                                                                                               RADIX - 1)], 0)
                        T.sync_threads()
                        if tx < RADIX:
                            suf[tx] = v
                        T.sync_threads()
                    if tx < RADIX:
                        if T.And(suf[tx] >= need, suf[tx + 1] < need):
                            pick[0] = tx
                            pick[1] = suf[tx + 1]
                    T.sync_threads()
                    prefix = prefix | (T.Cast("uint32", pick[0]) << shift)
                    need = need - pick[1]
                    T.sync_threads()
                if tx < 2:
                    count[tx] = 0
                T.sync_threads()
                for c in T.serial(T.ceildiv(n, threads * U)):
                    for u in T.unroll(U):
                        bits[u] = T.reinterpret(Logits[T.min(base + (c * U + u) * threads + tx, NL - 1)], "uint32")
                    for u in T.unroll(U):
                        i = (c * U + u) * threads + tx
                        if i < n:
                            key = order_key(bits[u])
                            if key > prefix:
                                pos = T.atomic_add(count[0], 1, return_prev=True)
                                if pos < k - need:  # always true: exactly k - need keys lie above tau
                                    Out[t, pos] = slot_of(table, t, i)
                            elif key == prefix:
                                e = T.atomic_add(count[1], 1, return_prev=True)
                                if e < need:
                                    Out[t, k - need + e] = slot_of(table, t, i)

    return indexer_topk
