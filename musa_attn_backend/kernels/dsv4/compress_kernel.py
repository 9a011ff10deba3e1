"""TileLang programs of DeepSeek-V4's compressors (the math: :mod:`.compressor_reference`).

``build_compress_rows``: one block of 128 threads per token; a token at a window's end (``(pos + 1) % ratio ==
0``, a request, an output slot) pools its window into a row, normalises it, rotates its last 64 dims (and, for
the indexer, applies the Hadamard) and writes the row in the writers' input dtype; other tokens' blocks return
at once. Thread ``x`` owns dims ``x, x + 128, ..``: per dim an online softmax over the window's positions, each
read from this call's input (at or past the request's prefix) or from the state through the table (before it).
The norm, the RoPE pairs and the Hadamard butterflies exchange values through shared memory; every barrier is
placed by hand and sits under a condition the whole block shares. ``build_save_state``: each token's row into
its state row (the score with ape added when the state keeps it so), launched after the rows are made, since
SGLang's rings alias the rows a window reads. Every index that comes from memory is clamped into its buffer.
"""

import functools

from ..._tilelang import tl_lang as T

ACC = "float32"
THREADS = 128
ROPE = 64


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
    """Rows ``Out [T, d]`` of the tokens that end a window (see the module docstring)."""
    coff = 2 if ratio == 4 else 1
    win = coff * ratio
    width = 2 * coff * d
    per = d // THREADS
    NT, NB, W = T.dynamic("num_tokens"), T.dynamic("batch"), T.dynamic("table_width")
    NS, MP = T.dynamic("state_elems"), T.dynamic("max_pos")
    NEG_INF = -T.infinity(ACC)

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
    ):
        with T.Kernel(NT, threads=THREADS) as t:
            tx = T.get_thread_binding()
            row_s = T.alloc_shared([d], ACC)
            nxt_s = T.alloc_shared([d], ACC)
            red_s = T.alloc_shared([THREADS], ACC)
            m = T.alloc_var(ACC)
            acc = T.alloc_var(ACC)
            den = T.alloc_var(ACC)
            kv = T.alloc_var(ACC)
            sc = T.alloc_var(ACC)
            v = T.alloc_var(ACC)
            src = T.alloc_var("int64")  # the element offset of the window position's row

            b = token_req[t]
            p = positions[t]
            if T.And(T.And(b >= 0, b < NB), T.And(p >= 0, T.And((p + 1) % ratio == 0, out_slots[t] >= 0))):
                prefix = T.Cast("int64", seq_lens[b] - (query_start[b + 1] - query_start[b]))
                for j in T.serial(per):
                    c = j * THREADS + tx
                    m = NEG_INF
                    acc = 0.0
                    den = 0.0
                    for i in T.serial(win):
                        w = p - win + 1 + i
                        h = i // ratio  # the half of kv / score this window slot uses
                        if w >= 0:
                            if w >= prefix:  # this call's token
                                irow = T.min(T.Cast("int64", query_start[b]) + w - prefix, NT - 1)
                                kv = KVS[irow, h * d + c]
                                sc = KVS[irow, coff * d + h * d + c] + ape[w % ratio, h * d + c]
                            else:  # an earlier token, in the state
                                srow = T.max(T.min(T.Cast("int64", table[b, T.min(w // state_block, W - 1)])
                                                   * state_ring + w % state_ring, num_state_rows - 1), 0)
                                src = T.max(T.min((srow // block_rows) * block_stride + (srow % block_rows) * width,
                                                  NS - width), 0)
                                kv = state[src + h * d + c]
                                sc = state[src + coff * d + h * d + c]
                                if not state_has_ape:
                                    sc = sc + ape[w % ratio, h * d + c]
                            v = T.max(m, sc)
                            acc = acc * T.exp(m - v) + kv * T.exp(sc - v)
                            den = den * T.exp(m - v) + T.exp(sc - v)
                            m = v
                    row_s[c] = acc / den
                v = 0.0
                for j in T.serial(per):
                    v = v + row_s[j * THREADS + tx] * row_s[j * THREADS + tx]
                red_s[tx] = v
                T.sync_threads()
                for s in T.unroll(7):  # the sum of squares, a tree over the 128 partial sums
                    if tx < (64 >> s):
                        red_s[tx] = red_s[tx] + red_s[tx + (64 >> s)]
                    T.sync_threads()
                inv = T.rsqrt(red_s[0] / d + eps)
                for j in T.serial(per):
                    c = j * THREADS + tx
                    row_s[c] = row_s[c] * inv * weight[c]
                T.sync_threads()
                at = T.min(p + 1 - ratio, MP - 1)
                for j in T.serial(per):
                    c = j * THREADS + tx
                    r = c - (d - ROPE)
                    if r >= 0:
                        pair = r // 2
                        if r % 2 == 0:
                            nxt_s[c] = row_s[c] * cos[at, pair] - row_s[c + 1] * sin[at, pair]
                        else:
                            nxt_s[c] = row_s[c - 1] * sin[at, pair] + row_s[c] * cos[at, pair]
                    else:
                        nxt_s[c] = row_s[c]
                T.sync_threads()
                if rotate:  # d is 128 (checked by the op); the 128^-0.5 at the store
                    hadamard_128(nxt_s, tx)
                for j in T.serial(per):
                    c = j * THREADS + tx
                    Out[t, c] = T.Cast(out_dtype, nxt_s[c] * (d ** -0.5 if rotate else 1.0))

    return compress_rows


@functools.lru_cache(maxsize=None)
def build_save_state(width: int, ratio: int, state_has_ape: bool):
    """``state[row(rows[t])] = KVS[t]`` (the score half plus ``ape[pos % ratio]`` when ``state_has_ape``) for
    every token whose row is in ``[0, num_state_rows)``."""
    half = width // 2
    NT, NS = T.dynamic("num_tokens"), T.dynamic("state_elems")

    @T.prim_func
    def save_state(
        KVS: T.Tensor((NT, width), ACC),
        ape: T.Tensor((ratio, half), ACC),
        positions: T.Tensor((NT,), "int64"),
        rows: T.Tensor((NT,), "int64"),
        state: T.Tensor((NS,), ACC),
        block_rows: T.int32,
        block_stride: T.int64,
        num_state_rows: T.int64,
    ):
        with T.Kernel(NT, threads=THREADS) as t:
            tx = T.get_thread_binding()
            r = rows[t]
            if T.And(r >= 0, r < num_state_rows):
                base = (r // block_rows) * block_stride + (r % block_rows) * width
                for j in T.serial(T.ceildiv(width, THREADS)):
                    c = j * THREADS + tx
                    if T.And(c < width, base + c < NS):
                        if state_has_ape:
                            state[base + c] = KVS[t, c] + T.if_then_else(
                                c >= half, ape[T.max(positions[t], 0) % ratio, T.max(c - half, 0)], 0.0)
                        else:
                            state[base + c] = KVS[t, c]

    return save_state
