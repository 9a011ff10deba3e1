"""TileLang sparse MQA over a bf16 workspace of DeepSeek-V4 key rows (:mod:`.workspace`), with a producer warp group
that stages the next key tile while the math groups work on this one, written within MUSA MP31's lowering rules
(docs/musa.md): every GEMM operand a whole shared tile, P through shared memory, K and V in tiles of their own,
synchronisation by barriers in shared memory only (no named barriers; register reallocation only where the target
has it), plain loads.

Why: in the portable program over the workspace (:mod:`.portable_ws_kernel`, what MUSA runs by default) every
thread both loads rows and does math, and in MUSA's tiles its two warp groups split each score GEMM down its 32
columns and exchange every row maximum and sum through shared memory (docs/dsv4.md). Here the
division is Moore Threads' sparse-MLA prefill for the S5000 (a producer of rows beside math warp groups that own
column ranges of the output, synchronised through barriers in shared memory), over 32-row tiles that fit MP31's
192 KB: the query (64 KB), two stages of K (2 x 32 KB), one V in two 256-column tiles (32 KB), P (4 KB).

384 threads, three groups of 128 (a GEMM is issued by one group: SQMMA and WGMMA take 128 threads):

- Group 2, the producer: per tile, its rows' indices (an invalid entry, past the token's length, negative or at or
  past ``W``'s rows, reads nothing and is flagged 0 in ``ok_s``), then the rows loaded into registers (a warp a row:
  32 lanes x 16 bytes, two loads a row, eight rows a warp), stored into the tile's K stage once the score GEMM two
  tiles back is done (``k_empty``) and, once both groups' ``P V`` of the last tile is done (``v_empty``), into the
  V tiles. So the next tile's loads are issued while this tile's scores, softmax and ``P V`` run.
- Group 0: ``S = Q K^T`` (64 x 32 over 512 columns), the masked online softmax (it alone holds the running maximum
  and sum), P and the rows' rescale factor into shared memory (once group 1 is done with the last ones:
  ``p_empty``), then ``O[:, 0:256] += P V0``.
- Group 1: ``O[:, 256:512]``, rescaled by group 0's factor, ``+= P V1``.

The tiles are taken in pairs (stage 0, stage 1), so that every barrier and tile is named by a Python constant (MP31
reads GEMM operand offsets as constants) and every parity is a pair's or a constant. A barrier's phase completes when
all of its arrivals are in; a wait on the parity before a fresh barrier's first phase returns at once (a stage that
was never filled is free).

Shared stores made by threads and read by the tensor cores are published by ``publish``: a proxy fence where the
target's tensor cores read shared memory through another proxy (``proxy_fence``: WGMMA), else the local store wait
of tilelang-musa's own producer/consumer programs where this TileLang has it.

The output (the sink in the denominator), the natural-log LSE (``empty_lse`` where no entry is valid) and ``MaxL``
(each row's largest scaled score, ``-inf`` where none is valid; FlashMLA's sparse prefill returns it) are written by
the block; nothing is split, so there is no combine.
"""

import functools
import inspect

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E
from .. import layout as L
from .tl_macros import workspace_args

BH, BN = 64, 32  # query heads a block, rows a key tile (MP31: two 64-row K/V tiles beside the query do not fit)
HD = L.D // 2  # the columns of an output half (a V tile)
GROUP = 128  # threads a group (one GEMM issuer)
THREADS = 3 * GROUP
WARPS = GROUP // 32  # the producer's warps
ROWS = BN // WARPS  # rows of a tile a producer warp (and thread) loads (8)
UNITS = 2  # 16-byte units a lane loads of a row (one in each half: 32 lanes x 16 bytes = 512 bytes)
# registers a thread where the target reallocates them between warp groups (``regs``; together at most the launch's
# 3 x 168): group 0 holds a 64 x 256 float32 accumulator (128 a thread) beside its scores and softmax, group 1 the
# accumulator alone, the producer one tile's rows (64) and their indices (ptxas for sm_90a: no spill at these; group 0
# spills at 224, the producer at 88)
REGS = (232, 176, 96)
# group 0's GEMMs: False, each waited for as issued; True, the next tile's scores issued beside this tile's P V0
# (asynchronous GEMMs waited for by count, as tilelang-musa's own prefill issues its SQMMAs), so that group 0's two
# GEMM chains overlap (not yet measured)
OVERLAP = False


