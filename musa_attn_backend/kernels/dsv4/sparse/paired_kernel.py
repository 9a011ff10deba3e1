"""TileLang sparse MQA over DeepSeek-V4's FP8 caches for Hopper-class GPUs, for batches of many query tokens
(prefill, large decode batches): one block a token and 64 query heads, its two math warp groups taking the key
tiles in pairs, one tile each. Same math and conventions as :mod:`.mqa_kernel`; the work is divided as
FlashMLA's SM90 sparse prefill divides it (over bf16 rows there; FP8 rows dequantised in the block here).

384 threads, three warp groups:

- Warp group 2, the producer (:mod:`.rows`): the token's query rows once, then the key tiles, tile ``2i``
  into stage 0 and tile ``2i + 1`` into stage 1, each stage in two halves (columns 0-255 and 256-511) with a
  ``full`` and an ``empty`` barrier each, so that the half a consumer is done with first is refilled first:
  stage 0's left half, stage 1's right half, stage 0's right half, stage 1's left half. Tiles past the token's
  last (an odd count's pair) are invalid entries: zeros, not read.
- Warp groups 0 and 1, the consumers (``w`` = 0, 1), for each pair of tiles: group ``w`` computes the scores of
  tile ``2i + w`` over all 512 dims (``S = Q K^T`` from shared memory, both halves), masks the invalid entries,
  and the two groups exchange their rows' maxima (shared memory, one named barrier) so that both run the online
  softmax with the same running maximum; group ``w`` writes its P in bf16 to shared memory for the other group,
  rescales its half of the output (group 0 owns columns 0-255, group 1 columns 256-511) and adds its own tile's
  ``P V`` with P in registers, then, once the other group's P is in shared memory, the other tile's ``P V`` for
  its columns. Both groups' tensor-core work interleaves: while one runs its softmax, the other's GEMMs run.

Stage halves and who releases them: stage 0 left (``Q K^T`` and ``P V`` of group 0: 128 arrivals), stage 0 right
(group 0's ``Q K^T``, group 1's ``P V``: 256), stage 1 right (group 1 alone: 128), stage 1 left (group 1's
``Q K^T``, group 0's ``P V``: 256). Named barriers: ``MAX_READY`` (both groups' maxima written), ``P_READY[w]`` and
``P_FREE[w]`` (group ``w``'s P written / read by the other group, so that the next pair's may overwrite it),
``EPILOGUE`` (the row sums). The maxima are double-buffered by pair parity.

The output (``O``, the sink in the denominator) and the LSE (natural log; ``empty_lse`` where no entry is valid)
are written by the block; nothing is split, so there is no combine.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E, alloc_softmax_state
from .. import layout as L
from .args import sparse_sizes, word_sets
from .rows import BH, BN, HD, LOADS, PRODUCER, ROWS, fp8_row_macros

CONSUMER_THREADS = 256
# a 384-thread block is given 168 registers a thread at launch, 3 x 168 in all: setmaxnreg moves them between
# the groups and an increase waits for the pool (2 x 208 + 96 hung on the H100; kernels/_tir.py checks the sum).
# The fastest split of scripts/tune_paired_regs.py's run (docs/dsv4.md): ptxas serialises the WGMMAs below 208 a
# math thread, but a producer of 88 registers spills in its inner loop, which costs more.
MATH_REGS, PRODUCER_REGS = 200, 104
# rows of FP8 bytes the producer holds at once: 2 (both its rows' loads in flight, then each half stored as soon as
# its consumers free it) or 1 (one row at a time, after both halves are free: 36 words of bytes instead of 72)
PRODUCER_ROWS_AT_ONCE = 2
# named barriers (0 is __syncthreads)
MAX_READY, EPILOGUE = 4, 5
P_READY = (6, 7)
P_FREE = (8, 9)
OUT_READY = (10, 11)  # group w's output columns staged in shared memory (consumer_macro's smem_out)
LEFT_ARRIVALS = (128, 256)  # stage 0 left: group 0 alone; stage 1 left: both groups
RIGHT_ARRIVALS = (256, 128)  # stage 0 right: both; stage 1 right: group 1 alone


def half(h, left, right):
    """The left (``h`` 0: columns 0-255) or right buffer of a pair; group ``w``'s output columns are half
    ``w``."""
    return left if h == 0 else right


def consumer_macro(H: int, has_sink: bool, q_dtype: str, max_logits: bool = False, smem_out: bool = False):
    """The math groups' macro (``consumer(w, ...)``, ``w`` a Python int): a group's loop over the token's pairs and its
    half of the epilogue, for ``H`` query heads; shared by the programs over FP8 rows (here) and over a bf16
    workspace (:mod:`.paired_ws_kernel`), whose producers fill the same stage halves under the same barriers.
    ``max_logits``: group 0 also writes each row's largest scaled score into ``MaxL`` (``-inf`` where no entry is
    valid; FlashMLA's prefill returns it); otherwise ``MaxL`` is not touched. ``smem_out``: each group stages its bf16
    output columns in its half of the query's shared memory (free once both groups' GEMMs are done) and stores them
    from there in 16-byte pieces (a fragment's own stores write 4 bytes a thread, half of each 32-byte sector).
    Returns ``(consumer, epilogue,
    math_groups)``: the epilogue alone serves :mod:`.paired_ws_kernel`'s pipelined groups; ``math_groups`` is both
    groups' code."""
    NEG_INF = -T.infinity(ACC)

    @T.macro
    def epilogue(w, regs, l_s, sinks, O, LSE, MaxL, t, h0, scale_log2, empty_lse, Ql_s, Qr_s):
        """Group ``w``'s end (both groups with one running maximum): the row sums of both groups, the sink, this
        group's columns; the LSE (and ``MaxL`` with ``max_logits``) from group 0."""
        acc_o, m_i, alpha, row_sum, l_i = regs
        for r in T.Parallel(BH):
            l_s[w, r] = l_i[r]
        T.sync_threads(EPILOGUE, CONSUMER_THREADS)
        for r in T.Parallel(BH):
            l_i[r] = l_i[r] + l_s[1 - w, r]
            if has_sink:
                row_sum[r] = T.if_then_else(m_i[r] == NEG_INF, 0.0,
                                            T.exp2(sinks[T.min(h0 + r, H - 1)] * LOG2E - m_i[r] * scale_log2))
            else:
                row_sum[r] = 0.0
            alpha[r] = T.if_then_else(l_i[r] == 0.0, 0.0, 1.0 / (l_i[r] + row_sum[r]))
        if smem_out:
            for r, d in T.Parallel(BH, HD):
                half(w, Ql_s, Qr_s)[r, d] = T.Cast(q_dtype, acc_o[r, d] * alpha[r])
            T.sync_threads(OUT_READY[w], CONSUMER_THREADS // 2)
            for r, d in T.Parallel(BH, HD):
                if h0 + r < H:
                    O[t, h0 + r, w * HD + d] = half(w, Ql_s, Qr_s)[r, d]
        else:
            for r, d in T.Parallel(BH, HD):
                if h0 + r < H:
                    O[t, h0 + r, w * HD + d] = T.Cast(q_dtype, acc_o[r, d] * alpha[r])
        if w == 0:
            for r in T.Parallel(BH):
                if h0 + r < H:
                    LSE[t, h0 + r] = T.if_then_else(l_i[r] == 0.0, empty_lse,
                                                    (T.log2(l_i[r]) + m_i[r] * scale_log2) / LOG2E)
            if max_logits:
                for r in T.Parallel(BH):
                    if h0 + r < H:
                        MaxL[t, h0 + r] = T.if_then_else(l_i[r] == 0.0, NEG_INF, m_i[r] * scale_log2 / LOG2E)


    @T.macro
    def consumer(w, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r, empty_l, empty_r,
                 q_full, t, h0, pairs, scale_log2, empty_lse, MaxL):
        """Group ``w``'s loop over the token's pairs and its half of the epilogue (``w`` a Python int)."""
        other = 1 - w
        state = alloc_softmax_state(BH, BN, HD, q_dtype, with_m_tile=False)
        acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i = state.registers()
        T.fill(acc_o, 0)
        T.fill(l_i, 0)
        T.fill(m_i, NEG_INF)
        T.mbarrier_wait_parity(q_full, 0)
        # half(w, ...): the column half this group's output owns (its tile's first Q K^T half, its P V's operand);
        # half(1 - w, ...): the other (picked inline: a buffer bound to a new name in a macro takes that name in the
        # generated code)
        for i in T.serial(pairs):
            par = i & 1
            # the scores of this group's tile (stage w): the half filled first, then the other
            T.mbarrier_wait_parity(half(w, full_l, full_r)[w], par)
            T.wgmma_gemm(half(w, Ql_s, Qr_s), half(w, Kl_s, Kr_s)[w, :, :], acc_s, transpose_B=True,
                         policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            T.mbarrier_wait_parity(half(1 - w, full_l, full_r)[w], par)
            T.wgmma_gemm(half(1 - w, Ql_s, Qr_s), half(1 - w, Kl_s, Kr_s)[w, :, :], acc_s, transpose_B=True,
                         policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            T.mbarrier_arrive(half(1 - w, empty_l, empty_r)[w])  # the other group's P V still reads it
            for r, jj in T.Parallel(BH, BN):
                acc_s[r, jj] = T.if_then_else(ok_s[w, jj] != 0, acc_s[r, jj], NEG_INF)
            # the running maximum over both tiles of the pair
            T.copy(m_i, m_prev)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)
            for r in T.Parallel(BH):
                m_s[par, w, r] = m_i[r]
            T.sync_threads(MAX_READY, CONSUMER_THREADS)
            for r in T.Parallel(BH):
                m_i[r] = T.max(m_i[r], m_s[par, other, r])
                alpha[r] = T.if_then_else(m_i[r] == NEG_INF, 1.0, T.exp2((m_prev[r] - m_i[r]) * scale_log2))
            for r, jj in T.Parallel(BH, BN):
                acc_s[r, jj] = T.if_then_else(m_i[r] == NEG_INF, 0.0,
                                              T.exp2(acc_s[r, jj] * scale_log2 - m_i[r] * scale_log2))
            T.reduce_sum(acc_s, row_sum, dim=1)
            for r in T.Parallel(BH):
                l_i[r] = l_i[r] * alpha[r] + row_sum[r]
            T.copy(acc_s, acc_p)
            for r, d in T.Parallel(BH, HD):
                acc_o[r, d] *= alpha[r]
            if i > 0:
                T.sync_threads(P_FREE[w], CONSUMER_THREADS)  # the other group is done with the last pair's P
            T.copy(acc_p, P_s[w, :, :])
            T.fence_proxy_async()  # P_s is read by the other group's WGMMA (async proxy)
            T.named_barrier_arrive(P_READY[w], CONSUMER_THREADS)
            # this group's tile: P from registers, V = the stage's rows, this group's columns
            T.wgmma_gemm(acc_p, half(w, Kl_s, Kr_s)[w, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            T.mbarrier_arrive(half(w, empty_l, empty_r)[w])
            # the other group's tile: its P from shared memory
            T.sync_threads(P_READY[other], CONSUMER_THREADS)
            T.wgmma_gemm(P_s[other, :, :], half(w, Kl_s, Kr_s)[other, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            T.mbarrier_arrive(half(w, empty_l, empty_r)[other])
            T.named_barrier_arrive(P_FREE[other], CONSUMER_THREADS)
        T.sync_threads(P_FREE[w], CONSUMER_THREADS)  # pairs the other group's arrival after the last pair
        epilogue(w, (acc_o, m_i, alpha, row_sum, l_i), l_s, sinks, O, LSE, MaxL, t, h0, scale_log2, empty_lse, Ql_s,
                 Qr_s)

    @T.macro
    def math_groups(regs, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r, empty_l,
                    empty_r, q_full, t, h0, pairs, scale_log2, empty_lse, MaxL):
        """Warp groups 0 and 1, each at ``regs`` registers a thread, running :func:`consumer`."""
        with T.ws(0):
            T.set_max_nreg(regs, 1)
            consumer(0, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r, empty_l,
                     empty_r, q_full, t, h0, pairs, scale_log2, empty_lse, MaxL)

        with T.ws(1):
            T.set_max_nreg(regs, 1)
            consumer(1, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r, empty_l,
                     empty_r, q_full, t, h0, pairs, scale_log2, empty_lse, MaxL)

    return consumer, epilogue, math_groups


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_paired(H: int, has_extra: bool, has_sink: bool, q_dtype: str = "bfloat16",
                            rows_at_once: int = 2):
    """The paired sparse MQA program for ``H`` query heads (blocks of 64, rows past ``H`` padded inside). A token
    with no valid entry gets the LSE ``empty_lse`` (a run-time argument: ``-inf``, or FlashMLA's ``+inf``).
    ``rows_at_once``: the rows of FP8 bytes the producer holds (:data:`PRODUCER_ROWS_AT_ONCE`)."""
    assert rows_at_once in (1, 2), rows_at_once
    assert q_dtype == "bfloat16", "the FP8 bytes become bf16 by bit moves"
    D = L.D
    sizes = sparse_sizes()
    NT, K1, K2 = sizes.NT, sizes.K1, sizes.K2
    main, extra = word_sets(sizes)
    head_blocks = (H + BH - 1) // BH
    seq = rows_at_once == 1
    macros = fp8_row_macros(H, has_extra, q_dtype, K1, K2, 1 if seq else ROWS)
    load_q, entry, load_rows, store_half, load_one = (macros.load_q, macros.entry, macros.load_rows, macros.store_half,
                                                      macros.load_one)

    _, _, math_groups = consumer_macro(H, has_sink, q_dtype)

    @T.macro
    def store_stage(st, par, Kl_s, Kr_s, ok_s, raw, sw, idx, ok, q, base_row, outw, fac, main, CW, CS, rows1,
                    stride1, slots1, XW, XS, rows2, stride2, slots2, full_l, full_r, empty_l, empty_r):
        """The producer's rows of a tile into stage ``st`` (a Python int). Both rows' bytes held (loaded before the
        call): the half its group frees first, first (stage 0's left half: group 0 alone reads it; stage 1's right
        half: group 1 alone), each half announced once stored. One row at a time (``seq``): both halves waited
        for, each row loaded and stored whole, then both announced."""
        if seq:
            T.mbarrier_wait_parity(half(st, empty_l, empty_r)[st], par ^ 1)
            T.mbarrier_wait_parity(half(1 - st, empty_l, empty_r)[st], par ^ 1)
            for r in T.unroll(ROWS):
                load_one(raw, sw, 0, r, idx, ok, q, main, CW, CS, rows1, stride1, slots1, XW, XS, rows2, stride2,
                         slots2)
                store_half(half(st, Kl_s, Kr_s), st, base_row + r * 32, raw, sw, 0, q, outw, fac, st)
                store_half(half(1 - st, Kl_s, Kr_s), st, base_row + r * 32, raw, sw, 0, q, outw, fac, 1 - st)
                if q == 0:
                    ok_s[st, base_row + r * 32] = ok[r]
            T.fence_proxy_async()
            T.mbarrier_arrive(half(st, full_l, full_r)[st])
            T.mbarrier_arrive(half(1 - st, full_l, full_r)[st])
        else:
            T.mbarrier_wait_parity(half(st, empty_l, empty_r)[st], par ^ 1)
            for r in T.unroll(ROWS):
                store_half(half(st, Kl_s, Kr_s), st, base_row + r * 32, raw, sw, r, q, outw, fac, st)
                if q == 0:
                    ok_s[st, base_row + r * 32] = ok[r]
            T.fence_proxy_async()  # generic-proxy stores, read by the WGMMAs (async proxy)
            T.mbarrier_arrive(half(st, full_l, full_r)[st])
            T.mbarrier_wait_parity(half(1 - st, empty_l, empty_r)[st], par ^ 1)
            for r in T.unroll(ROWS):
                store_half(half(1 - st, Kl_s, Kr_s), st, base_row + r * 32, raw, sw, r, q, outw, fac, 1 - st)
            T.fence_proxy_async()
            T.mbarrier_arrive(half(1 - st, full_l, full_r)[st])

    @T.prim_func
    def sparse_mqa_paired(
        Q: T.Tensor((NT, H, D), q_dtype),
        CW: main.words, CS: main.scales, I1: main.indices, L1: main.lengths,
        XW: extra.words, XS: extra.scales, I2: extra.indices, L2: extra.lengths,
        sinks: T.Tensor((H,), "float32"),
        sm_scale: T.float32, empty_lse: T.float32,
        rows1: T.int32, stride1: T.int64, slots1: T.int32,  # each cache's geometry (see _glue._flat_views)
        rows2: T.int32, stride2: T.int64, slots2: T.int32,
        O: T.Tensor((NT, H, D), q_dtype),
        LSE: T.Tensor((NT, H), "float32"),
    ):
        with T.Kernel(NT, head_blocks, threads=CONSUMER_THREADS + PRODUCER) as (t, bh):
            Ql_s = T.alloc_shared([BH, HD], q_dtype)
            Qr_s = T.alloc_shared([BH, HD], q_dtype)
            Kl_s = T.alloc_shared([2, BN, HD], q_dtype)
            Kr_s = T.alloc_shared([2, BN, HD], q_dtype)
            P_s = T.alloc_shared([2, BH, BN], q_dtype)
            ok_s = T.alloc_shared([2, BN], "int32", scope="shared")
            m_s = T.alloc_shared([2, 2, BH], ACC, scope="shared")
            l_s = T.alloc_shared([2, BH], ACC, scope="shared")
            full_l = T.alloc_barrier([PRODUCER, PRODUCER])
            full_r = T.alloc_barrier([PRODUCER, PRODUCER])
            empty_l = T.alloc_barrier(list(LEFT_ARRIVALS))
            empty_r = T.alloc_barrier(list(RIGHT_ARRIVALS))
            q_full = T.alloc_barrier(PRODUCER)
            tx = T.get_thread_binding()
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E
            n1 = T.ceildiv(T.max(T.min(L1[t], K1), 0), BN)
            n2 = T.ceildiv(T.max(T.min(L2[t], K2), 0), BN) if has_extra else 0
            pairs = T.max(T.ceildiv(n1 + n2, 2), 1)

            math_groups(MATH_REGS, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r,
                        empty_l, empty_r, q_full, t, h0, pairs, scale_log2, empty_lse, LSE)

            # ---- warp group 2: the producer ----
            with T.ws(2):
                T.set_max_nreg(PRODUCER_REGS, 0)
                p = tx - CONSUMER_THREADS
                q = (p % 32) // 8  # this lane's 16-byte column of each 64-byte step
                base_row = (p // 32) * 8 + p % 8  # this thread's first row; the second is 32 rows on
                raw = T.alloc_local([1 if seq else ROWS, LOADS * 4], "int32")
                sw = T.alloc_local([1 if seq else ROWS, 2], "int32")
                idx = T.alloc_local([ROWS], "int32")
                ok = T.alloc_local([ROWS], "int32")
                outw = T.alloc_local([8], "int32")
                fac = T.alloc_local([2], "uint16")
                for j in T.serial(pairs * 2):
                    st = j % 2  # the stage: tile 2i + w for group w
                    par = (j // 2) & 1
                    for r in T.unroll(ROWS):
                        entry(idx, r, j, n1, base_row + r * 32, t, I1, L1, I2, L2)
                    if not seq:  # both rows' loads in flight before the stage's waits
                        load_rows(raw, sw, idx, ok, q, j < n1, CW, CS, rows1, stride1, slots1, XW, XS, rows2,
                                  stride2, slots2)
                    if j == 0:  # the query rows, their copies' latency beside the first tile's loads
                        load_q(Q, Ql_s, Qr_s, t, h0, p)
                        T.ptx_wait_group(0)
                        T.fence_proxy_async()
                        T.mbarrier_arrive(q_full)
                    main = (j < n1) if seq else False  # which cache the stage's rows come from (loaded here if not seq)
                    if st == 0:
                        store_stage(0, par, Kl_s, Kr_s, ok_s, raw, sw, idx, ok, q, base_row, outw, fac, main, CW,
                                    CS, rows1, stride1, slots1, XW, XS, rows2, stride2, slots2, full_l, full_r,
                                    empty_l, empty_r)
                    else:
                        store_stage(1, par, Kl_s, Kr_s, ok_s, raw, sw, idx, ok, q, base_row, outw, fac, main, CW,
                                    CS, rows1, stride1, slots1, XW, XS, rows2, stride2, slots2, full_l, full_r,
                                    empty_l, empty_r)

    return sparse_mqa_paired
