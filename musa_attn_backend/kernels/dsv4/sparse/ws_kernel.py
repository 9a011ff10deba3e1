"""TileLang sparse MQA over DeepSeek-V4's FP8 caches for Hopper-class GPUs (warp-group MMA from registers, named
barriers, ``setmaxnreg``): a producer warp group that gathers and dequantises the rows, two consumer warp groups
that share them. Same arguments, results and conventions as :mod:`.mqa_kernel` (the portable program,
which MUSA and every target without warp specialisation runs).

One block per (KV split, block of 64 query heads, query token), 384 threads:

- Warp group 2, the producer, copies the block's 64 query rows into shared memory once, then walks the split's
  key tiles (``block_N`` entries of the token's index list: the main set's tiles, then the extra set's). Per tile
  it waits until a stage of the ``num_stages`` ring is free, and each thread turns half a row into bf16: thread
  ``p`` takes entry ``p % block_N``, the first 256 columns (nope values 0-255) when ``p < block_N``, else the last
  256 (nope values 256-447 and the 64 RoPE values), reading the row's bytes straight from the cache (16-byte
  loads) and scaling each nope value by its tile's ``2^(exponent - 127)`` (exact in bf16). An invalid entry
  (past the token's length, negative, at or past its cache's slot count) is not read: its half rows are zeros
  and its flag in ``ok_s`` is 0. The stores are ordinary shared-memory stores, so the producer fences them for
  the tensor cores' (async) proxy before it signals the stage full.
- Consumer warp group ``g`` owns output columns ``256 g .. 256 g + 255`` (64 x 256 fp32 accumulators, what a
  warp group's registers hold). Per tile it computes the partial scores of its column half,
  ``S_g = Q[:, half g] K[:, half g]^T``, writes them to shared memory, adds the other group's (two named
  barriers: both halves written; the buffer free again), masks the invalid entries and runs the online softmax
  (both groups compute the same row statistics from the same sums), then ``O_g += P V[:, half g]`` with P in
  registers, and frees the stage.

The register split (consumers 216, producer 72 per thread) fills the 64K-register file at 384 threads.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E, attention_macros
from .. import layout as L
from .tl_macros import sparse_macros

ROW16 = L.DATA_BYTES // 16  # a data row in 16-byte units (36)
ROPE16 = L.D_NOPE // 16  # the RoPE values' first 16-byte unit within a data row (28)
HD = L.D // 2  # output columns per consumer warp group
LEFT_UNITS = HD // 16  # nope units of the left half (16)
RIGHT_UNITS = (L.D_NOPE - HD) // 16  # nope units of the right half (12); then the 64 RoPE values
BATCH = 8  # 16-byte units loaded into registers before any is converted
CONSUMERS = 256
PRODUCER_THREADS = 128
CONSUMER_REGS, PRODUCER_REGS = 216, 72
# named barriers (0 is __syncthreads): both score halves written; consumer g's half free to overwrite; the
# producer warp group's own sync
EXCH_BARRIER = 3
FREE_BARRIERS = (4, 5)
PRODUCER_BARRIER = 6
ROWS_PER_THREAD = 8  # producer='async': 64 rows over 4 warps of two half warps


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_ws(H: int, has_extra: bool, has_sink: bool, split: bool, q_dtype: str = "bfloat16",
                        block_N: int = 64, num_stages: int = 2, producer: str = "rows"):
    """Sparse MQA for ``H`` query heads (blocks of 64, rows past ``H`` padded inside) on Hopper-class GPUs;
    ``block_N`` index entries per key tile (two producer threads per entry: ``block_N`` = 64), a ring of
    ``num_stages`` dequantised tiles.

    ``producer``: how the producer fills a stage. ``rows`` (above): one thread per half row, loads through
    registers. ``async``: half a warp per row, lane ``l`` copying the row's 16-byte units ``l``, ``l + 16`` and
    ``l + 32`` with ``cp.async`` (a warp's copies cover two rows' contiguous bytes; invalid rows predicated off,
    which zero-fills them without a read), each nope unit into the second half of its 32-byte bf16 slot, the
    RoPE units into their places and the row's scale bytes beside the stage; once the copies land, each lane
    widens its nope units in place (e4m3 bytes read back from the slot, scaled, written as 16 bf16)."""
    assert producer in ("rows", "async"), producer
    BH, BN, D, NS = 64, block_N, L.D, num_stages
    assert 2 * BN == PRODUCER_THREADS, "two producer threads per entry of a tile"
    NT = T.dynamic("num_tokens")
    K1 = T.dynamic("topk")
    K2 = T.dynamic("extra_topk")
    NU1, NS1 = T.dynamic("cache_units16", "int64"), T.dynamic("cache_units8", "int64")
    NU2, NS2 = T.dynamic("extra_units16", "int64"), T.dynamic("extra_units8", "int64")
    SPLITS = T.dynamic("num_splits")
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + BH - 1) // BH
    O_shape = (SPLITS, NT, H, D) if split else (NT, H, D)
    L_shape = (SPLITS, NT, H) if split else (NT, H)
    alloc_state, _, _, softmax_step, _, finish_rows = attention_macros(BH, BN, HD, HD, 0, 0, False, q_dtype)
    split_tiles, store_output = sparse_macros(H, BH, BN, has_extra, has_sink, split, q_dtype, K1, K2)

    # ---- producer -------------------------------------------------------------------------------------------

    @T.macro
    def load_q(Q, Ql_s, Qr_s, t, h0, p):
        """The block's 64 query rows (zeros past ``H``) into the two column halves: 8 values per copy, one
        warp per half row at a time."""
        for i in T.serial(BH * D // 8 // PRODUCER_THREADS):
            u = i * PRODUCER_THREADS + p
            h = u // (D // 8)
            c = u % (D // 8)  # the 8-value chunk of the row; warps 0-1 the left half, 2-3 the right
            if c < HD // 8:
                for v in T.vectorized(8):
                    Ql_s[h, c * 8 + v] = T.if_then_else(h0 + h < H, Q[t, T.min(h0 + h, H - 1), c * 8 + v],
                                                        T.Cast(q_dtype, 0))
            else:
                for v in T.vectorized(8):
                    Qr_s[h, (c - HD // 8) * 8 + v] = T.if_then_else(
                        h0 + h < H, Q[t, T.min(h0 + h, H - 1), c * 8 + v], T.Cast(q_dtype, 0))

    @T.macro
    def entry_of(dst, d, gi, n1, j, t, I1, L1, I2, L2):
        """``dst[d]`` <- the index of entry ``j`` of the split's tile ``gi`` of token ``t`` (-1 past its length)."""
        if gi < n1:
            dst[d] = T.if_then_else(gi * BN + j < T.min(L1[t], K1), I1[t, T.min(gi * BN + j, K1 - 1)], -1)
        else:
            e = (gi - n1) * BN + j
            dst[d] = T.if_then_else(e < T.min(L2[t], K2), I2[t, T.min(e, K2 - 1)], -1)

    @T.macro
    def convert_units(dst, st, j, C8, loc, raw, sc, first, u0, n):
        """Units ``u0 .. u0 + n`` of the half (from the row's unit ``first``) loaded, then scaled into ``dst``."""
        for u in T.unroll(n):
            for v in T.vectorized(16):
                raw[u * 16 + v] = C8[loc[1] + first + u0 + u, v]
        for u in T.unroll(n):
            for w in T.unroll(2):
                for v in T.vectorized(8):
                    dst[st, j, (u0 + u) * 16 + w * 8 + v] = T.Cast(
                        q_dtype, T.Cast(ACC, raw[u * 16 + w * 8 + v]) * sc[(u0 + u) // 4])

    @T.macro
    def fill_half(KVl_s, KVr_s, ok_s, st, C8, CH, CS, rows, stride16, slots, j, right, loc, raw, rope, sb,
                  sc):
        """Index ``loc[0]`` dequantised into row ``j`` of stage ``st``: the left half (``right`` false) or the right
        half; an invalid index's half is zeros and is not read. The row's bytes are loaded 8 units (128 bytes) at a
        time into registers before any is converted, so their latencies overlap."""
        ok = T.And(loc[0] >= 0, loc[0] < slots)
        if not right:
            ok_s[st, j] = T.if_then_else(ok, 1, 0)
        if ok:
            loc[1] = loc[0] // rows * stride16 + loc[0] % rows * ROW16  # the row's first 16-byte unit
            loc[2] = loc[0] // rows * stride16 * 2 + rows * (L.DATA_BYTES // 8) + loc[0] % rows  # its scales
            for v in T.vectorized(8):
                sb[v] = CS[loc[2], v]
            first = LEFT_UNITS if right else 0  # the half's first nope unit
            units = RIGHT_UNITS if right else LEFT_UNITS
            dst = KVr_s if right else KVl_s
            for k in T.unroll(4):
                sc[k] = T.exp2(T.Cast(ACC, sb[T.min(first // 4 + k, L.NUM_TILES - 1)]) - 127.0)
            convert_units(dst, st, j, C8, loc, raw, sc, first, 0, BATCH)
            convert_units(dst, st, j, C8, loc, raw, sc, first, BATCH, units - BATCH)
            if right:
                for u in T.unroll(L.D_ROPE // 8):
                    for v in T.vectorized(8):
                        rope[u * 8 + v] = CH[loc[1] + ROPE16 + u, v]
                for u in T.unroll(L.D_ROPE // 8):
                    for v in T.vectorized(8):
                        KVr_s[st, j, RIGHT_UNITS * 16 + u * 8 + v] = rope[u * 8 + v]
        else:
            for c in T.unroll(HD // 8):
                for v in T.vectorized(8):
                    (KVr_s if right else KVl_s)[st, j, c * 8 + v] = T.Cast(q_dtype, 0)

    def swizzled(i, jj):
        """The column of score ``(i, jj)`` in the exchange buffer: 8-column groups XOR-ed with the row, so the
        accumulator fragments' rows (8 apart in a warp) land in different banks."""
        return jj ^ ((i % 8) * 8)

    @T.macro
    def copy_row_async(KVl_s, KVr_s, ok_s, S_s, st, CH, CS, rows, stride16, slots, idx, j, l):
        """Lane ``l`` of the half warp that owns row ``j``: its ``cp.async`` copies of index ``idx``'s units (see
        ``producer='async'``); invalid: predicated off (zeros, no read)."""
        ok = T.And(idx >= 0, idx < slots)
        base = T.if_then_else(ok, idx // rows * stride16 + idx % rows * ROW16, 0)
        if l == 0:
            ok_s[st, j] = T.if_then_else(ok, 1, 0)
        T.ptx_cp_async(T.access_ptr(KVl_s[st, j, l * 16 + 8], "w", 8), T.access_ptr(CH[base + l, 0], "r", 8), 8,
                       ok)
        if l < RIGHT_UNITS:
            T.ptx_cp_async(T.access_ptr(KVr_s[st, j, l * 16 + 8], "w", 8),
                           T.access_ptr(CH[base + LEFT_UNITS + l, 0], "r", 8), 8, ok)
        else:  # RoPE units 0-3
            T.ptx_cp_async(T.access_ptr(KVr_s[st, j, RIGHT_UNITS * 16 + (l - RIGHT_UNITS) * 8], "w", 8),
                           T.access_ptr(CH[base + LEFT_UNITS + l, 0], "r", 8), 8, ok)
        if l < ROW16 - 32:  # RoPE units 4-7
            T.ptx_cp_async(T.access_ptr(KVr_s[st, j, RIGHT_UNITS * 16 + (l + 4) * 8], "w", 8),
                           T.access_ptr(CH[base + 32 + l, 0], "r", 8), 8, ok)
        if l == 4:  # the row's scale bytes
            sc = T.if_then_else(ok, idx // rows * stride16 * 2 + rows * (L.DATA_BYTES // 8) + idx % rows, 0)
            T.ptx_cp_async(T.access_ptr(S_s[st, j, 0], "w", 8), T.access_ptr(CS[sc, 0], "r", 8), 8, ok)

    @T.macro
    def widen_unit(X_s, S_s, st, j, col, tile, raw, wide, scale):
        """The e4m3 bytes in the second half of the 32-byte slot at ``col`` widened to its 16 bf16 values, scaled by
        ``2^(S_s[st, j, tile] - 127)`` (a zero-filled row has zero bytes and stays zero)."""
        for v in T.vectorized(8):
            raw[v] = X_s[st, j, col + 8 + v]
        scale[0] = T.exp2(T.Cast(ACC, S_s[st, j, tile]) - 127.0)
        for k in T.unroll(16):
            byte = T.Cast("uint8", T.shift_right(T.reinterpret(raw[k // 2], "uint16"), (k % 2) * 8) & 255)
            wide[k] = T.Cast(q_dtype, T.Cast(ACC, T.reinterpret(byte, "float8_e4m3")) * scale[0])
        for v in T.vectorized(16):
            X_s[st, j, col + v] = wide[v]

    @T.macro
    def fill_tile_async(KVl_s, KVr_s, ok_s, S_s, st, gi, n1, p, t, I1, L1, I2, L2, CH, CS, rows1, stride1, slots1, XH,
                        XS, rows2, stride2, slots2, cur, raw, wide, scale):
        """The split's tile ``gi`` into stage ``st`` (``producer='async'``): the 8 rows ``16 w + 2 i + half`` of this
        thread's half warp copied, the copies awaited and seen by the whole warp group, then widened."""
        l = p % 16
        for i in T.unroll(ROWS_PER_THREAD):
            entry_of(cur, i, gi, n1, (p // 32) * 16 + i * 2 + (p % 32) // 16, t, I1, L1, I2, L2)
        for i in T.unroll(ROWS_PER_THREAD):
            if gi < n1:
                copy_row_async(KVl_s, KVr_s, ok_s, S_s, st, CH, CS, rows1, stride1, slots1, cur[i],
                               (p // 32) * 16 + i * 2 + (p % 32) // 16, l)
            else:
                copy_row_async(KVl_s, KVr_s, ok_s, S_s, st, XH, XS, rows2, stride2, slots2, cur[i],
                               (p // 32) * 16 + i * 2 + (p % 32) // 16, l)
        T.ptx_commit_group()
        T.ptx_wait_group(0)
        T.sync_threads(PRODUCER_BARRIER, PRODUCER_THREADS)  # every lane's scale bytes seen by its half warp
        for i in T.unroll(ROWS_PER_THREAD):
            j = (p // 32) * 16 + i * 2 + (p % 32) // 16
            widen_unit(KVl_s, S_s, st, j, l * 16, l // 4, raw, wide, scale)
            if l < RIGHT_UNITS:
                widen_unit(KVr_s, S_s, st, j, l * 16, (LEFT_UNITS + l) // 4, raw, wide, scale)

    # ---- consumers ------------------------------------------------------------------------------------------

    @T.macro
    def consumer(g, Q_g, KV_g, X_s, ok_s, q_full, full, empty, n_iters, scale_log2, sinks, O, LSE, bs, t, h0):
        """Consumer warp group ``g``: output columns ``256 g ..`` of the block's 64 heads over the split's tiles."""
        with T.ws(g):
            T.set_max_nreg(CONSUMER_REGS, 1)
            state = alloc_state()
            acc_s, acc_p, acc_o = state.acc_s, state.acc_p, state.acc_o
            T.fill(acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)
            if n_iters > 0:
                T.mbarrier_wait_parity(q_full, 0)
                T.named_barrier_arrive(FREE_BARRIERS[1 - g], CONSUMERS)  # the other's half starts free
            for k in T.serial(n_iters):
                st = k % NS
                T.mbarrier_wait_parity(full[st], (k // NS) & 1)
                if producer == "async":
                    T.fence_proxy_async()  # part of the stage arrived by cp.async: order it for the WGMMAs too
                T.wgmma_gemm(Q_g, KV_g[st, :, :], acc_s, transpose_B=True,
                             policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                T.wait_wgmma(0)
                T.sync_threads(FREE_BARRIERS[g], CONSUMERS)  # the other group has read our last half
                for i, jj in T.Parallel(BH, BN):
                    X_s[g, i, swizzled(i, jj)] = acc_s[i, jj]
                T.sync_threads(EXCH_BARRIER, CONSUMERS)
                for i, jj in T.Parallel(BH, BN):
                    acc_s[i, jj] = T.if_then_else(ok_s[st, jj] > 0, acc_s[i, jj] + X_s[1 - g, i, swizzled(i, jj)],
                                                  NEG_INF)
                if k + 1 < n_iters:
                    T.named_barrier_arrive(FREE_BARRIERS[1 - g], CONSUMERS)
                softmax_step(state, scale_log2, True)
                T.wgmma_gemm(acc_p, KV_g[st, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)
                T.mbarrier_arrive(empty[st])

            finish_rows(state, scale_log2, sinks, lambda h: h, False)  # alpha <- log2 LSE, no sink
            store_output(state, O, LSE, sinks, scale_log2, t, bs, h0, g * HD, HD, g == 0)

    # ---- the program ----------------------------------------------------------------------------------------

    @T.prim_func
    def sparse_mqa(
        Q: T.Tensor((NT, H, D), q_dtype),
        C8: T.Tensor((NU1, 16), "float8_e4m3"),
        CH: T.Tensor((NU1, 8), "bfloat16"),
        CS: T.Tensor((NS1, 8), "uint8"),
        I1: T.Tensor((NT, K1), "int32"),
        L1: T.Tensor((NT,), "int32"),
        X8: T.Tensor((NU2, 16), "float8_e4m3"),
        XH: T.Tensor((NU2, 8), "bfloat16"),
        XS: T.Tensor((NS2, 8), "uint8"),
        I2: T.Tensor((NT, K2), "int32"),
        L2: T.Tensor((NT,), "int32"),
        sinks: T.Tensor((H,), "float32"),
        sm_scale: T.float32,
        rows1: T.int32,
        stride1: T.int64,
        slots1: T.int32,
        rows2: T.int32,
        stride2: T.int64,
        slots2: T.int32,
        num_splits: T.int32,
        O: T.Tensor(O_shape, ACC if split else q_dtype),
        LSE: T.Tensor(L_shape, "float32"),
    ):
        with T.Kernel(num_splits, head_blocks, NT, threads=CONSUMERS + PRODUCER_THREADS) as (bs, bh, bt):
            Ql_s = T.alloc_shared([BH, HD], q_dtype)
            Qr_s = T.alloc_shared([BH, HD], q_dtype)
            KVl_s = T.alloc_shared([NS, BN, HD], q_dtype)
            KVr_s = T.alloc_shared([NS, BN, HD], q_dtype)
            X_s = T.alloc_shared([2, BH, BN], ACC)
            ok_s = T.alloc_shared([NS, BN], "int32")
            S_s = T.alloc_shared([NS, BN, 8], "uint8") if producer == "async" else None
            q_full = T.alloc_barrier(PRODUCER_THREADS)
            full = T.alloc_barrier([PRODUCER_THREADS] * NS)
            empty = T.alloc_barrier([CONSUMERS] * NS)
            tx = T.get_thread_binding()
            t = bt
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E

            n1, it_lo, n_iters = split_tiles(L1, L2, t, bs, num_splits)

            if tx >= CONSUMERS:
                T.set_max_nreg(PRODUCER_REGS, 0)
                p = tx - CONSUMERS
                load_q(Q, Ql_s, Qr_s, t, h0, p)
                T.fence_proxy_async()
                T.mbarrier_arrive(q_full)
                if producer == "rows":
                    j = p % BN
                    loc = T.alloc_local([3], "int64")
                    nxt = T.alloc_local([1], "int64")
                    raw = T.alloc_local([BATCH * 16], "float8_e4m3")
                    rope = T.alloc_local([L.D_ROPE], q_dtype)
                    sb = T.alloc_local([8], "uint8")
                    sc = T.alloc_local([4], ACC)
                    if n_iters > 0:
                        entry_of(nxt, 0, it_lo, n1, j, t, I1, L1, I2, L2)
                    for k in T.serial(n_iters):
                        st = k % NS
                        gi = it_lo + k
                        loc[0] = nxt[0]
                        if k + 1 < n_iters:  # the next tile's index, read while this one is filled
                            entry_of(nxt, 0, gi + 1, n1, j, t, I1, L1, I2, L2)
                        T.mbarrier_wait_parity(empty[st], ((k // NS) & 1) ^ 1)
                        if p < BN:
                            if gi < n1:
                                fill_half(KVl_s, KVr_s, ok_s, st, C8, CH, CS, rows1, stride1, slots1, j, False, loc,
                                          raw, rope, sb, sc)
                            else:
                                fill_half(KVl_s, KVr_s, ok_s, st, X8, XH, XS, rows2, stride2, slots2, j, False, loc,
                                          raw, rope, sb, sc)
                        else:
                            if gi < n1:
                                fill_half(KVl_s, KVr_s, ok_s, st, C8, CH, CS, rows1, stride1, slots1, j, True, loc,
                                          raw, rope, sb, sc)
                            else:
                                fill_half(KVl_s, KVr_s, ok_s, st, X8, XH, XS, rows2, stride2, slots2, j, True, loc,
                                          raw, rope, sb, sc)
                        T.fence_proxy_async()  # generic-proxy stores, read by the WGMMAs (async proxy)
                        T.mbarrier_arrive(full[st])
                else:
                    cur = T.alloc_local([ROWS_PER_THREAD], "int32")
                    craw = T.alloc_local([8], q_dtype)
                    cwide = T.alloc_local([16], q_dtype)
                    cscale = T.alloc_local([1], ACC)
                    for k in T.serial(n_iters):
                        st = k % NS
                        T.mbarrier_wait_parity(empty[st], ((k // NS) & 1) ^ 1)
                        fill_tile_async(KVl_s, KVr_s, ok_s, S_s, st, it_lo + k, n1, p, t, I1, L1, I2, L2, CH, CS, rows1,
                                        stride1, slots1, XH, XS, rows2, stride2, slots2, cur, craw, cwide, cscale)
                        T.fence_proxy_async()  # generic-proxy stores, read by the WGMMAs (async proxy)
                        T.mbarrier_arrive(full[st])

            consumer(0, Ql_s, KVl_s, X_s, ok_s, q_full, full, empty, n_iters, scale_log2, sinks, O, LSE, bs, t,
                     h0)
            consumer(1, Qr_s, KVr_s, X_s, ok_s, q_full, full, empty, n_iters, scale_log2, sinks, O, LSE, bs, t,
                     h0)

    return sparse_mqa
