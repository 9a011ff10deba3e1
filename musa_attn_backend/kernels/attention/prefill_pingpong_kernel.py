"""TileLang ping-pong prefill/extend program for Hopper-class GPUs (TMA, warp-group MMA, named barriers): a
producer warp group and two consumer warp groups that take turns on the tensor cores, in the manner of
FlashAttention-3 (conventions: :mod:`.tl_common`).

The persistent schedule (one block per SM walking the query tiles) was a tuning experiment, slower than one
block per tile; it was removed after commit 19d7cb1, where ``build_prefill_pingpong(persistent_ctas=...)`` and
the ``tune_prefill.py`` kinds ``pingpong_fm_persist`` / ``pingpong_fm3_persist`` still build it.
"""

import dataclasses
import functools
from typing import Any

from ..._tilelang import tl_lang as T
from .tl_common import (ACC, LOG2E, NEG_INF, attention_macros, page_row, paged_program, paged_sizes,
                        query_tile_macro, slot_row, visible)

# Named barriers (id 0 is __syncthreads; TileLang's own partial syncs are not used by its consumer code, which
# only touches registers, and shared memory through TMA and WGMMA)
TURN_BARRIERS = (5, 6)  # consumer group g waits on TURN_BARRIERS[g] for its turn to issue MMAs
PRODUCER_BARRIER = 7  # the gathering producer warp group's own sync (its tile's page-table rows resolved)
CONSUMERS = 2 * 128  # threads of the two consumer warp groups
HM = 64  # query rows per consumer warp group
BM = 2 * HM  # query rows per block


@dataclasses.dataclass(frozen=True)
class Stages:
    """The ring of ``num_stages`` key and value tile buffers and their barriers: the producer waits for
    ``*_empty[st]`` (both consumer groups are done with stage ``st``), fills it and signals ``*_full[st]``."""

    K_s: Any
    V_s: Any
    k_full: Any
    k_empty: Any
    v_full: Any
    v_empty: Any


