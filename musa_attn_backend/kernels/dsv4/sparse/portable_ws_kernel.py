"""TileLang sparse MQA over a bf16 workspace of DeepSeek-V4 key rows (:mod:`.workspace`), in the portable form:
:mod:`.mqa_kernel`'s program (what MUSA runs) with rows that need no dequantisation, for batches of many query
tokens (prefill).

Why: the portable program dequantises every row each time a token reads it, in shared memory (the FP8 bytes and
the scale bytes staged, then converted element by element), and a prefill's tokens read each row many times; here
each distinct row was dequantised once into ``W`` and a key tile is a plain gather of 1,024-byte rows. The staging
tiles go with the conversion, so the block's shared memory is the query tile, the K/V tile(s) and P.

One block per (block of 64 query heads, query token), no split (a prefill's tokens fill the GPU). Per key tile of
``block_N`` entries of the token's rebased list: the rows' offsets, then the rows copied (an invalid entry, past
the token's length or outside ``W``, zero-filled without a read and its score masked), ``S = Q K^T``, the online
softmax, ``O += P V`` with P through shared memory, the tiles as :func:`.tilelang_impl.portable_form` gives them
(MUSA: a K and a V tile of 32 rows of their own). The output (the sink in the denominator) and the natural-log
LSE without the sink (``empty_lse`` where no entry is valid) are written by the block; ``MaxL``, each row's largest
scaled score (``-inf`` where none is valid), as FlashMLA's sparse prefill returns it.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E, Tiles, attention_macros
from .. import layout as L
from .tl_macros import sparse_macros, workspace_args

# the key loop's loads: False, each tile's rows gathered into shared memory, then its GEMMs and softmax, nothing
# overlapped; True, the next tile's rows loaded into registers before this tile's GEMMs and stored after them: their
# latency hidden behind the math on any target (plain loads, no asynchronous copy; ``T.Pipelined`` does not pipeline
# this gather). The faster on the H100 proxy in both forms (docs/dsv4.md).
PREFETCH = True


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_portable_ws(H: int, has_sink: bool, q_dtype: str = "bfloat16", block_H: int = 64,
                                 block_N: int = 64, threads: int = 256, separate_v: bool = False,
                                 prefetch: bool = False):
    """The portable program over a bf16 workspace for ``H`` query heads (blocks of ``block_H``, rows past ``H``
    padded inside); ``separate_v``: K and V in tiles of their own (MUSA); ``prefetch``: :data:`PREFETCH`."""
    BH, BN, D = block_H, block_N, L.D
    A = workspace_args(H, q_dtype, D)
    K, R = A.K, A.R
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + BH - 1) // BH
    alloc_state, _, _, softmax_step, pv_product, finish_rows = attention_macros(BH, BN, D, D, 0, 0, False, q_dtype)
    _, store_output = sparse_macros(H, BH, BN, False, has_sink, False, q_dtype, K, 0)
    LANES = threads // BN  # prefetch: the threads of a row (each 16-byte unit u * LANES + lane of it)
    UNITS = D // 8 // LANES
    assert threads % BN == 0 and (D // 8) % LANES == 0, (threads, BN)

    @T.macro
    def fetch(it, buf, rowv, I, W, t, length, row, lane):
        """Tile ``it``'s row ``row`` (this thread's units of it) into the registers ``buf``, its index into
        ``rowv`` (-1: invalid, zeros loaded without a read)."""
        e = it * BN + row
        rowv[0] = T.if_then_else(e < length, I[t, T.min(e, K - 1)], -1)
        rowv[0] = T.if_then_else(T.And(rowv[0] >= 0, rowv[0] < R), rowv[0], -1)
        for u in T.unroll(UNITS):
            for v in T.vectorized(8):
                buf[u * 8 + v] = T.if_then_else(rowv[0] >= 0, W[T.max(rowv[0], 0), (u * LANES + lane) * 8 + v],
                                                 T.Cast(q_dtype, 0))

    @T.macro
    def gather(it, row_s, KV_s, V_s, I, W, t, length):
        """Tile ``it``'s rows into the key tile (and the V tile), their indices into ``row_s`` (-1: invalid,
        zeros without a read)."""
        for j in T.Parallel(BN):
            e = it * BN + j
            idx = T.if_then_else(e < length, I[t, T.min(e, K - 1)], -1)
            row_s[j] = T.if_then_else(T.And(idx >= 0, idx < R), idx, -1)
        for j, d in T.Parallel(BN, D):
            KV_s[j, d] = T.if_then_else(row_s[j] >= 0, W[T.max(row_s[j], 0), d], T.Cast(q_dtype, 0))
        if separate_v:
            for j, d in T.Parallel(BN, D):
                V_s[j, d] = T.if_then_else(row_s[j] >= 0, W[T.max(row_s[j], 0), d], T.Cast(q_dtype, 0))

    @T.macro
    def store(buf, rowv, row_s, KV_s, V_s, row, lane):
        """The fetched row into the key tile (and the V tile) and its index into ``row_s``."""
        if lane == 0:
            row_s[row] = rowv[0]
        for u in T.unroll(UNITS):
            for v in T.vectorized(8):
                KV_s[row, (u * LANES + lane) * 8 + v] = buf[u * 8 + v]
                if separate_v:
                    V_s[row, (u * LANES + lane) * 8 + v] = buf[u * 8 + v]

    @T.prim_func
    def sparse_mqa_portable_ws(Q: A.Q, W: A.W, I: A.I, Ln: A.Ln, sinks: A.sinks, sm_scale: T.float32,
                               empty_lse: T.float32, O: A.O, LSE: A.LSE, MaxL: A.MaxL):
        with T.Kernel(A.NT, head_blocks, threads=threads) as (t, bh):  # tokens on x: up to 2^31 - 1 blocks
            Q_s = T.alloc_shared([BH, D], q_dtype)
            KV_s = T.alloc_shared([BN, D], q_dtype)
            V_s = T.alloc_shared([BN, D], q_dtype) if separate_v else None
            P_s = T.alloc_shared([BH, BN], q_dtype)
            row_s = T.alloc_shared([BN], "int32", scope="shared")
            state = alloc_state()
            tiles = Tiles(Q_s, KV_s, V_s if separate_v else KV_s, None, None, P_s)
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E
            length = T.max(T.min(Ln[t], K), 0)

            for h, d in T.Parallel(BH, D):
                Q_s[h, d] = T.if_then_else(h0 + h < H, Q[t, T.min(h0 + h, H - 1), d], T.Cast(q_dtype, 0))
            T.fill(state.acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)

            n_tiles = T.ceildiv(length, BN)
            if prefetch:
                tx = T.get_thread_binding()
                buf = T.alloc_local([UNITS * 8], q_dtype)
                rowv = T.alloc_local([1], "int32")
                if n_tiles > 0:
                    fetch(0, buf, rowv, I, W, t, length, tx // LANES, tx % LANES)
            for it in T.serial(n_tiles):
                if prefetch:  # the fetched tile in, the next one's loads issued before this one's math
                    T.sync_threads()
                    store(buf, rowv, row_s, KV_s, V_s, tx // LANES, tx % LANES)
                    T.sync_threads()
                    if it + 1 < n_tiles:
                        fetch(it + 1, buf, rowv, I, W, t, length, tx // LANES, tx % LANES)
                else:
                    gather(it, row_s, KV_s, V_s, I, W, t, length)
                acc_s = state.acc_s
                T.clear(acc_s)
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for h, j in T.Parallel(BH, BN):
                    acc_s[h, j] = T.if_then_else(row_s[j] >= 0, acc_s[h, j], NEG_INF)
                softmax_step(state, scale_log2, True, P_s)
                pv_product(state, tiles, T.GemmWarpPolicy.FullRow)

            m_i, l_i = state.m_i, state.l_i
            for h in T.Parallel(BH):
                if h0 + h < H:
                    MaxL[t, h0 + h] = T.if_then_else(l_i[h] == 0.0, NEG_INF, m_i[h] * scale_log2 / LOG2E)
            finish_rows(state, scale_log2, sinks, lambda h: h, False)  # alpha <- log2 LSE without the sink
            store_output(state, O, None, sinks, scale_log2, t, 0, h0, 0, D, False)  # the LSE below: empty_lse
            for h in T.Parallel(BH):
                if h0 + h < H:
                    LSE[t, h0 + h] = T.if_then_else(l_i[h] == 0.0, empty_lse, state.alpha[h] / LOG2E)

    return sparse_mqa_portable_ws
