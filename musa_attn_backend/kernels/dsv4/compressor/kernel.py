"""TileLang programs of DeepSeek-V4's compressors (the math: :mod:`.reference`).

``build_compress_rows``: one block per token, a thread per dim; a token at a window's end (``(pos + 1) % ratio ==
0``, a request, an output slot) pools its window into a row, normalises it, rotates its last 64 dims (and, for
the indexer, applies the Hadamard) and writes the row in the writers' input dtype; other tokens' blocks return
at once. The window's positions are located first, one thread a position: this call's input row (at or past
the request's prefix) or the state row through the table (before it). Thread ``x`` owns dim ``x`` and runs an
online softmax over the window, 8 positions at a time: their loads together, one rescale to their maximum.
The norm, the RoPE pairs and the Hadamard butterflies exchange values through shared memory; every barrier is
placed by hand and sits under a condition the whole block shares. ``build_save_state``: each token's row into
its state row (the score with ape added when the state keeps it so), launched after the rows are made, since
SGLang's rings alias the rows a window reads; it finds each token's state row in the table itself unless the
caller names the rows. Every index that comes from memory is clamped into its buffer.
"""

import functools

from ...._tilelang import tl_lang as T

ACC = "float32"
THREADS = 128
ROPE = 64
SLOTS_IN_FLIGHT = 8  # window slots whose loads a thread issues before it folds them in


