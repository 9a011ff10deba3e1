"""TileLang sparse MQA over DeepSeek-V4's FP8 caches for 128 query heads on Hopper-class GPUs: the scheduled
program's division of the work (:mod:`.sched_kernel`, the same per-batch plan) with the two 64-head blocks of a
part launched as one cluster that shares the dequantisation, as FlashMLA's SM90 sparse decode does for 128 heads.

The scheduled program runs the two head blocks of a part independently, so each producer dequantises all 64 rows
of every key tile: at 128 heads the FP8 rows pass through two producers. Here the blocks of a part form a cluster
of two (rank = head block), and the producer of rank ``r`` dequantises only rows ``32 r .. 32 r + 31`` of each
tile, into its block's half of the stage, then sends that half to its peer with one bulk shared-to-shared copy
per buffer, which completes on the peer's ``rfull`` barrier. Each stage is held as two 32-row halves (``K*0`` the
rows rank 0 makes, ``K*1`` rank 1's), each a whole buffer so that a half is one contiguous copy, and the GEMMs
take the halves as two operands (``S = Q K^T`` as two 64 x 32 tiles; ``O += P V`` as two K-32 steps).

Synchronisation, per stage: ``full`` (the local producer's 128 threads, its half stored), ``rfull`` (the peer's
three copies, each arriving with the bytes it brings), ``empty`` (every consumer thread of both
blocks arrives on both blocks' barrier: a producer overwrites its half in both blocks only when both blocks'
consumers are done with the stage). The blocks synchronise as a cluster after their barriers are made (no remote
arrive or copy before the peer's barriers exist) and before they exit (none after the peer has gone).

Status: correct on the H200 (its GPU tests pass) but slower than the scheduled program from 32 tokens (1.34-1.44x
its time: docs/dsv4.md), so ``tilelang_impl.SCHED_CLUSTER`` stays off and the scheduled program keeps one block per
64 heads. MUSA's MP31 has no clusters, so the MUSA form keeps :mod:`.mqa_kernel` either way.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E
from .. import layout as L
from .args import sparse_sizes, word_sets
from .rows import BH, BN, HD, LOADS, PRODUCER, fp8_row_macros
from .sched_kernel import (CONSUMER_THREADS, P_FREE, P_READY, PRODUCER_REGS, SCORES_REGS, SECOND_REGS,
                           epilogue_macros)

HALF = BN // 2  # the rows of a tile one block of the cluster dequantises
# the peer's copies into a stage (its two 32 x 256 halves and its rows' flags): each arrives on this block's
# ``rfull`` with the bytes it brings (TileLang's SM-to-SM copy arrives and expects on the destination's barrier)
REMOTE_COPIES = 3
PRODUCER_SYNC = 7  # named barrier of the producer warp group: its half stored before the copies read it


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_cluster(H: int, has_extra: bool, has_sink: bool, q_dtype: str = "bfloat16",
                             num_stages: int = 2):
    """The clustered program for ``H`` query heads, ``64 < H <= 128`` (two head blocks, one cluster a part)."""
    assert q_dtype == "bfloat16", "the FP8 bytes become bf16 by bit moves"
    assert BH < H <= 2 * BH, "two head blocks make the cluster"
    D, NS = L.D, num_stages
    sizes = sparse_sizes()
    NT, K1, K2 = sizes.NT, sizes.K1, sizes.K2
    main, extra = word_sets(sizes)
    PARTS = T.dynamic("num_parts")
    NP = T.dynamic("num_partials")
    NEG_INF = -T.infinity(ACC)

    load_q, entry, _, store_row, _, load_one = fp8_row_macros(H, has_extra, q_dtype, K1, K2, buf_rows=1)
    left_end, right_end = epilogue_macros(H, has_sink, q_dtype)

    @T.macro
    def produce(Kl, Kr, ok_h, st, raw, sw, ok, q, local_row, peer, rfull, outw, fac, p):
        """This block's half of stage ``st`` (buffers ``Kl`` / ``Kr`` / ``ok_h``): the thread's row, loaded before
        the stage was waited for, stored as bf16 with its flag, then (once every producer thread has stored) the
        three buffers copied to the peer."""
        store_row(Kl, Kr, st, local_row, raw, sw, 0, q, outw, fac)
        if q == 0:
            ok_h[st, local_row] = ok[0]
        T.fence_proxy_async()  # generic stores, read by the bulk copies and the WGMMAs (async proxy)
        T.sync_threads(PRODUCER_SYNC, PRODUCER)
        if p == 0:
            T.copy_cluster(Kl[st, :, :], Kl[st, :, :], dst_block=peer, remote_barrier=rfull[st])
            T.copy_cluster(Kr[st, :, :], Kr[st, :, :], dst_block=peer, remote_barrier=rfull[st])
            T.copy_cluster(ok_h[st, :], ok_h[st, :], dst_block=peer, remote_barrier=rfull[st])

    @T.prim_func
    def sparse_mqa_cluster(
        Q: T.Tensor((NT, H, D), q_dtype),
        CW: main.words, CS: main.scales, I1: main.indices, L1: main.lengths,
        XW: extra.words, XS: extra.scales, I2: extra.indices, L2: extra.lengths,
        sinks: T.Tensor((H,), "float32"),
        part_meta: T.Tensor((PARTS, 4), "int32"), tiles: T.Tensor((NT,), "int32"),
        first_part: T.Tensor((NT,), "int32"), split_row: T.Tensor((NT,), "int32"),
        sm_scale: T.float32, empty_lse: T.float32,
        rows1: T.int32, stride1: T.int64, slots1: T.int32,
        rows2: T.int32, stride2: T.int64, slots2: T.int32,
        O: T.Tensor((NT, H, D), q_dtype),
        LSE: T.Tensor((NT, H), "float32"),
        O_part: T.Tensor((NP, H, D), ACC),
        L_part: T.Tensor((NP, H), ACC),
    ):
        with T.ClusterKernel(2, PARTS, cluster_dims=(2, 1, 1), threads=CONSUMER_THREADS + PRODUCER) as (bh, bp):
            Ql_s = T.alloc_shared([BH, HD], q_dtype)
            Qr_s = T.alloc_shared([BH, HD], q_dtype)
            Kl0 = T.alloc_shared([NS, HALF, HD], q_dtype)
            Kr0 = T.alloc_shared([NS, HALF, HD], q_dtype)
            Kl1 = T.alloc_shared([NS, HALF, HD], q_dtype)
            Kr1 = T.alloc_shared([NS, HALF, HD], q_dtype)
            P0_s = T.alloc_shared([BH, HALF], q_dtype)
            P1_s = T.alloc_shared([BH, HALF], q_dtype)
            ok0 = T.alloc_shared([NS, HALF], "int32", scope="shared")
            ok1 = T.alloc_shared([NS, HALF], "int32", scope="shared")
            alpha_s = T.alloc_shared([BH], ACC, scope="shared")
            oscale_s = T.alloc_shared([2, BH], ACC, scope="shared")
            full = T.alloc_barrier([PRODUCER] * NS)
            rfull = T.alloc_cluster_barrier([REMOTE_COPIES] * NS)
            empty = T.alloc_cluster_barrier([2 * CONSUMER_THREADS] * NS)
            q_full = T.alloc_barrier(PRODUCER)
            q_free = T.alloc_barrier(CONSUMER_THREADS // 2)
            tx = T.get_thread_binding()
            peer = 1 - bh
            h0 = bh * BH
            t0 = part_meta[bp, 0]
            j0 = part_meta[bp, 1]
            t1 = part_meta[bp, 2]
            j1 = part_meta[bp, 3]
            scale_log2 = sm_scale * LOG2E
            T.cluster_sync()  # both blocks' barriers exist before either arrives on or copies into the other's

            # ---- warp group 0: scores, softmax, O[:, :256] ----
            with T.ws(0):
                T.set_max_nreg(SCORES_REGS, 1)
                acc_s0 = T.alloc_fragment([BH, HALF], ACC)
                acc_s1 = T.alloc_fragment([BH, HALF], ACC)
                acc_p0 = T.alloc_fragment([BH, HALF], q_dtype)
                acc_p1 = T.alloc_fragment([BH, HALF], q_dtype)
                acc_o = T.alloc_fragment([BH, HD], ACC)
                m_i = T.alloc_fragment([BH], ACC)
                m_prev = T.alloc_fragment([BH], ACC)
                alpha = T.alloc_fragment([BH], ACC)
                row_sum = T.alloc_fragment([BH], ACC)
                row_sum1 = T.alloc_fragment([BH], ACC)
                l_i = T.alloc_fragment([BH], ACC)
                k = T.alloc_var("int32")
                k = 0
                for t in T.serial(t0, t1 + 1):
                    pc = t - t0
                    jb = T.if_then_else(t == t0, j0, 0)
                    je = T.if_then_else(t == t1, j1, tiles[t])
                    T.fill(acc_o, 0)
                    T.fill(l_i, 0)
                    T.fill(m_i, NEG_INF)
                    T.mbarrier_wait_parity(q_full, pc & 1)
                    for j in T.serial(jb, je):
                        st = k % NS
                        T.mbarrier_wait_parity(full[st], (k // NS) & 1)
                        T.mbarrier_wait_parity(rfull[st], (k // NS) & 1)
                        T.wgmma_gemm(Ql_s, Kl0[st, :, :], acc_s0, transpose_B=True,
                                     policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                        T.wgmma_gemm(Qr_s, Kr0[st, :, :], acc_s0, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wgmma_gemm(Ql_s, Kl1[st, :, :], acc_s1, transpose_B=True,
                                     policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                        T.wgmma_gemm(Qr_s, Kr1[st, :, :], acc_s1, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        if j == je - 1:
                            T.mbarrier_arrive(q_free)
                        for i, jj in T.Parallel(BH, HALF):
                            acc_s0[i, jj] = T.if_then_else(ok0[st, jj] != 0, acc_s0[i, jj], NEG_INF)
                        for i, jj in T.Parallel(BH, HALF):
                            acc_s1[i, jj] = T.if_then_else(ok1[st, jj] != 0, acc_s1[i, jj], NEG_INF)
                        T.copy(m_i, m_prev)
                        T.reduce_max(acc_s0, m_i, dim=1, clear=False)
                        T.reduce_max(acc_s1, m_i, dim=1, clear=False)
                        for i in T.Parallel(BH):
                            alpha[i] = T.if_then_else(m_i[i] == NEG_INF, 1.0,
                                                      T.exp2((m_prev[i] - m_i[i]) * scale_log2))
                        for i, jj in T.Parallel(BH, HALF):
                            acc_s0[i, jj] = T.if_then_else(m_i[i] == NEG_INF, 0.0,
                                                           T.exp2(acc_s0[i, jj] * scale_log2 - m_i[i] * scale_log2))
                        for i, jj in T.Parallel(BH, HALF):
                            acc_s1[i, jj] = T.if_then_else(m_i[i] == NEG_INF, 0.0,
                                                           T.exp2(acc_s1[i, jj] * scale_log2 - m_i[i] * scale_log2))
                        T.reduce_sum(acc_s0, row_sum, dim=1)
                        T.reduce_sum(acc_s1, row_sum1, dim=1)
                        for i in T.Parallel(BH):
                            l_i[i] = l_i[i] * alpha[i] + row_sum[i] + row_sum1[i]
                        T.copy(acc_s0, acc_p0)
                        T.copy(acc_s1, acc_p1)
                        for i, d in T.Parallel(BH, HD):
                            acc_o[i, d] *= alpha[i]
                        if k > 0:
                            T.sync_threads(P_FREE, CONSUMER_THREADS)
                        T.copy(acc_p0, P0_s)
                        T.copy(acc_p1, P1_s)
                        for i in T.Parallel(BH):
                            alpha_s[i] = alpha[i]
                        T.fence_proxy_async()
                        T.named_barrier_arrive(P_READY, CONSUMER_THREADS)
                        T.wgmma_gemm(acc_p0, Kl0[st, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        T.wgmma_gemm(acc_p1, Kl1[st, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(empty[st])
                        T.mbarrier_arrive(empty[st], peer)
                        k = k + 1
                    left_end(t, pc, bp, h0, acc_o, m_i, l_i, alpha, row_sum, oscale_s, scale_log2, sinks, split_row,
                             first_part, empty_lse, O, LSE, O_part, L_part)
                if k > 0:
                    T.sync_threads(P_FREE, CONSUMER_THREADS)

            # ---- warp group 1: O[:, 256:] ----
            with T.ws(1):
                T.set_max_nreg(SECOND_REGS, 0)
                acc_o2 = T.alloc_fragment([BH, HD], ACC)
                k2 = T.alloc_var("int32")
                k2 = 0
                for t in T.serial(t0, t1 + 1):
                    pc = t - t0
                    jb = T.if_then_else(t == t0, j0, 0)
                    je = T.if_then_else(t == t1, j1, tiles[t])
                    T.fill(acc_o2, 0)
                    for j in T.serial(jb, je):
                        st = k2 % NS
                        T.sync_threads(P_READY, CONSUMER_THREADS)
                        for i, d in T.Parallel(BH, HD):
                            acc_o2[i, d] *= alpha_s[i]
                        T.wgmma_gemm(P0_s, Kr0[st, :, :], acc_o2, policy=T.GemmWarpPolicy.FullRow)
                        T.wgmma_gemm(P1_s, Kr1[st, :, :], acc_o2, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(empty[st])
                        T.mbarrier_arrive(empty[st], peer)
                        T.named_barrier_arrive(P_FREE, CONSUMER_THREADS)
                        k2 = k2 + 1
                    right_end(t, pc, bp, h0, acc_o2, oscale_s, split_row, first_part, O, O_part)

            # ---- warp group 2: the producer of this block's half of every tile ----
            with T.ws(2):
                T.set_max_nreg(PRODUCER_REGS, 0)
                p = tx - CONSUMER_THREADS
                q = (p % 32) // 8
                local_row = (p // 32) * 8 + p % 8  # this thread's row of the block's half
                raw = T.alloc_local([1, LOADS * 4], "int32")
                sw = T.alloc_local([1, 2], "int32")
                idx = T.alloc_local([1], "int32")
                nidx = T.alloc_local([1], "int32")
                ok = T.alloc_local([1], "int32")
                outw = T.alloc_local([8], "int32")
                fac = T.alloc_local([2], "uint16")
                kp = T.alloc_var("int32")
                kp = 0
                if t0 <= t1:
                    entry(nidx, 0, j0, T.ceildiv(T.max(T.min(L1[t0], K1), 0), BN), bh * HALF + local_row, t0, I1,
                          L1, I2, L2)
                for t in T.serial(t0, t1 + 1):
                    pc = t - t0
                    jb = T.if_then_else(t == t0, j0, 0)
                    je = T.if_then_else(t == t1, j1, tiles[t])
                    n1 = T.ceildiv(T.max(T.min(L1[t], K1), 0), BN)
                    for j in T.serial(jb, je):
                        st = kp % NS
                        idx[0] = nidx[0]
                        load_one(raw, sw, 0, 0, idx, ok, q, j < n1, CW, CS, rows1, stride1, slots1, XW, XS, rows2,
                                 stride2, slots2)
                        if j + 1 < je:
                            entry(nidx, 0, j + 1, n1, bh * HALF + local_row, t, I1, L1, I2, L2)
                        elif t < t1:
                            entry(nidx, 0, 0, T.ceildiv(T.max(T.min(L1[t + 1], K1), 0), BN), bh * HALF + local_row,
                                  t + 1, I1, L1, I2, L2)
                        if j == jb:
                            if pc > 0:
                                T.mbarrier_wait_parity(q_free, (pc - 1) & 1)
                            load_q(Q, Ql_s, Qr_s, t, h0, p)
                            T.ptx_wait_group(0)
                            T.fence_proxy_async()
                            T.mbarrier_arrive(q_full)
                        T.mbarrier_wait_parity(empty[st], ((kp // NS) & 1) ^ 1)
                        if bh == 0:
                            produce(Kl0, Kr0, ok0, st, raw, sw, ok, q, local_row, peer, rfull, outw, fac, p)
                        else:
                            produce(Kl1, Kr1, ok1, st, raw, sw, ok, q, local_row, peer, rfull, outw, fac, p)
                        T.mbarrier_arrive(full[st])
                        kp = kp + 1
            T.cluster_sync()  # neither block exits while the other may still arrive on or copy into it

    return sparse_mqa_cluster
