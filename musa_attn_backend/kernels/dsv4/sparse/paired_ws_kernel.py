"""TileLang sparse MQA over a bf16 workspace of DeepSeek-V4 key rows, for Hopper-class GPUs and batches of many
query tokens (prefill): the paired division of :mod:`.paired_kernel` (one block a token and 64 query heads, its
two math warp groups taking the key tiles in pairs), with a producer that dequantises nothing.

Why a workspace: in a prefill every key row is read by many query tokens (4,096 tokens of 640 entries each read
about 2.6 million rows, of some 8-20 thousand distinct ones), and the programs over the FP8 cache dequantise a row
each time a token reads it, in a producer whose registers bound the division of the work (docs/dsv4.md, the
paired program). :mod:`.workspace` dequantises each distinct row once into ``W`` and rebases the tokens' index
lists into it (one list a token: the main set's entries, then the extra set's); this program then copies rows as
they are, as FlashMLA's SM90 sparse prefill does over the bf16 rows an engine builds for it.

384 threads, three warp groups:

- Warp group 2, the producer (88 registers a thread): the token's query rows once (``cp.async``; their copies
  complete ``q_full`` themselves with :data:`Q_ASYNC`), then per key
  tile its 64 rows' two 256-column halves into the stage of the tile's parity, in :mod:`.paired_kernel`'s order
  (stage 0 left, stage 1 right, stage 0 right, stage 1 left: the half its group frees first is refilled first).
  By default (:data:`GROUP_COPY`, FlashMLA's division) 16 groups of 8 lanes copy a tile, a group rows ``g, g + 16,
  g + 32, g + 48``, a lane four 16-byte ``cp.async`` copies 128 bytes apart in each half (each copy one multiply-add
  from the entry's row, :data:`ROW_COPY`; under an L2 evict-last policy with a 256-byte prefetch, :data:`COPY_HINT`,
  as FlashMLA's); without it a warp copies a row's half as 32 lanes' copies, rows ``4 i + warp`` for ``i < 16``; an
  invalid entry (past its token's length, negative, at or past ``W``'s rows) is
  zero-filled without a read and flagged in ``ok_s``. Each half's ``full`` barrier completes when every producer
  thread's copies have landed (``cp.async.mbarrier.arrive.noinc``, so the producer never waits for its copies and
  the next half's are issued at once) and every thread has arrived after its flag stores (the flags are ordinary
  stores: the arrive releases them). No proxy fence between the copies and the consumers' WGMMAs, as in FlashMLA's
  SM90 sparse prefill, whose producer completes its barriers the same way.
- Warp groups 0 and 1: :func:`.paired_kernel.consumer_macro`, unchanged; or (``pipelined``, :data:`PIPELINED`)
  FlashMLA's SM90 sparse prefill schedule, which the producer above makes possible (it holds no rows, so it can
  refill each group's own halves before the shared ones without waiting on a consumer): group 0 runs its tile's
  softmax on its own maximum, tells group 1 (``BUNCH0``), starts its own ``P V``; group 1 takes the maximum of
  both, tells group 0 (``BUNCH1``), runs its softmax and its own ``P V`` and writes its P; group 0 rescales its P
  and output by ``2^(m_own - m)``, writes its P (``S0_READY``), waits for group 1's (``S1_READY``), issues the
  other tile's ``P V`` and, while that runs, the next pair's ``Q K^T``. No barrier guards a P against its next
  write: each group writes its next P only after a barrier the other reaches after its read of the last one
  (``tests/dsv4/test_dsv4_paired_ws_protocol.py`` models the order).

The output (``O``, the sink in the denominator; staged in the query's shared memory with :data:`SMEM_EPILOGUE`), the
LSE (natural log; ``empty_lse`` where no entry is valid) and
each row's largest scaled score (``MaxL``, ``-inf`` where none is valid: FlashMLA's sparse prefill returns it) are
written by the block; nothing is split, so there is no combine.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E, alloc_softmax_state
from .. import layout as L
from .paired_kernel import CONSUMER_THREADS, EPILOGUE, LEFT_ARRIVALS, RIGHT_ARRIVALS, consumer_macro  # noqa: F401
from .rows import BH, BN, HD, PRODUCER, copy16_hinted, copy16_row, evict_last_policy, fp8_row_macros, load_i32
from .tl_macros import workspace_args

# ptxas serialises the WGMMAs below 208 registers a math thread (docs/dsv4.md); a producer of copies needs few
MATH_REGS, PRODUCER_REGS = 208, 88
# The build switches below: each measured against the FlashMLA prefill on its own inputs (scripts/ws_variants.py,
# docs/dsv4.md); all six are on by default, faster together and equal bit for bit to the plain build (the
# measurements: docs/dsv4.md); the default build is what the GPU tests and FlashMLA's prefill suite run.
# the consumers: False, the paired program's (one maximum exchange a pair, each group's GEMMs waited for in turn);
# True, FlashMLA's prefill schedule (module docstring)
PIPELINED = True
# the producer's copies: False, TileLang's cp.async (L2::128B, the default cache policy); True, FlashMLA's SM90
# prefill copies: an L2 evict-last policy for the key rows (read by many tokens, beside query and output rows read
# or written once) and a 256-byte L2 prefetch (rows.copy16_hinted; the program is built with rows.LOAD_HINT_HEADER)
COPY_HINT = True
# the output: False, each thread stores its fragment's values (4 bytes a store); True, staged in shared memory and
# stored in 16-byte pieces (paired_kernel.consumer_macro's smem_out)
SMEM_EPILOGUE = True
# the query rows: False, the producer waits for their copies and arrives on ``q_full`` before the first key tile's
# copies; True, their copies complete ``q_full`` themselves (cp.async arrive, noinc) and the key tiles' copies
# start at once, as FlashMLA's prefill overlaps its query's TMA load with its first key tiles
Q_ASYNC = True
# the producer's address arithmetic (with COPY_HINT): False, each copy's source an element of W
# (its index recomputed in 64 bits for every copy, the list read through a clamped 64-bit index); True, each entry's
# row clamped once (0 where invalid, the copy then reads nothing), a copy's source one wide multiply-add from this
# thread's column of row 0 with the half an immediate (rows.copy16_row), the list read from the token's first entry
ROW_COPY = True
# the producer's division of a tile (with ROW_COPY): False, a warp a row's half (32 lanes' 16-byte
# copies, 16 rows a thread, each row's index read by every lane); True, FlashMLA's: 16 groups of 8 lanes, a group 4
# rows (``g``, ``g + 16``, ...), a lane 4 copies of 16 bytes 128 bytes apart in each half of its rows: 4 index reads
# a thread a tile instead of 16, each row's copies at immediate offsets from one address
GROUP_COPY = True
# the grid (not yet measured): False, a block a (token, head block) with the tokens along x, so a token's head blocks
# (65-128 heads: two) are a whole grid row apart in launch order; True, one dimension of (token, head block) pairs, a
# token's head blocks adjacent, so both read its rows while they are in L2 (the same work otherwise; FlashMLA's SM90
# sparse prefill orders its blocks so: head block = block % head blocks, token = block / head blocks)
ADJACENT_HEADS = False
# the switches above by their variant names (scripts/ws_variants.py, the GPU tests, the kernel's key), in the order
# of build_sparse_mqa_paired_ws's arguments
SWITCHES = {"pipelined": "PIPELINED", "hint": "COPY_HINT", "smem_out": "SMEM_EPILOGUE", "qasync": "Q_ASYNC",
            "rowcopy": "ROW_COPY", "groupcopy": "GROUP_COPY", "adjacent": "ADJACENT_HEADS"}
# named barriers of the pipelined consumers (0 is __syncthreads; the epilogue's is the paired program's)
BUNCH0, BUNCH1, S0_READY, S1_READY = 6, 7, 8, 9
WARPS = PRODUCER // 32
ROWS_A_WARP = BN // WARPS  # rows of a tile a producer warp copies (16)
UNITS_A_HALF = HD // 8  # 16-byte units of a row's half (32: one a lane)
GROUP, CHUNK = 8, 64  # GROUP_COPY: lanes a row, and the columns between one lane's copies in a row's half
ROWS_A_GROUP = BN // (PRODUCER // GROUP)  # rows of a tile a group of 8 lanes copies (4)


def pipelined_macros(H: int, has_sink: bool, q_dtype: str):
    """``group``: the pipelined consumers' macro (module docstring; ``group(w, ...)`` for math group ``w``) for ``H``
    query heads (their end: :func:`.paired_kernel.consumer_macro`'s epilogue)."""
    NEG_INF = -T.infinity(ACC)

    @T.macro
    def scores(w, Ql_s, Qr_s, Kl_s, Kr_s, acc_s, full_l, full_r, par):
        """``S = Q K^T`` of group ``w``'s tile (stage ``w``), the half filled first first; issued, not waited for."""
        if w == 0:
            T.mbarrier_wait_parity(full_l[0], par)
            T.wgmma_gemm(Ql_s, Kl_s[0, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                         clear_accum=True)
            T.mbarrier_wait_parity(full_r[0], par)
            T.wgmma_gemm(Qr_s, Kr_s[0, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        else:
            T.mbarrier_wait_parity(full_r[1], par)
            T.wgmma_gemm(Qr_s, Kr_s[1, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                         clear_accum=True)
            T.mbarrier_wait_parity(full_l[1], par)
            T.wgmma_gemm(Ql_s, Kl_s[1, :, :], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def softmax(w, state, ok_s, scale_log2):
        """Mask group ``w``'s scores, exponentiate them against ``m_i`` (already the new maximum), add their row
        sums to ``l_i`` after rescaling it and the output by ``alpha`` (``2^(m_prev - m_i)``), and P in bf16."""
        acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i = state
        for r in T.Parallel(BH):
            alpha[r] = T.if_then_else(m_i[r] == NEG_INF, 1.0, T.exp2((m_prev[r] - m_i[r]) * scale_log2))
        for r, jj in T.Parallel(BH, BN):
            acc_s[r, jj] = T.if_then_else(T.Or(ok_s[w, jj] == 0, m_i[r] == NEG_INF), 0.0,
                                          T.exp2(acc_s[r, jj] * scale_log2 - m_i[r] * scale_log2))
        T.reduce_sum(acc_s, row_sum, dim=1)
        for r in T.Parallel(BH):
            l_i[r] = l_i[r] * alpha[r] + row_sum[r]
        for r, d in T.Parallel(BH, HD):
            acc_o[r, d] *= alpha[r]
        T.copy(acc_s, acc_p)

    @T.macro
    def own_max(w, state, ok_s):
        """``m_prev`` <- ``m_i``; ``m_i`` <- the running maximum with group ``w``'s masked scores."""
        acc_s, _, _, m_i, m_prev, _, _, _ = state
        for r, jj in T.Parallel(BH, BN):
            acc_s[r, jj] = T.if_then_else(ok_s[w, jj] != 0, acc_s[r, jj], NEG_INF)
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)

    @T.macro
    def group(w, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, full_l, full_r, empty_l, empty_r, q_full, pairs,
              scale_log2, state):
        """Math group ``w``'s (a Python int) loop over the token's pairs (module docstring)."""
        acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i = state
        T.mbarrier_wait_parity(q_full, 0)
        for i in T.serial(pairs):
            par = i & 1
            if w == 0:
                if i == 0:  # the first pair's scores inside the loop, as FlashMLA's: its descriptors are not hoisted
                    scores(0, Ql_s, Qr_s, Kl_s, Kr_s, acc_s, full_l, full_r, 0)
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(empty_r[0])  # group 1's P V still reads stage 0's right half
                own_max(0, state, ok_s)
                for r in T.Parallel(BH):
                    m_s[0, r] = m_i[r]
                T.named_barrier_arrive(BUNCH0, CONSUMER_THREADS)
                softmax(0, state, ok_s, scale_log2)
                T.wgmma_gemm(acc_p, Kl_s[0, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)  # own P V, columns 0-255
                T.wait_wgmma(0)
                T.mbarrier_arrive(empty_l[0])
                T.sync_threads(BUNCH1, CONSUMER_THREADS)  # the maximum of both tiles
                for r in T.Parallel(BH):
                    alpha[r] = T.if_then_else(m_s[1, r] == NEG_INF, 1.0, T.exp2((m_i[r] - m_s[1, r]) * scale_log2))
                    m_i[r] = m_s[1, r]
                    l_i[r] = l_i[r] * alpha[r]
                for r, jj in T.Parallel(BH, BN):
                    P_s[0, r, jj] = T.Cast(q_dtype, acc_s[r, jj] * alpha[r])
                T.fence_proxy_async()  # P_s is read by group 1's WGMMA (async proxy)
                T.named_barrier_arrive(S0_READY, CONSUMER_THREADS)
                for r, d in T.Parallel(BH, HD):
                    acc_o[r, d] *= alpha[r]
                T.sync_threads(S1_READY, CONSUMER_THREADS)
                T.wgmma_gemm(P_s[1, :, :], Kl_s[1, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)  # group 1's tile
                if i + 1 < pairs:  # the next pair's scores run beside that P V
                    scores(0, Ql_s, Qr_s, Kl_s, Kr_s, acc_s, full_l, full_r, par ^ 1)
                    T.wait_wgmma(1)
                    T.mbarrier_arrive(empty_l[1])
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(empty_r[0])
                else:
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(empty_l[1])
            else:
                scores(1, Ql_s, Qr_s, Kl_s, Kr_s, acc_s, full_l, full_r, par)
                T.wait_wgmma(0)
                T.mbarrier_arrive(empty_l[1])  # group 0's P V still reads stage 1's left half
                own_max(1, state, ok_s)
                T.sync_threads(BUNCH0, CONSUMER_THREADS)  # group 0's maximum of this pair
                for r in T.Parallel(BH):
                    m_i[r] = T.max(m_i[r], m_s[0, r])
                    m_s[1, r] = m_i[r]
                T.named_barrier_arrive(BUNCH1, CONSUMER_THREADS)
                softmax(1, state, ok_s, scale_log2)
                T.wgmma_gemm(acc_p, Kr_s[1, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)  # own P V, columns 256-511
                T.copy(acc_p, P_s[1, :, :])
                T.sync_threads(S0_READY, CONSUMER_THREADS)
                T.wgmma_gemm(P_s[0, :, :], Kr_s[0, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)  # group 0's tile
                T.fence_proxy_async()  # P_s[1] is read by group 0's WGMMA (async proxy)
                T.named_barrier_arrive(S1_READY, CONSUMER_THREADS)
                T.wait_wgmma(1)
                T.mbarrier_arrive(empty_r[1])
                T.wait_wgmma(0)
                T.mbarrier_arrive(empty_r[0])

    return group


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_paired_ws(H: int, has_sink: bool, q_dtype: str = "bfloat16", pipelined: bool = False,
                               copy_hint: bool = False, smem_epilogue: bool = False, q_async: bool = False,
                               row_copy: bool = False, group_copy: bool = False, adjacent_heads: bool = False):
    """The paired sparse MQA program over a bf16 workspace for ``H`` query heads (blocks of 64, rows past ``H``
    padded inside). A token with no valid entry gets the LSE ``empty_lse`` (a run-time argument: ``-inf``, or
    FlashMLA's ``+inf``). ``pipelined``: FlashMLA's prefill schedule for the math groups (:data:`PIPELINED`);
    ``copy_hint``, ``smem_epilogue``, ``q_async``, ``row_copy``, ``group_copy``: :data:`COPY_HINT`,
    :data:`SMEM_EPILOGUE`, :data:`Q_ASYNC`, :data:`ROW_COPY` (which needs ``copy_hint``), :data:`GROUP_COPY`
    (which needs ``row_copy``); ``adjacent_heads``: :data:`ADJACENT_HEADS`."""
    assert copy_hint or not row_copy, "ROW_COPY is a form of the hinted copies (COPY_HINT)"
    assert row_copy or not group_copy, "GROUP_COPY is a form of ROW_COPY"
    n_rows = ROWS_A_GROUP if group_copy else ROWS_A_WARP  # rows of a tile each producer thread copies
    n_lanes = PRODUCER // GROUP if group_copy else WARPS  # rows between one thread's rows
    n_chunks = HD // CHUNK if group_copy else 1  # a thread's 16-byte pieces of each of its rows' halves
    assert q_dtype == "bfloat16", "the workspace holds bf16 rows"
    D = L.D
    A = workspace_args(H, q_dtype, D)
    NT, K, R = A.NT, A.K, A.R
    head_blocks = (H + BH - 1) // BH
    load_q = fp8_row_macros(H, False, q_dtype, K, 0).load_q
    _, epilogue, math_groups = consumer_macro(H, has_sink, q_dtype, max_logits=True, smem_out=smem_epilogue)
    group = pipelined_macros(H, has_sink, q_dtype)
    NEG_INF = -T.infinity(ACC)

    @T.macro
    def pipelined_group(w, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, MaxL, full_l, full_r,
                        empty_l, empty_r, q_full, t, h0, pairs, scale_log2, empty_lse):
        """Math group ``w`` (a Python int) in the pipelined order, its registers and its end."""
        T.set_max_nreg(MATH_REGS, 1)
        state = alloc_softmax_state(BH, BN, HD, q_dtype, with_m_tile=False).registers()
        acc_o, m_i, alpha, row_sum, l_i = state[2], state[3], state[5], state[6], state[7]
        T.fill(acc_o, 0)
        T.fill(l_i, 0)
        T.fill(m_i, NEG_INF)
        group(w, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, full_l, full_r, empty_l, empty_r, q_full, pairs,
              scale_log2, state)
        epilogue(w, (acc_o, m_i, alpha, row_sum, l_i), l_s, sinks, O, LSE, MaxL, t, h0, scale_log2, empty_lse, Ql_s,
                 Qr_s)

    @T.macro
    def copy_half(K_s, st, col0, W, idx, ok, lane, warp, policy):
        """This thread's copies of the half at column ``col0`` into stage ``st`` of ``K_s``: each of its rows' unit
        ``lane`` (a warp a row), or (``group_copy``) units ``lane``, ``lane + 8``, ... of its group ``warp``'s rows."""
        for i in T.unroll(n_rows):
            if row_copy:  # idx[i] is a valid row (0 where the entry is invalid: nothing read, zeros written)
                for c in T.unroll(n_chunks):
                    copy16_row(K_s[st, i * n_lanes + warp, c * CHUNK + lane * 8], W[0, lane * 8], idx[i], D * 2,
                               (col0 + c * CHUNK) * 2, ok[i], policy[0])
            elif copy_hint:
                copy16_hinted(K_s[st, i * WARPS + warp, lane * 8], W[T.max(idx[i], 0), col0 + lane * 8], ok[i],
                              policy[0])
            else:
                T.ptx_cp_async(T.access_ptr(K_s[st, i * WARPS + warp, lane * 8], "w", 8),
                               T.access_ptr(W[T.max(idx[i], 0), col0 + lane * 8], "r", 8), 8, ok[i] != 0)

    @T.macro
    def fill_half(K_s, st, col0, par, W, idx, ok, lane, warp, ok_s, flags, full, empty, policy):
        """Stage ``st``'s half at column ``col0`` once its consumers are done with it (and the stage's row flags,
        with its first half: ``flags``), completing its ``full`` barrier when the copies land."""
        T.mbarrier_wait_parity(empty[st], par ^ 1)
        copy_half(K_s, st, col0, W, idx, ok, lane, warp, policy)
        if flags:
            if lane == 0:
                for i in T.unroll(n_rows):
                    ok_s[st, i * n_lanes + warp] = ok[i]
        T.cp_async_barrier_noinc(full[st])
        T.mbarrier_arrive(full[st])

    @T.prim_func
    def sparse_mqa_paired_ws(Q: A.Q, W: A.W, I: A.I, Ln: A.Ln, sinks: A.sinks, sm_scale: T.float32,
                             empty_lse: T.float32, O: A.O, LSE: A.LSE, MaxL: A.MaxL):
        with T.Kernel(NT * head_blocks if adjacent_heads else NT, 1 if adjacent_heads else head_blocks,
                      threads=CONSUMER_THREADS + PRODUCER) as (bx, by):
            t = bx // head_blocks if adjacent_heads else bx
            bh = bx % head_blocks if adjacent_heads else by
            Ql_s = T.alloc_shared([BH, HD], q_dtype)
            Qr_s = T.alloc_shared([BH, HD], q_dtype)
            Kl_s = T.alloc_shared([2, BN, HD], q_dtype)
            Kr_s = T.alloc_shared([2, BN, HD], q_dtype)
            P_s = T.alloc_shared([2, BH, BN], q_dtype)
            ok_s = T.alloc_shared([2, BN], "int32", scope="shared")
            # the maxima: the paired groups' by pair parity and group; the pipelined groups' group 0's and both's
            m_s = T.alloc_shared([2, BH] if pipelined else [2, 2, BH], ACC, scope="shared")
            l_s = T.alloc_shared([2, BH], ACC, scope="shared")
            # each producer thread arrives twice on a half's barrier: once its copies land, once after its flags
            full_l = T.alloc_barrier([2 * PRODUCER, 2 * PRODUCER])
            full_r = T.alloc_barrier([2 * PRODUCER, 2 * PRODUCER])
            empty_l = T.alloc_barrier(list(LEFT_ARRIVALS))
            empty_r = T.alloc_barrier(list(RIGHT_ARRIVALS))
            q_full = T.alloc_barrier(PRODUCER)
            tx = T.get_thread_binding()
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E
            length = T.max(T.min(Ln[t], K), 0)
            pairs = T.max(T.ceildiv(T.ceildiv(length, BN), 2), 1)

            if pipelined:
                with T.ws(0):
                    pipelined_group(0, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, MaxL, full_l,
                                    full_r, empty_l, empty_r, q_full, t, h0, pairs, scale_log2, empty_lse)

                with T.ws(1):
                    pipelined_group(1, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, MaxL, full_l,
                                    full_r, empty_l, empty_r, q_full, t, h0, pairs, scale_log2, empty_lse)
            else:
                math_groups(MATH_REGS, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r,
                            empty_l, empty_r, q_full, t, h0, pairs, scale_log2, empty_lse, MaxL)

            # ---- warp group 2: the producer ----
            with T.ws(2):
                T.set_max_nreg(PRODUCER_REGS, 0)
                p = tx - CONSUMER_THREADS
                # this thread's place: lane of a warp and warp, or (group_copy) lane of a group of 8 and group
                lane = p % GROUP if group_copy else p % 32
                warp = p // GROUP if group_copy else p // 32
                idx = T.alloc_local([n_rows], "int32")
                ok = T.alloc_local([n_rows], "int32")
                policy = T.alloc_local([1], "uint64")
                if copy_hint:
                    policy[0] = evict_last_policy()
                load_q(Q, Ql_s, Qr_s, t, h0, p)
                if q_async:
                    T.cp_async_barrier_noinc(q_full)
                else:
                    T.ptx_wait_group(0)
                    T.fence_proxy_async()  # the query rows are read by the WGMMAs (async proxy)
                    T.mbarrier_arrive(q_full)
                for j in T.serial(pairs * 2):
                    par = (j // 2) & 1
                    for i in T.unroll(n_rows):
                        e = j * BN + i * n_lanes + warp
                        if row_copy:  # e < length <= K: in the token's list
                            idx[i] = T.if_then_else(e < length, load_i32(I[t, 0], e), -1)
                            ok[i] = T.if_then_else(T.And(idx[i] >= 0, idx[i] < R), 1, 0)
                            idx[i] = T.if_then_else(ok[i] != 0, idx[i], 0)
                        else:
                            idx[i] = T.if_then_else(e < length, I[t, T.min(e, K - 1)], -1)
                            ok[i] = T.if_then_else(T.And(idx[i] >= 0, idx[i] < R), 1, 0)
                    if j % 2 == 0:  # stage 0: left half first (group 0 alone reads it)
                        fill_half(Kl_s, 0, 0, par, W, idx, ok, lane, warp, ok_s, True, full_l, empty_l, policy)
                        fill_half(Kr_s, 0, HD, par, W, idx, ok, lane, warp, ok_s, False, full_r, empty_r, policy)
                    else:  # stage 1: right half first (group 1 alone reads it)
                        fill_half(Kr_s, 1, HD, par, W, idx, ok, lane, warp, ok_s, True, full_r, empty_r, policy)
                        fill_half(Kl_s, 1, 0, par, W, idx, ok, lane, warp, ok_s, False, full_l, empty_l, policy)

    return sparse_mqa_paired_ws