def issue_gemm(A, B, C, **kw):
    """A tile GEMM issued and not waited for (``T.wait_wgmma(n)`` waits): tilelang-musa's ``T.gemm(...,
    wg_wait=-1)`` where this TileLang's ``T.gemm`` takes it, else ``T.wgmma_gemm`` (TileLang's asynchronous
    warp-group GEMM)."""
    if "wg_wait" in inspect.signature(T.gemm).parameters:
        return T.gemm(A, B, C, wg_wait=-1, **kw)
    return T.wgmma_gemm(A, B, C, **kw)


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_staged_ws(H: int, has_sink: bool, q_dtype: str = "bfloat16", proxy_fence: bool = True,
                               regs: bool = True, overlap: bool = False):
    """The staged program over a bf16 workspace for ``H`` query heads (blocks of 64, rows past ``H`` padded
    inside); ``proxy_fence``: ``publish``'s fence (the target's tensor cores read shared memory through an
    async proxy); ``regs``: the groups' registers reallocated (:data:`REGS`; 168 a thread otherwise, where group 0
    spills); ``overlap``: :data:`OVERLAP`. A token with no valid entry gets the LSE ``empty_lse`` (a run-time
    argument: ``-inf``, or FlashMLA's ``+inf``)."""
    assert q_dtype == "bfloat16", "the workspace holds bf16 rows"
    A = workspace_args(H, q_dtype, L.D)
    K, R = A.K, A.R
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + BH - 1) // BH
    store_wait = not proxy_fence and hasattr(T, "lma_wait")  # tilelang-musa's wait for local (shared) stores

    @T.macro
    def publish():
        """Make this thread's shared stores visible to the GEMMs that a barrier it arrives on next releases."""
        if proxy_fence:
            T.fence_proxy_async()
        elif store_wait:
            T.lma_wait()

    @T.macro
    def produce(st, it, par, K_s, V0_s, V1_s, ok_s, buf, idx, ok, W, I, t, length, lane, warp, k_full, k_empty,
                v_full, v_empty):
        """Tile ``it`` (stage ``st``, a Python int; ``par``: the stage's fill parity) into K stage ``st`` and the V
        tiles."""
        for i in T.unroll(ROWS):
            e = it * BN + i * WARPS + warp
            idx[i] = T.if_then_else(e < length, I[t, T.min(e, K - 1)], -1)
            ok[i] = T.if_then_else(T.And(idx[i] >= 0, idx[i] < R), 1, 0)
        for i in T.unroll(ROWS):
            for u in T.unroll(UNITS):
                for v in T.vectorized(8):
                    buf[(i * UNITS + u) * 8 + v] = T.if_then_else(
                        ok[i] != 0, W[T.max(idx[i], 0), u * HD + lane * 8 + v], T.Cast(q_dtype, 0))
        T.barrier_wait(k_empty[st], par ^ 1)
        for i in T.unroll(ROWS):
            for u in T.unroll(UNITS):
                for v in T.vectorized(8):
                    K_s[st, i * WARPS + warp, u * HD + lane * 8 + v] = buf[(i * UNITS + u) * 8 + v]
            if lane == 0:
                ok_s[st, i * WARPS + warp] = ok[i]
        publish()
        T.barrier_arrive(k_full[st])
        T.barrier_wait(v_empty[0], st ^ 1)
        for i in T.unroll(ROWS):
            for v in T.vectorized(8):
                V0_s[i * WARPS + warp, lane * 8 + v] = buf[(i * UNITS) * 8 + v]
            for v in T.vectorized(8):
                V1_s[i * WARPS + warp, lane * 8 + v] = buf[(i * UNITS + 1) * 8 + v]
        publish()
        T.barrier_arrive(v_full[0])

    @T.macro
    def scores(st, par, Q_s, K_s, acc_s, k_full):
        """``S = Q K^T`` of stage ``st``'s tile: waited for, or (``overlap``) issued only."""
        T.barrier_wait(k_full[st], par)
        if overlap:
            issue_gemm(Q_s, K_s[st, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
        else:
            T.gemm(Q_s, K_s[st, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)

    @T.macro
    def scores_and_p(st, par, Q_s, K_s, V0_s, P_s, a_s, ok_s, acc_s, acc_o, m_i, m_prev, alpha, row_sum, l_i,
                     scale_log2, k_full, k_empty, v_full, v_empty, p_full, p_empty, has_next, next_par):
        """Group 0's tile of stage ``st``: scores, softmax, P and its factor published, ``O[:, :256] += P V0``;
        with ``overlap`` the scores were issued before (the last tile's ``P V0`` done), and the next tile's (stage
        ``1 - st``, fill parity ``next_par``, where ``has_next``) are issued beside this ``P V0``."""
        if overlap:
            T.wait_wgmma(0)
        else:
            scores(st, par, Q_s, K_s, acc_s, k_full)
        for r, j in T.Parallel(BH, BN):
            acc_s[r, j] = T.if_then_else(ok_s[st, j] != 0, acc_s[r, j], NEG_INF)
        T.barrier_arrive(k_empty[st])  # the stage's rows and flags are read
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for r in T.Parallel(BH):
            alpha[r] = T.if_then_else(m_i[r] == NEG_INF, 1.0, T.exp2((m_prev[r] - m_i[r]) * scale_log2))
        for r, j in T.Parallel(BH, BN):
            acc_s[r, j] = T.if_then_else(m_i[r] == NEG_INF, 0.0, T.exp2(acc_s[r, j] * scale_log2 - m_i[r] * scale_log2))
        T.reduce_sum(acc_s, row_sum, dim=1)
        for r in T.Parallel(BH):
            l_i[r] = l_i[r] * alpha[r] + row_sum[r]
        T.barrier_wait(p_empty[0], st ^ 1)  # group 1 is done with the last P and factor
        T.copy(acc_s, P_s)
        for r in T.Parallel(BH):
            a_s[r] = alpha[r]
        publish()
        T.barrier_arrive(p_full[0])
        for r, d in T.Parallel(BH, HD):
            acc_o[r, d] *= alpha[r]
        T.barrier_wait(p_full[0], st)  # every thread of this group has stored its part of P
        T.barrier_wait(v_full[0], st)
        if overlap:
            issue_gemm(P_s, V0_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
            if has_next:
                scores(1 - st, next_par, Q_s, K_s, acc_s, k_full)
                T.wait_wgmma(1)  # this P V0 (issued first) is done; the next scores run on
            else:
                T.wait_wgmma(0)
        else:
            T.gemm(P_s, V0_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
        T.barrier_arrive(v_empty[0])

    @T.macro
    def right_half(st, P_s, V1_s, a_s, acc_o, v_full, v_empty, p_full, p_empty):
        """Group 1's tile of stage ``st``: ``O[:, 256:] = O * factor + P V1``."""
        T.barrier_wait(p_full[0], st)
        for r, d in T.Parallel(BH, HD):
            acc_o[r, d] *= a_s[r]
        T.barrier_wait(v_full[0], st)
        T.gemm(P_s, V1_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
        T.barrier_arrive(v_empty[0])
        T.barrier_arrive(p_empty[0])

    @T.prim_func
    def sparse_mqa_staged_ws(Q: A.Q, W: A.W, I: A.I, Ln: A.Ln, sinks: A.sinks, sm_scale: T.float32,
                             empty_lse: T.float32, O: A.O, LSE: A.LSE, MaxL: A.MaxL):
        with T.Kernel(A.NT, head_blocks, threads=THREADS) as (t, bh):  # tokens on x: up to 2^31 - 1 blocks
            Q_s = T.alloc_shared([BH, L.D], q_dtype)
            K_s = T.alloc_shared([2, BN, L.D], q_dtype)
            V0_s = T.alloc_shared([BN, HD], q_dtype)
            V1_s = T.alloc_shared([BN, HD], q_dtype)
            P_s = T.alloc_shared([BH, BN], q_dtype)
            ok_s = T.alloc_shared([2, BN], "int32", scope="shared")
            a_s = T.alloc_shared([BH], ACC, scope="shared")  # group 0's rescale factor of the last P
            f_s = T.alloc_shared([BH], ACC, scope="shared")  # the rows' final scale (the epilogue's)
            k_full = T.alloc_barrier([GROUP, GROUP])
            k_empty = T.alloc_barrier([GROUP, GROUP])
            v_full = T.alloc_barrier([GROUP])
            v_empty = T.alloc_barrier([2 * GROUP])
            p_full = T.alloc_barrier([GROUP])
            p_empty = T.alloc_barrier([GROUP])
            done = T.alloc_barrier([GROUP])
            tx = T.get_thread_binding()
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E
            length = T.max(T.min(Ln[t], K), 0)
            n_tiles = T.ceildiv(length, BN)
            pairs = T.ceildiv(n_tiles, 2)

            for h, d in T.Parallel(BH, L.D):
                Q_s[h, d] = T.if_then_else(h0 + h < H, Q[t, T.min(h0 + h, H - 1), d], T.Cast(q_dtype, 0))
            publish()
            T.sync_threads()

            if tx < GROUP:
                if regs:
                    T.set_max_nreg(REGS[0], 1)
                acc_s = T.alloc_fragment([BH, BN], ACC)
                acc_o = T.alloc_fragment([BH, HD], ACC)
                m_i = T.alloc_fragment([BH], ACC)
                m_prev = T.alloc_fragment([BH], ACC)
                alpha = T.alloc_fragment([BH], ACC)
                row_sum = T.alloc_fragment([BH], ACC)
                l_i = T.alloc_fragment([BH], ACC)
                T.fill(acc_o, 0)
                T.fill(l_i, 0)
                T.fill(m_i, NEG_INF)
                if overlap:
                    if n_tiles > 0:
                        scores(0, 0, Q_s, K_s, acc_s, k_full)
                for ip in T.serial(pairs):
                    # each stage's code apart, its barriers and tiles named by constants
                    scores_and_p(0, ip & 1, Q_s, K_s, V0_s, P_s, a_s, ok_s, acc_s, acc_o, m_i, m_prev, alpha,
                                 row_sum, l_i, scale_log2, k_full, k_empty, v_full, v_empty, p_full, p_empty,
                                 ip * 2 + 1 < n_tiles, ip & 1)
                    if ip * 2 + 1 < n_tiles:
                        scores_and_p(1, ip & 1, Q_s, K_s, V0_s, P_s, a_s, ok_s, acc_s, acc_o, m_i, m_prev, alpha,
                                     row_sum, l_i, scale_log2, k_full, k_empty, v_full, v_empty, p_full, p_empty,
                                     ip * 2 + 2 < n_tiles, (ip + 1) & 1)
                for r in T.Parallel(BH):
                    if has_sink:
                        row_sum[r] = T.if_then_else(
                            m_i[r] == NEG_INF, 0.0, T.exp2(sinks[T.min(h0 + r, H - 1)] * LOG2E - m_i[r] * scale_log2))
                    else:
                        row_sum[r] = 0.0
                    alpha[r] = T.if_then_else(l_i[r] == 0.0, 0.0, 1.0 / (l_i[r] + row_sum[r]))
                    f_s[r] = alpha[r]
                T.barrier_arrive(done[0])
                for r, d in T.Parallel(BH, HD):
                    if h0 + r < H:
                        O[t, h0 + r, d] = T.Cast(q_dtype, acc_o[r, d] * alpha[r])
                for r in T.Parallel(BH):
                    if h0 + r < H:
                        LSE[t, h0 + r] = T.if_then_else(l_i[r] == 0.0, empty_lse,
                                                        (T.log2(l_i[r]) + m_i[r] * scale_log2) / LOG2E)
                        MaxL[t, h0 + r] = T.if_then_else(l_i[r] == 0.0, NEG_INF, m_i[r] * scale_log2 / LOG2E)
            elif tx < 2 * GROUP:
                if regs:
                    T.set_max_nreg(REGS[1], 1)
                acc_o1 = T.alloc_fragment([BH, HD], ACC)
                T.fill(acc_o1, 0)
                for ip in T.serial(pairs):
                    right_half(0, P_s, V1_s, a_s, acc_o1, v_full, v_empty, p_full, p_empty)
                    if ip * 2 + 1 < n_tiles:
                        right_half(1, P_s, V1_s, a_s, acc_o1, v_full, v_empty, p_full, p_empty)
                T.barrier_wait(done[0], 0)
                for r, d in T.Parallel(BH, HD):
                    if h0 + r < H:
                        O[t, h0 + r, HD + d] = T.Cast(q_dtype, acc_o1[r, d] * f_s[r])
            else:
                if regs:
                    T.set_max_nreg(REGS[2], 0)
                p = tx - 2 * GROUP
                buf = T.alloc_local([ROWS * UNITS * 8], q_dtype)
                idx = T.alloc_local([ROWS], "int32")
                ok = T.alloc_local([ROWS], "int32")
                for ip in T.serial(pairs):
                    produce(0, ip * 2, ip & 1, K_s, V0_s, V1_s, ok_s, buf, idx, ok, W, I, t, length, p % 32,
                            p // 32, k_full, k_empty, v_full, v_empty)
                    if ip * 2 + 1 < n_tiles:
                        produce(1, ip * 2 + 1, ip & 1, K_s, V0_s, V1_s, ok_s, buf, idx, ok, W, I, t, length,
                                p % 32, p // 32, k_full, k_empty, v_full, v_empty)

    return sparse_mqa_staged_ws
