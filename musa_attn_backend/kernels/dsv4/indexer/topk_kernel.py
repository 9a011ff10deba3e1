"""TileLang top-k of the indexer logits (the semantics: :mod:`.reference`): one block per row, an exact
radix select on the logits' order-preserving 32-bit keys, with the few keys that decide it kept in shared memory.

A row whose range holds at most ``k`` columns writes its positions in order. Otherwise the key's 32 bits are
taken in three levels from the top (11, 11 and 10 bits). At a level, a pass over the row (from global memory)
histograms the keys that share the prefix found so far and picks the bin that holds the k-th largest key; the
prefix grows by that bin and ``need`` says how many keys of the bin still belong to the top-k. As soon as the
chosen bin holds at most ``cap`` keys (or at the last level), one more pass over the row writes every key above
the bin's prefix (all of them belong to the top-k) and copies the bin's keys and positions into shared memory;
the remaining levels and the last selection run there. A random row of 64k logits settles at the first level, so
the row is read twice; a row whose keys crowd into one bin reads up to four times, and a row of ties ends at the
last level, writing the first ``need`` keys equal to the full key ``tau``.

Output: the keys above ``tau`` at ``[0, k - need)`` and ``need`` keys equal to it at ``[k - need, k)``, in the
order of the atomics. Keys: ``u = bits(x)``; ``key = ~u`` for negative ``x``, ``u | 2^31`` otherwise, so that
keys order as the values do; NaN gets key 0, below ``-inf``. Synchronisation is placed by hand (TileLang's
automatic placement is off): every barrier sits under a condition the whole block shares.
"""

import functools

from ...._tilelang import tl_lang as T

RADIX = 2048  # bins of a level (the last level uses 1024)
LEVEL_BITS = 11


def order_key(u):
    """The order-preserving key of a float32's bits ``u`` (uint32); NaN (exponent all ones, mantissa not zero:
    tested on the bits, which no floating-point simplification can drop) gets 0."""
    key = T.if_then_else(u >= T.Cast("uint32", 0x80000000), ~u, u | T.Cast("uint32", 0x80000000))
    return T.if_then_else((u & T.Cast("uint32", 0x7FFFFFFF)) > T.Cast("uint32", 0x7F800000), T.Cast("uint32", 0), key)


def level_shift(level):
    """The lowest bit of a level's bin: 21, 10, 0."""
    return T.Cast("uint32", T.max(32 - LEVEL_BITS * (level + 1), 0))


def fixed_above(level):
    """The bits fixed before a level: none, the top 11, the top 22."""
    return ~(T.Cast("uint32", 0xFFFFFFFF) >> T.Cast("uint32", LEVEL_BITS * level))


def fixed_through(level):
    """The bits fixed once a level's bin is chosen."""
    return ~((T.Cast("uint32", 1) << level_shift(level)) - T.Cast("uint32", 1))


