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

- Warp group 2, the producer (88 registers a thread): the token's query rows once (``cp.async``), then per key
  tile its 64 rows' two 256-column halves into the stage of the tile's parity, in :mod:`.paired_kernel`'s order
  (stage 0 left, stage 1 right, stage 0 right, stage 1 left: the half its group frees first is refilled first).
  A warp copies a row's half as 32 lanes' 16-byte ``cp.async`` copies (a 512-byte contiguous read), rows ``4 i +
  warp`` for ``i < 16``; an invalid entry (past its token's length, negative, at or past ``W``'s rows) is
  zero-filled without a read and flagged in ``ok_s``. Each half's ``full`` barrier completes when every producer
  thread's copies have landed (``cp.async.mbarrier.arrive.noinc``, so the producer never waits for its copies and
  the next half's are issued at once) and every thread has arrived after its flag stores (the flags are ordinary
  stores: the arrive releases them). No proxy fence between the copies and the consumers' WGMMAs, as in FlashMLA's
  SM90 sparse prefill, whose producer completes its barriers the same way.
- Warp groups 0 and 1: :func:`.paired_kernel.consumer_macro`, unchanged.

The output (``O``, the sink in the denominator) and the LSE (natural log; ``empty_lse`` where no entry is valid)
are written by the block; nothing is split, so there is no combine.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E
from .. import layout as L
from .paired_kernel import CONSUMER_THREADS, LEFT_ARRIVALS, RIGHT_ARRIVALS, consumer_macro
from .rows import BH, BN, HD, PRODUCER, fp8_row_macros

# ptxas serialises the WGMMAs below 208 registers a math thread (docs/dsv4.md); a producer of copies needs few
MATH_REGS, PRODUCER_REGS = 208, 88
WARPS = PRODUCER // 32
ROWS_A_WARP = BN // WARPS  # rows of a tile a producer warp copies (16)
UNITS_A_HALF = HD // 8  # 16-byte units of a row's half (32: one a lane)


@functools.lru_cache(maxsize=None)
def build_sparse_mqa_paired_ws(H: int, has_sink: bool, q_dtype: str = "bfloat16"):
    """The paired sparse MQA program over a bf16 workspace for ``H`` query heads (blocks of 64, rows past ``H``
    padded inside). A token with no valid entry gets the LSE ``empty_lse`` (a run-time argument: ``-inf``, or
    FlashMLA's ``+inf``)."""
    assert q_dtype == "bfloat16", "the workspace holds bf16 rows"
    D = L.D
    NT = T.dynamic("num_tokens")
    K = T.dynamic("ws_topk")
    R = T.dynamic("ws_rows")
    head_blocks = (H + BH - 1) // BH
    load_q = fp8_row_macros(H, False, q_dtype, K, 0).load_q
    consumer = consumer_macro(H, has_sink, q_dtype)

    @T.macro
    def copy_half(K_s, st, col0, W, idx, ok, lane, warp):
        """Each of this thread's rows' unit ``lane`` of the half at column ``col0`` into stage ``st`` of ``K_s``."""
        for i in T.unroll(ROWS_A_WARP):
            T.ptx_cp_async(T.access_ptr(K_s[st, i * WARPS + warp, lane * 8], "w", 8),
                           T.access_ptr(W[T.max(idx[i], 0), col0 + lane * 8], "r", 8), 8, ok[i] != 0)

    @T.macro
    def fill_half(K_s, st, col0, par, W, idx, ok, lane, warp, ok_s, flags, full, empty):
        """Stage ``st``'s half at column ``col0`` once its consumers are done with it (and the stage's row flags,
        with its first half: ``flags``), completing its ``full`` barrier when the copies land."""
        T.mbarrier_wait_parity(empty[st], par ^ 1)
        copy_half(K_s, st, col0, W, idx, ok, lane, warp)
        if flags:
            if lane == 0:
                for i in T.unroll(ROWS_A_WARP):
                    ok_s[st, i * WARPS + warp] = ok[i]
        T.cp_async_barrier_noinc(full[st])
        T.mbarrier_arrive(full[st])

    @T.prim_func
    def sparse_mqa_paired_ws(
        Q: T.Tensor((NT, H, D), q_dtype),
        W: T.Tensor((R, D), "bfloat16"),
        I: T.Tensor((NT, K), "int32"),
        Ln: T.Tensor((NT,), "int32"),
        sinks: T.Tensor((H,), "float32"),
        sm_scale: T.float32, empty_lse: T.float32,
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

            with T.ws(0):
                T.set_max_nreg(MATH_REGS, 1)
                consumer(0, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r, empty_l,
                         empty_r, q_full, t, h0, pairs, scale_log2, empty_lse)

            with T.ws(1):
                T.set_max_nreg(MATH_REGS, 1)
                consumer(1, Ql_s, Qr_s, Kl_s, Kr_s, P_s, ok_s, m_s, l_s, sinks, O, LSE, full_l, full_r, empty_l,
                         empty_r, q_full, t, h0, pairs, scale_log2, empty_lse)

            # ---- warp group 2: the producer ----
            with T.ws(2):
                T.set_max_nreg(PRODUCER_REGS, 0)
                p = tx - CONSUMER_THREADS
                lane = p % 32
                warp = p // 32
                idx = T.alloc_local([ROWS_A_WARP], "int32")
                ok = T.alloc_local([ROWS_A_WARP], "int32")
                load_q(Q, Ql_s, Qr_s, t, h0, p)
                T.ptx_wait_group(0)
                T.fence_proxy_async()  # the query rows are read by the WGMMAs (async proxy)
                T.mbarrier_arrive(q_full)
                for j in T.serial(pairs * 2):
                    par = (j // 2) & 1
                    for i in T.unroll(ROWS_A_WARP):
                        e = j * BN + i * WARPS + warp
                        idx[i] = T.if_then_else(e < length, I[t, T.min(e, K - 1)], -1)
                        ok[i] = T.if_then_else(T.And(idx[i] >= 0, idx[i] < R), 1, 0)
                    if j % 2 == 0:  # stage 0: left half first (group 0 alone reads it)
                        fill_half(Kl_s, 0, 0, par, W, idx, ok, lane, warp, ok_s, True, full_l, empty_l)
                        fill_half(Kr_s, 0, HD, par, W, idx, ok, lane, warp, ok_s, False, full_r, empty_r)
                    else:  # stage 1: right half first (group 1 alone reads it)
                        fill_half(Kr_s, 1, HD, par, W, idx, ok, lane, warp, ok_s, True, full_r, empty_r)
                        fill_half(Kl_s, 1, 0, par, W, idx, ok, lane, warp, ok_s, False, full_l, empty_l)

    return sparse_mqa_paired_ws