@T.macro
def hadamard_128(buf, x):
    """The Walsh-Hadamard transform (natural order, unnormalised) of the 128 values of the shared ``buf``, in
    place: seven stages of butterflies by threads 0..63, a barrier after each (every thread of the block calls
    it)."""
    for s in T.unroll(7):
        hh = 1 << s
        if x < 64:
            a = (x // hh) * 2 * hh + x % hh
            x0 = buf[a]
            x1 = buf[a + hh]
            buf[a] = x0 + x1
            buf[a + hh] = x0 - x1
        T.sync_threads()


@functools.lru_cache(maxsize=None)
def build_compress_rows(d: int, ratio: int, rotate: bool, state_has_ape: bool, out_dtype: str = "bfloat16"):
    """Rows ``Out [T, d]`` of the tokens that end a window, and the writers' slots (see the module docstring)."""
    coff = 2 if ratio == 4 else 1
    win = coff * ratio
    width = 2 * coff * d
    threads = d  # a thread a dim
    U = min(win, SLOTS_IN_FLIGHT)
    NT, NB, W = T.dynamic("num_tokens"), T.dynamic("batch"), T.dynamic("table_width")
    NS, MP = T.dynamic("state_elems", "int64"), T.dynamic("max_pos")
    NEG_INF = -T.infinity(ACC)
    assert win <= threads and win % U == 0

    @T.prim_func
    def compress_rows(
        KVS: T.Tensor((NT, width), ACC),
        ape: T.Tensor((ratio, coff * d), ACC),
        positions: T.Tensor((NT,), "int64"),
        token_req: T.Tensor((NT,), "int32"),
        query_start: T.Tensor((NB + 1,), "int32"),
        seq_lens: T.Tensor((NB,), "int32"),
        state: T.Tensor((NS,), ACC),
        table: T.Tensor((NB, W), "int32"),
        out_slots: T.Tensor((NT,), "int64"),
        weight: T.Tensor((d,), ACC),
        cos: T.Tensor((MP, 32), ACC),
        sin: T.Tensor((MP, 32), ACC),
        state_block: T.int32,
        state_ring: T.int32,
        block_rows: T.int32,
        block_stride: T.int64,
        num_state_rows: T.int64,
        eps: T.float32,
        Out: T.Tensor((NT, d), out_dtype),
        write_slots: T.Tensor((NT,), "int64"),
    ):
        with T.Kernel(NT, threads=threads) as t:
            tx = T.get_thread_binding()
            row_s = T.alloc_shared([d], ACC)
            nxt_s = T.alloc_shared([d], ACC)
            red_s = T.alloc_shared([threads], ACC)
            kind_s = T.alloc_shared([win], "int32")  # window slot i: 0 before the sequence, 1 input, 2 state
            off_s = T.alloc_shared([win], "int64")  # its input row, or its state row's first element
            srow = T.alloc_var("int64")
            kv = T.alloc_local([U], ACC)
            sc = T.alloc_local([U], ACC)
            m = T.alloc_var(ACC)
            acc = T.alloc_var(ACC)
            den = T.alloc_var(ACC)
            v = T.alloc_var(ACC)

            b = token_req[t]
            p = positions[t]
            emit = T.And(T.And(b >= 0, b < NB), T.And(p >= 0, T.And((p + 1) % ratio == 0, out_slots[t] >= 0)))
            if tx == 0:  # the writers' slot of this token's row: -1 where it emits none
                write_slots[t] = T.if_then_else(emit, out_slots[t], T.Cast("int64", -1))
            if emit:
                prefix = T.Cast("int64", seq_lens[b] - (query_start[b + 1] - query_start[b]))
                # where each window slot's row is, found once by one thread a slot, so that the window's loads
                # wait on shared memory, not on a table read each (the row index stored, not re-derived per use)
                if tx < win:
                    w = p - win + 1 + tx
                    srow = T.max(T.min(T.Cast("int64", table[b, T.max(T.min(w // state_block, W - 1), 0)])
                                       * state_ring + T.max(w, 0) % state_ring, num_state_rows - 1), 0)
                    kind_s[tx] = T.if_then_else(w < 0, 0, T.if_then_else(w >= prefix, 1, 2))
                    off_s[tx] = T.if_then_else(
                        w >= prefix, T.max(T.min(T.Cast("int64", query_start[b]) + w - prefix, NT - 1), 0),
                        T.max(T.min((srow // block_rows) * block_stride + (srow % block_rows) * width, NS - width),
                              0))
                T.sync_threads()
                m = NEG_INF
                acc = 0.0
                den = 0.0
                # U slots at a time: their loads first (all in flight together), then one rescale to the chunk's
                # maximum and the chunk's terms. w = p - win + 1 + i, so w % ratio == i % ratio.
                for g in T.serial(win // U):
                    for u in T.unroll(U):
                        i = g * U + u
                        col = (i // ratio) * d + tx  # the half of kv / score this window slot uses
                        # slot kinds 1 and 2 read their row, kind 0 (before the sequence) reads nothing
                        kv[u] = T.if_then_else(kind_s[i] == 1, KVS[off_s[i], col], T.if_then_else(
                            kind_s[i] == 2, state[off_s[i] + col], 0.0))
                        sc[u] = T.if_then_else(kind_s[i] == 1, KVS[off_s[i], coff * d + col], T.if_then_else(
                            kind_s[i] == 2, state[off_s[i] + coff * d + col], NEG_INF))
                        if state_has_ape:  # the state's scores hold ape already, this call's do not
                            sc[u] = sc[u] + T.if_then_else(kind_s[i] == 1, ape[i % ratio, col], 0.0)
                        else:
                            sc[u] = sc[u] + ape[i % ratio, col]
                    v = m
                    for u in T.unroll(U):
                        v = T.max(v, sc[u])
                    if v > NEG_INF:  # a chunk of slots before the sequence only adds nothing
                        acc = acc * T.exp(m - v)
                        den = den * T.exp(m - v)
                        for u in T.unroll(U):
                            acc = acc + kv[u] * T.exp(sc[u] - v)
                            den = den + T.exp(sc[u] - v)
                        m = v
                # every thread is past the slots before any writes the row: the row may share their memory
                T.sync_threads()
                row_s[tx] = acc / den
                red_s[tx] = row_s[tx] * row_s[tx]
                T.sync_threads()
                for s in T.unroll(threads.bit_length() - 1):  # the sum of squares, a tree
                    if tx < (threads >> (s + 1)):
                        red_s[tx] = red_s[tx] + red_s[tx + (threads >> (s + 1))]
                    T.sync_threads()
                row_s[tx] = row_s[tx] * T.rsqrt(red_s[0] / d + eps) * weight[tx]
                T.sync_threads()
                at = T.min(p + 1 - ratio, MP - 1)
                r = tx - (d - ROPE)
                if r >= 0:
                    if r % 2 == 0:
                        nxt_s[tx] = row_s[tx] * cos[at, r // 2] - row_s[tx + 1] * sin[at, r // 2]
                    else:
                        nxt_s[tx] = row_s[tx - 1] * sin[at, r // 2] + row_s[tx] * cos[at, r // 2]
                else:
                    nxt_s[tx] = row_s[tx]
                T.sync_threads()
                if rotate:  # d is 128 (checked by the op); the 128^-0.5 at the store
                    hadamard_128(nxt_s, tx)
                Out[t, tx] = T.Cast(out_dtype, nxt_s[tx] * (d ** -0.5 if rotate else 1.0))

    return compress_rows


@functools.lru_cache(maxsize=None)
def build_save_state(width: int, ratio: int, state_has_ape: bool, from_table: bool):
    """``state[row] = KVS[t]`` (the score half plus ``ape[pos % ratio]`` when ``state_has_ape``) for every token
    whose row is in ``[0, num_state_rows)``: ``rows[t]``, or with ``from_table`` the table's row of the token's
    position (the rule of :func:`.reference.default_state_rows`: none for padding, a column past the
    table or a negative entry)."""
    half = width // 2
    NT, NS = T.dynamic("num_tokens"), T.dynamic("state_elems", "int64")
    NB, W = T.dynamic("batch"), T.dynamic("table_width")

    @T.prim_func
    def save_state(
        KVS: T.Tensor((NT, width), ACC),
        ape: T.Tensor((ratio, half), ACC),
        positions: T.Tensor((NT,), "int64"),
        rows: T.Tensor((NT,), "int64"),
        token_req: T.Tensor((NT,), "int32"),
        table: T.Tensor((NB, W), "int32"),
        state: T.Tensor((NS,), ACC),
        state_block: T.int32,
        state_ring: T.int32,
        block_rows: T.int32,
        block_stride: T.int64,
        num_state_rows: T.int64,
    ):
        with T.Kernel(NT, threads=THREADS) as t:
            tx = T.get_thread_binding()
            pos = positions[t]
            b = token_req[t]
            col = T.max(pos, 0) // state_block
            entry = T.Cast("int64", table[T.max(T.min(b, NB - 1), 0), T.min(col, W - 1)])
            # the row and its first element stored once: an inlined expression would redo its 64-bit divisions
            # at every element
            r = T.alloc_var("int64")
            base = T.alloc_var("int64")
            r = rows[t]
            if from_table:
                r = T.if_then_else(T.And(T.And(T.And(b >= 0, b < NB), pos >= 0), T.And(col < W, entry >= 0)),
                                   entry * state_ring + T.max(pos, 0) % state_ring, T.Cast("int64", -1))
            base = (T.max(r, 0) // block_rows) * block_stride + (T.max(r, 0) % block_rows) * width
            if T.And(r >= 0, r < num_state_rows):
                for j in T.serial(T.ceildiv(width, THREADS)):
                    c = j * THREADS + tx
                    if T.And(c < width, base + c < NS):
                        if state_has_ape:
                            state[base + c] = KVS[t, c] + T.if_then_else(
                                c >= half, ape[T.max(pos, 0) % ratio, T.max(c - half, 0)], 0.0)
                        else:
                            state[base + c] = KVS[t, c]

    return save_state
