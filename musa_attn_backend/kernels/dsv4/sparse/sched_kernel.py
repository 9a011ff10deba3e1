"""TileLang sparse MQA over DeepSeek-V4's FP8 caches for Hopper-class GPUs, on a per-batch plan (:mod:`.schedule`):
a fixed grid of ``parts`` blocks per 64 query heads, each visiting the key tiles the plan gives it, token after
token. Same math and conventions as :mod:`.mqa_kernel`; the work is divided as FlashMLA's SM90 sparse
decode divides it, in a program of our own.

384 threads, three warp groups:

- Warp group 2, the producer (152 registers a thread). Per piece it loads the token's 64 query rows into shared
  memory (``cp.async``; rows past ``H`` zero-filled without a read) once the scores group is done with the last
  ones (the ``q_free`` barrier). Per key tile it fills a stage of the ``num_stages`` ring with the tile's FP8 rows
  as bf16 (:mod:`.rows`: the lanes' loads, the dequantisation, invalid entries as zero rows; their flags in
  ``ok_s``). All eighteen loads and the rows' scale bytes are in flight before the stage is waited for; the next
  tile's indices (the next piece's first, at a piece's last tile) are read meanwhile, and a piece's query copies
  are issued once its first tile's loads are out, so the two latencies overlap.
- Warp group 0, the scores group (192 registers): per tile ``S = Q K^T`` over all 512 dims (two GEMMs from
  shared memory, one per column half), the invalid entries masked, the online softmax, P in bf16 to shared memory
  (with the rows' rescale factors) for warp group 1, then ``O[:, :256] += P V[:, :256]`` with P in registers.
- Warp group 1 (160 registers): per tile, once P is in shared memory, rescales ``O[:, 256:]`` and adds
  ``P V[:, 256:]`` with P from shared memory.

The K tile of a stage is the V tile too (V = K's rows), so a stage is read by three GEMMs: K-inner by ``Q K^T``
and MN-major by the two ``P V`` halves (CUDA lays a tile out for both; MUSA runs :mod:`.mqa_kernel`).

An unsplit token's output (``O``, the sink in the denominator) and LSE (natural log; ``empty_lse``, an argument,
where no entry is valid) are written by the part that visits it; a split token's pieces write their partials
(``O_part``, ``L_part``) at the rows the plan gives, merged by :mod:`.combine_kernel`.

The clustered form (``cluster``: 65-128 heads, CUDA sm_90, ``tilelang_impl.SCHED_CLUSTER``; FlashMLA's division at
128 heads): the two head blocks of a part run as a cluster of two and share the dequantisation. The producer of
block ``r`` makes rows ``32 r .. 32 r + 31`` of every tile (one row a thread) and stores each 16 bytes of a row
both into its own stage and, by ``st.async`` (:func:`.rows.send16`, a device function the compile force-includes),
at the same place of the peer's stage, completing bytes on the peer's ``full`` barrier; a stage's ``full`` then
expects its 128 local arrivals and the peer's :data:`PEER_BYTES`, and its ``empty`` the consumers of both blocks
(each consumer thread arrives on both), since a producer writes into both blocks. The blocks synchronise as a
cluster after their barriers exist and before they exit.

Synchronisation: ``full`` / ``empty`` mbarriers per stage (the producer; both consumers release), ``q_full`` /
``q_free`` per piece (the query block), and named barriers between the consumers: P ready (group 0 arrives,
group 1 waits), P free (group 1 arrives after each tile, group 0 waits before writing P again, once more at the
end), and the epilogue (both wait: the rows' output scale, double-buffered by piece parity).
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E, alloc_softmax_state, attention_macros
from .. import layout as L
from .args import sparse_sizes, word_sets
from .rows import (BH, BN, HD, LOADS, PRODUCER, ROWS, TWO_POW_120, byte_perm,  # noqa: F401 (the tests')
                          fp8_row_macros, nope_bytes_to_bf16, send4)

CONSUMER_THREADS = 256
# clustered form: each block's producer makes rows 32 * rank .. + 31 of every tile and stores each 16 bytes both into
# its own stage and (st.async) into the peer's, so a stage's full barrier expects, beside its 128 local arrivals,
# the peer's 32 rows of 1,024 bf16 bytes and their 32 flags
PEER_BYTES = (BN // 2) * L.D * 2 + (BN // 2) * 4
SCORES_REGS, SECOND_REGS, PRODUCER_REGS = 192, 160, 152
# named barriers (0 is __syncthreads)
P_READY, P_FREE, EPILOGUE = 4, 5, 6


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_sched(H: int, has_extra: bool, has_sink: bool, q_dtype: str = "bfloat16",
                           num_stages: int = 2, pdl: str = "", cluster: bool = False, load_hint: bool = False,
                           prefetch: bool = False):
    """The scheduled sparse MQA program for ``H`` query heads (blocks of 64, rows past ``H`` padded inside). A
    token with no valid entry gets the LSE ``empty_lse`` (a run-time argument: ``-inf``, or FlashMLA's ``+inf``).
    ``pdl``: where each block triggers the programmatic dependent launch of the combine (which waits for this
    grid's completion before it reads a partial): ``"start"``, at the block's start; ``"end"``, once its scores
    group has issued the last tile's GEMMs of its last token, before that token's epilogue (FlashMLA's SM90
    decode triggers there), so the combine's launch overlaps the grid's tail; ``""``, none. ``load_hint``: the
    producer's cache loads carry an L1 evict-last and a 256-byte L2 prefetch hint (:func:`.rows.fp8_row_macros`;
    CUDA only). ``prefetch``: once the producer has the next tile's indices (read while this tile's rows arrive), it
    asks L2 for that tile's rows (a bulk prefetch a row; CUDA sm_90), so that their loads after this tile's
    stores find them there: the rows' memory latency overlaps a tile's dequantisation, which the registers (one
    tile's bytes) do not allow otherwise. ``cluster`` (65-128 heads, CUDA sm_90): the two head blocks of a part run
    as a cluster sharing the dequantisation (see :data:`PEER_BYTES`)."""
    assert q_dtype == "bfloat16", "the FP8 bytes become bf16 by bit moves"
    assert not cluster or BH < H <= 2 * BH, "a cluster is the two head blocks of 65-128 heads"
    D, NS = L.D, num_stages
    sizes = sparse_sizes()
    NT, K1, K2 = sizes.NT, sizes.K1, sizes.K2
    main, extra = word_sets(sizes)
    PARTS = T.dynamic("num_parts")
    NP = T.dynamic("num_partials")
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + BH - 1) // BH

    NR = 1 if cluster else ROWS  # rows a producer thread makes per tile
    assert pdl in ("", "start", "end"), pdl
    load_q, entry, load_rows, store_row, _, load_one, store_row_sent, prefetch_row = fp8_row_macros(
        H, has_extra, q_dtype, K1, K2, NR, load_hint=load_hint)
    softmax_step = attention_macros(BH, BN, HD, HD, 0, 0, False, q_dtype).softmax_step  # the dense programs' step

    def launch(blocks, parts):
        """The kernel frame: ``blocks x parts`` blocks, in clusters of the two head blocks of a part if ``cluster``."""
        if cluster:
            return T.ClusterKernel(blocks, parts, cluster_dims=(2, 1, 1), threads=CONSUMER_THREADS + PRODUCER)
        return T.Kernel(blocks, parts, threads=CONSUMER_THREADS + PRODUCER)

    def row_of(base_row, r, rank):
        """The tile row of a producer thread's buffer row ``r``: rows ``base_row`` and ``base_row + 32``, or in a
        cluster its block's half, ``base_row + 32 * rank``."""
        return base_row + (rank if cluster else r) * 32

    def main_tiles(L1, t):
        """The key tiles of token ``t``'s main set (its length clipped to ``[0, K1]``); the extra set's follow."""
        return T.ceildiv(T.max(T.min(L1[t], K1), 0), BN)

    def token_tiles(t, t0, t1, j0, j1, tiles):
        """``(pc, jb, je)`` of token ``t`` in a part that spans tiles ``j0 ..`` of token ``t0`` to tiles ``.. j1`` of
        token ``t1``: the token's place in the part and the first and end key tile the part takes of it (each warp
        group walks the part's tokens by these)."""
        return t - t0, T.if_then_else(t == t0, j0, 0), T.if_then_else(t == t1, j1, tiles[t])

    # ---- the program ------------------------------------------------------------------------------------------

    @T.prim_func
    def sparse_mqa_sched(
        Q: T.Tensor((NT, H, D), q_dtype),
        CW: main.words, CS: main.scales, I1: main.indices, L1: main.lengths,
        XW: extra.words, XS: extra.scales, I2: extra.indices, L2: extra.lengths,
        sinks: T.Tensor((H,), "float32"),
        # the plan (schedule.py): each part's span, each token's tiles, first part and row among the partials
        part_meta: T.Tensor((PARTS, 4), "int32"), tiles: T.Tensor((NT,), "int32"),
        first_part: T.Tensor((NT,), "int32"), split_row: T.Tensor((NT,), "int32"),
        sm_scale: T.float32, empty_lse: T.float32,
        rows1: T.int32, stride1: T.int64, slots1: T.int32,  # each cache's geometry (see _glue._flat_views)
        rows2: T.int32, stride2: T.int64, slots2: T.int32,
        O: T.Tensor((NT, H, D), q_dtype),
        LSE: T.Tensor((NT, H), "float32"),
        O_part: T.Tensor((NP, H, D), ACC),
        L_part: T.Tensor((NP, H), ACC),
    ):
        with launch(head_blocks, PARTS) as (bh, bp):
            if pdl == "start":
                T.pdl_trigger()
            Ql_s = T.alloc_shared([BH, HD], q_dtype)
            Qr_s = T.alloc_shared([BH, HD], q_dtype)
            Kl_s = T.alloc_shared([NS, BN, HD], q_dtype)
            Kr_s = T.alloc_shared([NS, BN, HD], q_dtype)
            P_s = T.alloc_shared([BH, BN], q_dtype)
            ok_s = T.alloc_shared([NS, BN], "int32", scope="shared")
            alpha_s = T.alloc_shared([BH], ACC, scope="shared")
            oscale_s = T.alloc_shared([2, BH], ACC, scope="shared")
            full = T.alloc_barrier([PRODUCER] * NS)
            if cluster:  # both blocks' consumers release a stage: its producers store into both blocks
                empty = T.alloc_cluster_barrier([2 * CONSUMER_THREADS] * NS)
            else:
                empty = T.alloc_barrier([CONSUMER_THREADS] * NS)
            q_full = T.alloc_barrier(PRODUCER)
            q_free = T.alloc_barrier(CONSUMER_THREADS // 2)
            tx = T.get_thread_binding()
            h0 = bh * BH
            t0 = part_meta[bp, 0]
            j0 = part_meta[bp, 1]
            t1 = part_meta[bp, 2]
            j1 = part_meta[bp, 3]
            scale_log2 = sm_scale * LOG2E
            if cluster:
                peer = 1 - bh  # the other block of the cluster (rank = head block)
                T.cluster_sync()  # both blocks' barriers exist before either arrives on or stores into the other's

            # ---- warp group 0: scores, softmax, O[:, :256] ----
            with T.ws(0):
                T.set_max_nreg(SCORES_REGS, 1)
                state = alloc_softmax_state(BH, BN, HD, q_dtype, with_m_tile=False)
                acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i = state.registers()
                k = T.alloc_var("int32")
                k = 0
                for t in T.serial(t0, t1 + 1):
                    pc, jb, je = token_tiles(t, t0, t1, j0, j1, tiles)
                    T.fill(acc_o, 0)
                    T.fill(l_i, 0)
                    T.fill(m_i, NEG_INF)
                    T.mbarrier_wait_parity(q_full, pc & 1)
                    for j in T.serial(jb, je):
                        st = k % NS
                        T.mbarrier_wait_parity(full[st], (k // NS) & 1)
                        T.wgmma_gemm(Ql_s, Kl_s[st, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                     clear_accum=True)
                        T.wgmma_gemm(Qr_s, Kr_s[st, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        if j == je - 1:
                            T.mbarrier_arrive(q_free)  # the producer may load the next token's query rows
                        for i, jj in T.Parallel(BH, BN):
                            acc_s[i, jj] = T.if_then_else(ok_s[st, jj] != 0, acc_s[i, jj], NEG_INF)
                        softmax_step(state, scale_log2, True)  # a row may have seen only invalid entries
                        if k > 0:
                            T.sync_threads(P_FREE, CONSUMER_THREADS)  # group 1 is done with the last P
                        T.copy(acc_p, P_s)
                        for i in T.Parallel(BH):
                            alpha_s[i] = alpha[i]
                        T.fence_proxy_async()  # P_s is read by group 1's WGMMA (async proxy)
                        T.named_barrier_arrive(P_READY, CONSUMER_THREADS)
                        T.wgmma_gemm(acc_p, Kl_s[st, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(empty[st])
                        if cluster:
                            T.mbarrier_arrive(empty[st], peer)
                        k = k + 1
                    if pdl == "end":
                        if T.And(t == t1, tx == 0):  # the part's last tile is done: the combine may launch
                            T.pdl_trigger()
                    # epilogue: the rows' output scale (shared with group 1), the left half, the LSE
                    row = split_row[t]
                    piece = row + bp - first_part[t]
                    for i in T.Parallel(BH):
                        if has_sink:
                            row_sum[i] = T.if_then_else(
                                T.Or(m_i[i] == NEG_INF, row >= 0), 0.0,
                                T.exp2(sinks[T.min(h0 + i, H - 1)] * LOG2E - m_i[i] * scale_log2))
                        else:
                            row_sum[i] = 0.0
                        alpha[i] = T.if_then_else(l_i[i] == 0.0, 0.0, 1.0 / (l_i[i] + row_sum[i]))
                        oscale_s[pc % 2, i] = alpha[i]
                    T.sync_threads(EPILOGUE, CONSUMER_THREADS)
                    if row < 0:
                        for i, d in T.Parallel(BH, HD):
                            if h0 + i < H:
                                O[t, h0 + i, d] = T.Cast(q_dtype, acc_o[i, d] * alpha[i])
                        for i in T.Parallel(BH):
                            if h0 + i < H:
                                LSE[t, h0 + i] = T.if_then_else(
                                    l_i[i] == 0.0, empty_lse, (T.log2(l_i[i]) + m_i[i] * scale_log2) / LOG2E)
                    else:
                        for i, d in T.Parallel(BH, HD):
                            if h0 + i < H:
                                O_part[piece, h0 + i, d] = acc_o[i, d] * alpha[i]
                        for i in T.Parallel(BH):
                            if h0 + i < H:
                                L_part[piece, h0 + i] = T.if_then_else(
                                    l_i[i] == 0.0, NEG_INF, T.log2(l_i[i]) + m_i[i] * scale_log2)
                if k > 0:
                    T.sync_threads(P_FREE, CONSUMER_THREADS)  # pairs group 1's arrival after its last tile

            # ---- warp group 1: O[:, 256:] ----
            with T.ws(1):
                T.set_max_nreg(SECOND_REGS, 0)
                acc_o2 = T.alloc_fragment([BH, HD], ACC)
                k2 = T.alloc_var("int32")
                k2 = 0
                for t in T.serial(t0, t1 + 1):
                    pc, jb, je = token_tiles(t, t0, t1, j0, j1, tiles)
                    T.fill(acc_o2, 0)
                    for j in T.serial(jb, je):
                        st = k2 % NS
                        T.sync_threads(P_READY, CONSUMER_THREADS)
                        for i, d in T.Parallel(BH, HD):
                            acc_o2[i, d] *= alpha_s[i]
                        T.wgmma_gemm(P_s, Kr_s[st, :, :], acc_o2, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(empty[st])
                        if cluster:
                            T.mbarrier_arrive(empty[st], peer)
                        T.named_barrier_arrive(P_FREE, CONSUMER_THREADS)
                        k2 = k2 + 1
                    T.sync_threads(EPILOGUE, CONSUMER_THREADS)
                    row = split_row[t]
                    piece = row + bp - first_part[t]
                    if row < 0:
                        for i, d in T.Parallel(BH, HD):
                            if h0 + i < H:
                                O[t, h0 + i, HD + d] = T.Cast(q_dtype, acc_o2[i, d] * oscale_s[pc % 2, i])
                    else:
                        for i, d in T.Parallel(BH, HD):
                            if h0 + i < H:
                                O_part[piece, h0 + i, HD + d] = acc_o2[i, d] * oscale_s[pc % 2, i]

            # ---- warp group 2: the producer ----
            with T.ws(2):
                T.set_max_nreg(PRODUCER_REGS, 0)
                p = tx - CONSUMER_THREADS
                q = (p % 32) // 8  # this lane's 16-byte column of each 64-byte step
                base_row = (p // 32) * 8 + p % 8  # this thread's first row; the second is 32 rows on
                raw = T.alloc_local([NR, LOADS * 4], "int32")
                sw = T.alloc_local([NR, 2], "int32")
                idx = T.alloc_local([NR], "int32")
                nidx = T.alloc_local([NR], "int32")
                ok = T.alloc_local([NR], "int32")
                outw = T.alloc_local([8], "int32")
                fac = T.alloc_local([2], "uint16")
                kp = T.alloc_var("int32")
                kp = 0
                if t0 <= t1:  # the first tile's indices (later pieces': read during the piece before)
                    for r in T.unroll(NR):
                        entry(nidx, r, j0, main_tiles(L1, t0), row_of(base_row, r, bh), t0, I1, L1, I2, L2)
                for t in T.serial(t0, t1 + 1):
                    pc, jb, je = token_tiles(t, t0, t1, j0, j1, tiles)
                    n1 = main_tiles(L1, t)
                    for j in T.serial(jb, je):
                        st = kp % NS
                        for r in T.unroll(NR):
                            idx[r] = nidx[r]
                        if cluster:
                            load_one(raw, sw, 0, 0, idx, ok, q, j < n1, CW, CS, rows1, stride1, slots1, XW, XS, rows2,
                                     stride2, slots2)
                        else:
                            load_rows(raw, sw, idx, ok, q, j < n1, CW, CS, rows1, stride1, slots1, XW, XS, rows2,
                                      stride2, slots2)
                        if j + 1 < je:  # the next tile's indices, read while this one's rows arrive
                            for r in T.unroll(NR):
                                entry(nidx, r, j + 1, n1, row_of(base_row, r, bh), t, I1, L1, I2, L2)
                            if prefetch:
                                for r in T.unroll(NR):
                                    prefetch_row(nidx[r], q, j + 1 < n1, CW, CS, rows1, stride1, slots1, XW, XS,
                                                 rows2, stride2, slots2)
                        elif t < t1:  # or the next piece's first
                            for r in T.unroll(NR):
                                entry(nidx, r, 0, main_tiles(L1, t + 1), row_of(base_row, r, bh), t + 1, I1, L1, I2,
                                      L2)
                            if prefetch:
                                for r in T.unroll(NR):
                                    prefetch_row(nidx[r], q, 0 < main_tiles(L1, t + 1), CW, CS, rows1, stride1, slots1,
                                                 XW, XS, rows2, stride2, slots2)
                        if j == jb:  # the query rows, once the scores group is done with the last ones; their
                            # copies' latency runs beside this tile's loads
                            if pc > 0:
                                T.mbarrier_wait_parity(q_free, (pc - 1) & 1)
                            load_q(Q, Ql_s, Qr_s, t, h0, p)
                            T.ptx_wait_group(0)
                            T.fence_proxy_async()
                            T.mbarrier_arrive(q_full)
                        T.mbarrier_wait_parity(empty[st], ((kp // NS) & 1) ^ 1)
                        if cluster:  # this block's half of the tile's rows, into both blocks' stage
                            store_row_sent(Kl_s, Kr_s, st, row_of(base_row, 0, bh), raw, sw, 0, q, outw, fac, peer,
                                           full)
                            if q == 0:
                                ok_s[st, row_of(base_row, 0, bh)] = ok[0]
                                send4(ok_s[st, row_of(base_row, 0, bh)], peer, ok[0], full[st])
                        else:
                            for r in T.unroll(ROWS):
                                store_row(Kl_s, Kr_s, st, base_row + r * 32, raw, sw, r, q, outw, fac)
                                if q == 0:
                                    ok_s[st, base_row + r * 32] = ok[r]
                        T.fence_proxy_async()  # generic-proxy stores, read by the WGMMAs (async proxy)
                        if cluster and p == 0:  # the peer's half arrives as bytes on this barrier
                            T.mbarrier_arrive_expect_tx(full[st], PEER_BYTES)
                        else:
                            T.mbarrier_arrive(full[st])
                        kp = kp + 1
            if cluster:
                T.cluster_sync()  # neither block exits while the other may still arrive on or store into it

    return sparse_mqa_sched