@functools.lru_cache(maxsize=None)
def build_prefill_pingpong(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, causal: bool, has_softcap: bool,
                           has_sinks: bool, k_layout: tuple, v_layout: tuple, block_N: int = 128,
                           num_stages: int = 2, gather: bool = False, tma_rows: int = 0, ragged: bool = False):
    """Prefill/extend for Hopper-class GPUs (TMA + warp-group MMA + named barriers): explicit warp
    specialisation in the manner of FlashAttention-3.

    384 threads: warp group 2 is the producer (one warp issues TMA copies of Q and of each key/value tile, a
    whole tile of one page per copy, into ``num_stages`` buffers guarded by full/empty mbarriers); warp groups 0
    and 1 each own 64 query rows of the 128-row tile. Per key tile a consumer issues ``S = Q K^T`` and the
    previous tile's ``O += P V`` as asynchronous WGMMAs, waits only for ``S``, runs the online softmax while
    ``P V`` is still in flight, then waits for it. The two consumer warp groups take turns issuing their
    MMAs (named barriers), so one group's softmax overlaps the other's MMAs.

    Key tiles: with ``gather=False`` one TMA copy per tile of one page (``page_size % block_N == 0``, the
    launcher checks; rows of the last page past the sequence must hold finite values, they are masked); with
    ``gather=True`` (any page size) the whole producer warp group resolves the tile's rows through the page
    table and issues ``cp.async`` row copies, which arrive on the full barriers as they land (rows past the
    sequence copy its last key, masked). ``tma_rows`` (TMA tiles, 0 = ``block_N``): rows per TMA copy, for
    pages that hold no whole key tile but whole chunks of ``tma_rows`` keys (``page_size % tma_rows == 0``, the
    launcher checks; e.g. 16 for vLLM's 16-token blocks): ``block_N / tma_rows`` copies per tile, each through
    the page table; chunks past the sequence copy its last chunk again (its own page; masked). ``ragged`` (TMA
    whole tiles): ``KC`` / ``VC`` are the batch's new K/V rows packed like ``Q``, not a paged cache, for a batch
    in which no request has a cached prefix: request ``b``'s key ``j`` is row ``cu_seqlens_q[b] + j`` and the
    page table is not read (rows past a request's end are the next request's keys or clipped by TMA; masked).
    Same arguments and results as :func:`.prefill_kernel.build_prefill`; bf16/fp16 cache, no window.
    """
    G = Hq // Hkv
    BN, NS = block_N, num_stages
    sizes = paged_sizes()
    NT, B, _, MP = sizes
    HS_K, HS_V = k_layout[2], v_layout[2]
    rows_per_copy = tma_rows or BN
    copies_per_tile = BN // rows_per_copy
    assert not gather or rows_per_copy == BN, "tma_rows: TMA tiles"
    assert BN % rows_per_copy == 0 and rows_per_copy % 8 == 0, \
        f"tma_rows {rows_per_copy} must divide the {BN}-key tile into 8-row multiples"
    assert not ragged or (rows_per_copy == BN and not gather), "ragged: whole TMA tiles"
    assert not gather or (BN <= 128 and D % 8 == 0 and DV % 8 == 0 and 128 % (D // 8) == 0
                          and 128 % (DV // 8) == 0), "gather producer: one page-table row per thread"
    alloc_state, *_, finish_rows = attention_macros(HM, BN, D, DV, HS_K, HS_V, False, q_dtype)
    query_tile = query_tile_macro(G, BM, causal)
    # registers: 2 x 128 consumer + 128 producer threads in the 64K register file; gathers need addresses
    CONSUMER_REGS, PRODUCER_REGS = (232, 40) if gather or rows_per_copy < BN else (240, 24)
    FULL = 128 if gather else 32  # arrivals completing a full barrier: the threads that copy

    def crosses(n0, qpos0, sk):
        """Some (row, key) of the 64 x BN tile of keys from ``n0`` (rows: query positions from ``qpos0``) is
        masked."""
        c = n0 + BN > sk
        if causal:
            c = T.Or(c, n0 + BN - 1 > qpos0)
        return c

    # ---- producer -------------------------------------------------------------------------------------------

    @T.macro
    def gather_rows(cache, X_s, slot_s, st, p, col0, W):
        """Producer thread ``p`` (of 128) issues its 16-byte ``cp.async`` chunks of the tile's rows (explicit
        copies: TileLang's own lowering of a bounds-checked gather loop outside a pipeline is synchronous)."""
        chunks_per_row = W // 8
        rows_per_pass = 128 // chunks_per_row
        for i in T.serial(BN // rows_per_pass):
            T.ptx_cp_async(
                T.access_ptr(X_s[st, i * rows_per_pass + p // chunks_per_row, (p % chunks_per_row) * 8], "w", 8),
                T.access_ptr(cache[slot_s[st, i * rows_per_pass + p // chunks_per_row],
                                   col0 + (p % chunks_per_row) * 8], "r", 8), 8)

    @T.macro
    def gather_kv_tiles(KC, VC, stages, slot_s, page_table, page_size, tile, p):
        """The gathering producer (all 128 threads, ``p``: the thread's index): per tile, one page-table row per
        thread into ``slot_s``, a warp-group sync, then the K and V row copies, each arriving on its full
        barrier as it lands."""
        for k in T.serial(tile.n_iters):
            st = k % NS
            T.mbarrier_wait_parity(stages.k_empty[st], ((k // NS) & 1) ^ 1)
            if p < BN:
                # one row per thread; rows past the sequence read its last key (finite, masked)
                slot_s[st, p] = slot_row(page_table, tile.b, T.min(k * BN + p, tile.sk - 1), tile.sk, page_size,
                                         MP)
            T.sync_threads(PRODUCER_BARRIER, 128)
            gather_rows(KC, stages.K_s, slot_s, st, p, tile.kvh * HS_K, D)
            T.cp_async_barrier_noinc(stages.k_full[st])
            T.mbarrier_wait_parity(stages.v_empty[st], ((k // NS) & 1) ^ 1)
            gather_rows(VC, stages.V_s, slot_s, st, p, tile.kvh * HS_V, DV)
            T.cp_async_barrier_noinc(stages.v_full[st])

    @T.macro
    def tma_tile(cache, X_s, st, bars, col0, W, r0, rows):
        """TMA copies of one key or value tile (``W`` columns from ``col0``) into stage ``st`` (arriving on
        ``bars[st]``): one copy of the whole tile from row ``r0``, or one per ``rows_per_copy``-row chunk (from
        ``rows[c]``) and 64-column swizzle block (a contiguous box)."""
        if copies_per_tile == 1:
            T.tma_copy(cache[r0:r0 + BN, col0:col0 + W], X_s[st, :, :], barrier=bars[st])
        else:
            R = rows_per_copy
            for c in T.unroll(copies_per_tile):
                for h in T.unroll(W // 64):  # h: the 64-column block
                    T.tma_copy(cache[rows[c]:rows[c] + R, col0 + h * 64:col0 + h * 64 + 64],
                               X_s[st, c * R:(c + 1) * R, h * 64:h * 64 + 64], barrier=bars[st])

    @T.macro
    def tma_kv_tiles(KC, VC, stages, page_table, page_size, tile, rows, pv):
        """Producer warp: TMA copies of each key / value tile into the stage buffers, one per tile (a whole tile
        of one page, or with ``ragged`` from the request's first row ``q0``) or one per ``rows_per_copy``-row
        chunk of a page. Paged: the cache rows of ``32 / copies_per_tile`` tiles' chunks are read from the page
        table at once, one per lane into ``pv`` (so the first tiles' copies do not wait for one page-table read
        each), and each tile's are taken from their lanes (``rows``) before its stage is free. Chunks past the
        sequence: its last chunk again (own page; masked)."""
        tiles_per_read = 32 // copies_per_tile
        for k in T.serial(tile.n_iters):
            st = k % NS
            if not ragged:
                if k % tiles_per_read == 0:
                    pv[0] = page_row(page_table, tile.b,
                                     T.min((k * copies_per_tile + T.get_thread_binding() % 32) * rows_per_copy,
                                           (tile.sk - 1) // rows_per_copy * rows_per_copy), page_size)
                for c in T.unroll(copies_per_tile):
                    rows[c] = T.shfl_sync(pv[0], (k % tiles_per_read) * copies_per_tile + c)
            # a whole tile's first row
            r0 = (tile.q0 + k * BN if ragged else rows[0]) if copies_per_tile == 1 else None
            T.mbarrier_wait_parity(stages.k_empty[st], ((k // NS) & 1) ^ 1)
            tma_tile(KC, stages.K_s, st, stages.k_full, tile.kvh * HS_K, D, r0, rows)
            T.mbarrier_arrive(stages.k_full[st])
            T.mbarrier_wait_parity(stages.v_empty[st], ((k // NS) & 1) ^ 1)
            tma_tile(VC, stages.V_s, st, stages.v_full, tile.kvh * HS_V, DV, r0, rows)
            T.mbarrier_arrive(stages.v_full[st])

    # ---- consumers ------------------------------------------------------------------------------------------

    @T.macro
    def wait_full(bars, i, parity):
        T.mbarrier_wait_parity(bars[i], parity)
        if gather:
            T.fence_proxy_async()  # rows written by cp.async (generic proxy), read by WGMMA (async proxy)

    @T.macro
    def init_scores(acc_s, n0, qpos0, sk, cross):
        if not has_softcap:  # the mask is the initial value of the product
            if cross:
                for i, j in T.Parallel(HM, BN):
                    acc_s[i, j] = T.if_then_else(visible(n0 + j, qpos0 + i, sk, 0, causal, False), 0, NEG_INF)

    @T.macro
    def issue_scores(Q_g, K_st, acc_s, cross):
        if has_softcap:
            T.wgmma_gemm(Q_g, K_st, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
        else:
            T.wgmma_gemm(Q_g, K_st, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                         clear_accum=T.Not(cross))

    @T.macro
    def online_softmax(state, n0, qpos0, sk, cross, logit_scale, softcap, scale_log2):
        """P (in acc_s), the new running max / denominator, and alpha (the factor for O)."""
        acc_s, m_i, m_prev, alpha, row_sum, l_i = (state.acc_s, state.m_i, state.m_prev, state.alpha,
                                                   state.row_sum, state.l_i)
        if has_softcap:
            for i, j in T.Parallel(HM, BN):
                acc_s[i, j] = T.if_then_else(
                    T.Or(T.Not(cross), visible(n0 + j, qpos0 + i, sk, 0, causal, False)),
                    softcap * T.tanh(acc_s[i, j] * (logit_scale / softcap)), NEG_INF)
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for i in T.Parallel(HM):
            alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
        for i, j in T.Parallel(HM, BN):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for i in T.Parallel(HM):
            l_i[i] = l_i[i] * alpha[i] + row_sum[i]

    @T.macro
    def store_rows(g, tile, state, O, LSE, sinks, scale_log2):
        """This group's 64 output rows and their LSEs (rows past the request are not written)."""
        finish_rows(state, scale_log2, sinks, lambda i: tile.h, has_sinks)
        q0, qlen, m0, h = tile.q0, tile.qlen, tile.m0, tile.h
        acc_o, l_i, alpha = state.acc_o, state.l_i, state.alpha  # alpha: the row LSE
        for i, d in T.Parallel(HM, DV):
            if m0 + g * HM + i < qlen:
                O[q0 + m0 + g * HM + i, h, d] = T.Cast(
                    q_dtype, T.if_then_else(l_i[i] == 0.0, 0.0, acc_o[i, d] / l_i[i]))
        for i in T.Parallel(HM):
            if m0 + g * HM + i < qlen:
                LSE[q0 + m0 + g * HM + i, h] = alpha[i] / LOG2E

    @T.macro
    def consumer(g, tile, Q_s, q_full, stages, O, LSE, sinks, logit_scale, softcap):
        """Consumer warp group ``g``: its 64 rows of the query tile against all ``tile.n_iters`` key tiles.
        The loop body is straight-line in the WGMMAs (tile 0 peeled off): ptxas then sees which groups are in
        flight and does not insert waits of its own."""
        n_iters, sk = tile.n_iters, tile.sk
        K_s, V_s, k_full, k_empty, v_full, v_empty = (stages.K_s, stages.V_s, stages.k_full, stages.k_empty,
                                                      stages.v_full, stages.v_empty)
        with T.ws(g):
            T.set_max_nreg(CONSUMER_REGS, 1)
            state = alloc_state()
            acc_s, acc_p, acc_o, alpha = state.acc_s, state.acc_p, state.acc_o, state.alpha
            T.fill(acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)
            scale_log2 = LOG2E if has_softcap else logit_scale * LOG2E
            qpos0 = tile.prefix + tile.m0 + g * HM  # query position of this group's first row
            my_bar, other_bar = TURN_BARRIERS[g], TURN_BARRIERS[1 - g]
            T.mbarrier_wait_parity(q_full, 0)
            if g == 1:
                T.named_barrier_arrive(TURN_BARRIERS[0], CONSUMERS)  # group 0 issues first
            if n_iters > 0:
                cross0 = crosses(0, qpos0, sk)
                init_scores(acc_s, 0, qpos0, sk, cross0)
                T.sync_threads(my_bar, CONSUMERS)
                wait_full(k_full, 0, 0)
                issue_scores(Q_s[g, :, :], K_s[0, :, :], acc_s, cross0)
                T.named_barrier_arrive(other_bar, CONSUMERS)
                T.wait_wgmma(0)
                T.mbarrier_arrive(k_empty[0])
                online_softmax(state, 0, qpos0, sk, cross0, logit_scale, softcap, scale_log2)
                T.copy(acc_s, acc_p)
                for k in T.serial(1, n_iters):
                    n0 = k * BN
                    st = k % NS
                    sp = (k - 1) % NS
                    cross = crosses(n0, qpos0, sk)
                    init_scores(acc_s, n0, qpos0, sk, cross)
                    T.sync_threads(my_bar, CONSUMERS)
                    wait_full(k_full, st, (k // NS) & 1)
                    issue_scores(Q_s[g, :, :], K_s[st, :, :], acc_s, cross)
                    for i, d in T.Parallel(HM, DV):  # O to the running max P was computed with
                        acc_o[i, d] *= alpha[i]
                    wait_full(v_full, sp, ((k - 1) // NS) & 1)
                    T.wgmma_gemm(acc_p, V_s[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                    T.named_barrier_arrive(other_bar, CONSUMERS)
                    T.wait_wgmma(1)  # S is ready, P V of the previous tile may still run
                    T.mbarrier_arrive(k_empty[st])
                    online_softmax(state, n0, qpos0, sk, cross, logit_scale, softcap, scale_log2)
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(v_empty[sp])
                    T.copy(acc_s, acc_p)
                sl = (n_iters - 1) % NS
                for i, d in T.Parallel(HM, DV):
                    acc_o[i, d] *= alpha[i]
                wait_full(v_full, sl, ((n_iters - 1) // NS) & 1)
                T.wgmma_gemm(acc_p, V_s[sl, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)
                T.mbarrier_arrive(v_empty[sl])
            if g == 0:
                T.sync_threads(TURN_BARRIERS[0], CONSUMERS)  # group 1's last turn signal
            store_rows(g, tile, state, O, LSE, sinks, scale_log2)

    @T.macro
    def prefill(Q, KC, VC, cu_seqlens_q, seqlens_k, page_table, sinks, k_scale, v_scale, sm_scale, softcap, window,
                page_size, max_seqlen_q, O, LSE):
        with T.Kernel(T.ceildiv(max_seqlen_q, BM), Hq, B, threads=384) as (bx, by, bz):
            Q_s = T.alloc_shared([2, HM, D], q_dtype)
            K_s = T.alloc_shared([NS, BN, D], q_dtype)
            V_s = T.alloc_shared([NS, BN, DV], q_dtype)
            slot_s = T.alloc_shared([NS, BN], "int32") if gather else None
            q_full = T.alloc_barrier(32)
            k_full = T.alloc_barrier([FULL] * NS)
            v_full = T.alloc_barrier([FULL] * NS)
            k_empty = T.alloc_barrier([CONSUMERS] * NS)
            v_empty = T.alloc_barrier([CONSUMERS] * NS)
            stages = Stages(K_s, V_s, k_full, k_empty, v_full, v_empty)
            tx = T.get_thread_binding()

            t = query_tile(cu_seqlens_q, seqlens_k, max_seqlen_q, bx, by, bz)
            sk, m0, q0, h = t.sk, t.m0, t.q0, t.h
            kv_hi = T.min(sk, t.prefix + m0 + BM) if causal else sk
            n_iters = T.if_then_else(m0 < t.qlen, T.ceildiv(kv_hi, BN), 0)
            tile = t.visiting(n_iters)

            if tx >= 256:
                T.set_max_nreg(PRODUCER_REGS, 0)
            if tx >= 256 and tx < 288:
                if n_iters > 0:
                    T.tma_copy(Q[q0 + m0:q0 + m0 + HM, h, :], Q_s[0, :, :], barrier=q_full)
                    T.tma_copy(Q[q0 + m0 + HM:q0 + m0 + BM, h, :], Q_s[1, :, :], barrier=q_full)
                T.mbarrier_arrive(q_full)
                if not gather:
                    rows = None if ragged else T.alloc_local([copies_per_tile], "int32")
                    pv = None if ragged else T.alloc_local([1], "int32")
                    tma_kv_tiles(KC, VC, stages, page_table, page_size, tile, rows, pv)
            if gather:
                if tx >= 256:
                    p = tx - 256
                    gather_kv_tiles(KC, VC, stages, slot_s, page_table, page_size, tile, p)
            logit_scale = sm_scale
            consumer(0, tile, Q_s, q_full, stages, O, LSE, sinks, logit_scale, softcap)
            consumer(1, tile, Q_s, q_full, stages, O, LSE, sinks, logit_scale, softcap)

    return paged_program("prefill", prefill, sizes, Hq, Hkv, D, q_dtype, q_dtype, k_layout, v_layout,
                         T.Tensor((NT, Hq, DV), q_dtype), T.Tensor((NT, Hq), "float32"))