@functools.lru_cache(maxsize=None)
def build_indexer_topk(k: int, page_rows: int = 0, threads: int = 1024, unroll: int = 8, cap: int = 4096):
    """Top-``k`` positions of each row of ``Logits`` (a flat view, rows ``row_stride`` apart) over the columns
    ``[starts[t], starts[t] + lengths[t])`` cut to ``[0, num_cols)``; ``page_rows`` > 0: returned as slots through
    ``table`` (``page_rows`` a page; ``-1`` where the position's entry is negative or past the table). A pass over
    the row loads ``unroll`` logits a thread (coalesced, all in flight) before it uses them; ``cap`` keys of the
    deciding bin fit in shared memory."""
    U = unroll
    BPT = RADIX // threads  # bins a thread sums in the scan
    paged = page_rows > 0
    NT, NL, P = T.dynamic("num_rows"), T.dynamic("logits_elems"), T.dynamic("table_width")
    assert RADIX % threads == 0 and threads & (threads - 1) == 0

    def slot_of(table, t, i):
        """What a chosen position ``i`` of row ``t`` is returned as: itself, or its slot through the table."""
        if not paged:
            return i
        entry = table[t, T.min(i // page_rows, P - 1)]
        return T.if_then_else(T.And(i // page_rows < P, entry >= 0), entry * page_rows + i % page_rows, -1)

    @T.macro
    def clear_hist(hist, tx):
        for b in T.unroll(BPT):
            hist[tx * BPT + b] = 0
        T.sync_threads()

    @T.macro
    def choose_bin(hist, suf, pick, st, pf, tx, lv):
        """From ``hist``: the bin holding the ``need``-th largest key (a suffix sum over the threads' bins,
        Hillis-Steele); the prefix ``pf[0]``, ``need`` (``st[0]``) and the bin's key count (``st[2]``) follow it."""
        v = T.alloc_var("int32")
        v = 0
        for b in T.unroll(BPT):
            v = v + hist[tx * BPT + b]
        suf[tx] = v
        if tx == 0:
            suf[threads] = 0
        T.sync_threads()
        for step in T.unroll(threads.bit_length() - 1):
            v = suf[tx] + T.if_then_else(tx + (1 << step) < threads, suf[T.min(tx + (1 << step), threads - 1)], 0)
            T.sync_threads()
            suf[tx] = v
            T.sync_threads()
        v = suf[tx + 1]  # keys in the bins above this thread's
        for b in T.unroll(BPT):
            if T.And(v < st[0], v + hist[tx * BPT + BPT - 1 - b] >= st[0]):
                pick[0] = tx * BPT + BPT - 1 - b
                pick[1] = v
            v = v + hist[tx * BPT + BPT - 1 - b]
        T.sync_threads()
        pf[0] = pf[0] | (T.Cast("uint32", pick[0]) << level_shift(lv))
        st[0] = st[0] - pick[1]
        st[2] = hist[pick[0]]
        T.sync_threads()

    @T.macro
    def place(Out, count, table, st, pf, slot, t, key, i):
        """Write position ``i`` if its key (``tau``'s bits all fixed) belongs to the top-k: above ``tau`` at the
        front, the first ``need`` equal to it at the back. ``slot`` holds the atomic's result: a let-bound result
        would be inlined into every use, each a new atomic."""
        if key > pf[0]:
            slot[0] = T.atomic_add(count[0], 1, return_prev=True)
            Out[t, slot[0]] = slot_of(table, t, i)
        elif key == pf[0]:
            slot[0] = T.atomic_add(count[1], 1, return_prev=True)
            if slot[0] < st[0]:
                Out[t, k - st[0] + slot[0]] = slot_of(table, t, i)

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
            suf = T.alloc_shared([threads + 1], "int32", scope="shared")  # suf[x]: keys in thread x's bins and up
            pick = T.alloc_shared([2], "int32", scope="shared")  # the chosen bin, the keys above it
            count = T.alloc_shared([3], "int32", scope="shared")  # written above tau, equal to tau; bin keys kept
            cand_key = T.alloc_shared([cap], "uint32", scope="shared")
            cand_pos = T.alloc_shared([cap], "int32", scope="shared")
            pf = T.alloc_local([1], "uint32")  # the prefix of tau found so far
            # need (keys of the chosen bin that still belong to the top-k), the level whose bin the kept keys
            # are (3: not settled yet), the chosen bin's key count
            st = T.alloc_local([3], "int32")
            bits = T.alloc_local([U], "uint32")  # logits' bits, loaded once (at indices kept inside the buffer)
            slot = T.alloc_local([1], "int32")  # an atomic's result, stored (see place)
            key = T.alloc_var("uint32")
            kept = T.alloc_var("int32")

            s0 = T.max(T.min(starts[t], num_cols), 0)
            n = T.max(T.min(lengths[t], num_cols - s0), 0)
            base = t * row_stride + s0

            if n <= k:
                for c in T.serial(T.ceildiv(k, threads)):
                    i = c * threads + tx
                    if i < k:
                        Out[t, i] = T.if_then_else(i < n, slot_of(table, t, i), -1)
            else:
                pf[0] = T.Cast("uint32", 0)
                st[0] = k
                st[1] = 3
                for lv in T.serial(3):  # the levels read from global memory, until the chosen bin fits
                    if st[1] == 3:
                        clear_hist(hist, tx)
                        for c in T.serial(T.ceildiv(n, threads * U)):
                            for u in T.unroll(U):
                                bits[u] = T.reinterpret(Logits[T.min(base + (c * U + u) * threads + tx, NL - 1)],
                                                        "uint32")
                            for u in T.unroll(U):
                                if (c * U + u) * threads + tx < n:
                                    key = order_key(bits[u])
                                    if (key & fixed_above(lv)) == pf[0]:  # the keys under the prefix so far
                                        T.atomic_add(hist[T.Cast("int32", (key & ~fixed_above(lv))
                                                                 >> level_shift(lv))], 1)
                        T.sync_threads()
                        choose_bin(hist, suf, pick, st, pf, tx, lv)
                        if T.Or(st[2] <= cap, lv == 2):
                            st[1] = lv
                if tx < 3:
                    count[tx] = 0
                T.sync_threads()
                # keys above the chosen bin go out now, the bin's own keys to shared memory (at the last level,
                # where the bin is the full key tau, out directly)
                for c in T.serial(T.ceildiv(n, threads * U)):
                    for u in T.unroll(U):
                        bits[u] = T.reinterpret(Logits[T.min(base + (c * U + u) * threads + tx, NL - 1)], "uint32")
                    for u in T.unroll(U):
                        if (c * U + u) * threads + tx < n:
                            key = order_key(bits[u])
                            if st[1] == 2:
                                place(Out, count, table, st, pf, slot, t, key, (c * U + u) * threads + tx)
                            elif (key & fixed_through(st[1])) > pf[0]:
                                slot[0] = T.atomic_add(count[0], 1, return_prev=True)
                                Out[t, slot[0]] = slot_of(table, t, (c * U + u) * threads + tx)
                            elif (key & fixed_through(st[1])) == pf[0]:
                                slot[0] = T.atomic_add(count[2], 1, return_prev=True)
                                if slot[0] < cap:  # always true: the bin holds st[2] <= cap keys
                                    cand_key[slot[0]] = key
                                    cand_pos[slot[0]] = (c * U + u) * threads + tx
                T.sync_threads()
                kept = T.min(count[2], cap)
                for j in T.serial(2):  # the levels after the settled one, over the kept keys
                    if j + 1 > st[1]:
                        clear_hist(hist, tx)
                        for c in T.serial(T.ceildiv(kept, threads)):
                            if c * threads + tx < kept:
                                key = cand_key[c * threads + tx]
                                if (key & fixed_above(j + 1)) == pf[0]:
                                    T.atomic_add(hist[T.Cast("int32", (key & ~fixed_above(j + 1))
                                                             >> level_shift(j + 1))], 1)
                        T.sync_threads()
                        choose_bin(hist, suf, pick, st, pf, tx, j + 1)
                if st[1] < 2:
                    for c in T.serial(T.ceildiv(kept, threads)):
                        if c * threads + tx < kept:
                            place(Out, count, table, st, pf, slot, t, cand_key[c * threads + tx],
                                  cand_pos[c * threads + tx])

    return indexer_topk
