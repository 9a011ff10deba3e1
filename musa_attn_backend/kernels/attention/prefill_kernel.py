"""TileLang prefill/extend program: one block per (query tile of one request, query head), key tiles from row
gathers or whole-tile copies (conventions: :mod:`.tl_common`)."""

import functools

from ..._tilelang import tl_lang as T
from .tl_common import (ACC, LOG2E, NEG_INF, SLOT_TILES, Tiles, attention_macros, page_row, paged_program,
                        paged_sizes, qk_product, query_tile_macro, slot_buffer, visible)


@functools.lru_cache(maxsize=None)
def build_prefill(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, kv_dtype: str, causal: bool,
                  has_window: bool, has_softcap: bool, has_sinks: bool, is_fp8: bool,
                  k_layout: tuple, v_layout: tuple,
                  block_M: int = 128, block_N: int = 128, num_stages: int = 2, threads: int = 256,
                  tma: bool = False, ragged: bool = False, shared_p: bool = False, d_parts: tuple = ()):
    """Varlen prefill/extend: one block per (query tile of one request, query head).

    ``k_layout``/``v_layout`` = (width, row stride, head stride) of the cache row views.

    Key tiles are loaded in one of two ways:

    * default: row gathers (cp.async, any page size, FP8 too). The cache rows of ``SLOT_TILES``
      tiles are resolved into shared memory before their pipelined run; rows past the sequence are
      zero-filled.
    * ``tma`` (bf16/fp16 cache, no window, ``page_size % block_N == 0``, checked by the launcher): each tile
      is one block copy of ``block_N`` consecutive rows of one page (TMA with a warp-specialised producer on
      Hopper). Rows of the last page past the sequence are read and masked, so they must hold finite values
      (both engines allocate their caches zeroed). With ``ragged``, ``KC`` / ``VC`` are the batch's new K/V
      rows packed like ``Q`` (a batch without cached prefixes): tile ``j`` of request ``b`` is rows
      ``cu_seqlens_q[b] + block_N j ..``, the page table is not read.

    The causal / window / sequence-end mask is the initial value of the QK accumulator, and only tiles that
    cross a boundary compute it; the others start from zero. ``shared_p``: the probabilities go through a
    shared tile to the ``P V`` product (targets whose GEMMs take no register A operand), else they stay in
    registers. ``d_parts``: the head dim cut into two widths (:func:`.tl_common.head_parts`), each part's Q and K
    in tiles of their own and ``Q K^T`` one GEMM a part (targets whose GEMM layouts refuse the whole width).
    """
    G = Hq // Hkv
    BM, BN = block_M, block_N
    sizes = paged_sizes()
    NT, B, _, MP = sizes
    HS_K, HS_V = k_layout[2], v_layout[2]
    D1 = d_parts[0] if d_parts else D  # the first part of the head dim; D - D1 the second (0: not cut)
    assert sum(d_parts or (D,)) == D and len(d_parts) <= 2, d_parts
    assert not tma or (not is_fp8 and not has_window), "TMA tiles: bf16/fp16 caches without a window"
    assert not ragged or tma, "ragged: TMA tiles"
    # Only with a window can a row see no key of a whole tile (otherwise key 0, in the first tile, is
    # visible to every row), so only then does the softmax guard against an all-masked row.
    guard_empty = has_window
    alloc_state, resolve_slots, load_kv, softmax_step, pv_product, finish_rows = attention_macros(
        BM, BN, D, DV, HS_K, HS_V, is_fp8, q_dtype, D1=D1)
    query_tile = query_tile_macro(G, BM, causal)

    def _tile_crosses(n0, qpos0, sk, window):
        """Some (row, key) of the tile of keys from ``n0`` is masked (rows: query positions from ``qpos0``)."""
        c = n0 + BN > sk
        if causal:
            c = T.Or(c, n0 + BN - 1 > qpos0)
        if has_window:
            c = T.Or(c, n0 < qpos0 + BM - 1 - window)
        return c

    def tile_row(page_table, b, n0, page_size, q0):
        return q0 + n0 if ragged else page_row(page_table, b, n0, page_size)

    @T.macro
    def load_tma(KC, VC, tiles, page_table, b, n0, page_size, kvh, q0):
        # whole tiles only: TileLang 0.1.15 lowers a block copy into a slice of a shared tile without TMA
        T.copy(KC[tile_row(page_table, b, n0, page_size, q0):tile_row(page_table, b, n0, page_size, q0) + BN,
                  kvh * HS_K:kvh * HS_K + D1], tiles.K_s)
        if D1 < D:
            T.copy(KC[tile_row(page_table, b, n0, page_size, q0):tile_row(page_table, b, n0, page_size, q0) + BN,
                      kvh * HS_K + D1:kvh * HS_K + D], tiles.K2_s)
        T.copy(VC[tile_row(page_table, b, n0, page_size, q0):tile_row(page_table, b, n0, page_size, q0) + BN,
                  kvh * HS_V:kvh * HS_V + DV], tiles.V_s)

    @T.macro
    def tile_scores(tiles, acc_s, n0, qpos0, sk, window, logit_scale, softcap):
        """acc_s <- masked QK^T of the tile of keys from ``n0`` (rows: query positions from ``qpos0``)."""
        crosses = _tile_crosses(n0, qpos0, sk, window)
        if has_softcap:
            T.clear(acc_s)
            qk_product(tiles, acc_s, T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(BM, BN):
                acc_s[i, j] = T.if_then_else(
                    T.Or(T.Not(crosses), visible(n0 + j, qpos0 + i, sk, window, causal, has_window)),
                    softcap * T.tanh(acc_s[i, j] * (logit_scale / softcap)), NEG_INF)
        else:
            if crosses:  # the mask as the initial value of the product: no pass of its own
                for i, j in T.Parallel(BM, BN):
                    acc_s[i, j] = T.if_then_else(visible(n0 + j, qpos0 + i, sk, window, causal, has_window),
                                                 0, NEG_INF)
            else:
                T.clear(acc_s)
            qk_product(tiles, acc_s, T.GemmWarpPolicy.FullRow)

    @T.macro
    def prefill(Q, KC, VC, cu_seqlens_q, seqlens_k, page_table, sinks, k_scale, v_scale, sm_scale, softcap, window,
                page_size, max_seqlen_q, O, LSE):
        with T.Kernel(T.ceildiv(max_seqlen_q, BM), Hq, B, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([BM, D1], q_dtype)
            K_s = T.alloc_shared([BN, D1], q_dtype)
            V_s = T.alloc_shared([BN, DV], q_dtype)
            K8_s = T.alloc_shared([BN, D1], kv_dtype) if is_fp8 else None
            V8_s = T.alloc_shared([BN, DV], kv_dtype) if is_fp8 else None
            P_s = T.alloc_shared([BM, BN], q_dtype) if shared_p else None
            Q2_s = T.alloc_shared([BM, D - D1], q_dtype) if D1 < D else None
            K2_s = T.alloc_shared([BN, D - D1], q_dtype) if D1 < D else None
            K82_s = T.alloc_shared([BN, D - D1], kv_dtype) if is_fp8 and D1 < D else None
            slot_s = None if tma else slot_buffer(SLOT_TILES * BN)
            state = alloc_state()
            tiles = Tiles(Q_s, K_s, V_s, K8_s, V8_s, P_s, Q2_s, K2_s, K82_s)

            t = query_tile(cu_seqlens_q, seqlens_k, max_seqlen_q, bx, by, bz)
            b, h, kvh, q0, qlen, sk, prefix, m0 = t.b, t.h, t.kvh, t.q0, t.qlen, t.sk, t.prefix, t.m0
            logit_scale = sm_scale * k_scale[kvh] if is_fp8 else sm_scale
            scale_log2 = LOG2E if has_softcap else logit_scale * LOG2E

            kv_hi = T.min(sk, prefix + m0 + BM) if causal else sk
            kv_lo = T.max(prefix + m0 - window, 0) if has_window else 0
            n_lo = kv_lo // BN
            n_iters = T.if_then_else(m0 < qlen, T.max(T.ceildiv(kv_hi, BN) - n_lo, 0), 0)

            for i, d in T.Parallel(BM, D1):
                Q_s[i, d] = T.if_then_else(m0 + i < qlen, Q[q0 + m0 + i, h, d], T.Cast(q_dtype, 0))
            if D1 < D:
                for i, d in T.Parallel(BM, D - D1):
                    Q2_s[i, d] = T.if_then_else(m0 + i < qlen, Q[q0 + m0 + i, h, D1 + d], T.Cast(q_dtype, 0))
            T.fill(state.acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)

            if tma:
                for k in T.Pipelined(n_iters, num_stages=num_stages):
                    load_tma(KC, VC, tiles, page_table, b, (n_lo + k) * BN, page_size, kvh, q0)
                    tile_scores(tiles, state.acc_s, (n_lo + k) * BN, prefix + m0, sk, window, logit_scale, softcap)
                    softmax_step(state, scale_log2, guard_empty, P_s)
                    pv_product(state, tiles, T.GemmWarpPolicy.FullRow)
            else:
                for c in T.serial(T.ceildiv(n_iters, SLOT_TILES)):
                    resolve_slots(slot_s, (n_lo + c * SLOT_TILES) * BN, page_table, b, sk, page_size, MP)
                    for it in T.Pipelined(T.min(SLOT_TILES, n_iters - c * SLOT_TILES), num_stages=num_stages):
                        load_kv(KC, VC, tiles, lambda j: slot_s[it * BN + j], kvh)
                        tile_scores(tiles, state.acc_s, (n_lo + c * SLOT_TILES + it) * BN, prefix + m0, sk, window,
                                    logit_scale, softcap)
                        softmax_step(state, scale_log2, guard_empty, P_s)
                        pv_product(state, tiles, T.GemmWarpPolicy.FullRow)

            finish_rows(state, scale_log2, sinks, lambda i: h, has_sinks)
            out_scale = v_scale[kvh] if is_fp8 else 1.0
            acc_o, l_i, alpha = state.acc_o, state.l_i, state.alpha  # alpha: the row LSE
            for i, d in T.Parallel(BM, DV):
                if m0 + i < qlen:
                    O[q0 + m0 + i, h, d] = T.Cast(
                        q_dtype, T.if_then_else(l_i[i] == 0.0, 0.0, acc_o[i, d] * out_scale / l_i[i]))
            for i in T.Parallel(BM):
                if m0 + i < qlen:
                    LSE[q0 + m0 + i, h] = alpha[i] / LOG2E

    return paged_program("prefill", prefill, sizes, Hq, Hkv, D, q_dtype, kv_dtype, k_layout, v_layout,
                         T.Tensor((NT, Hq, DV), q_dtype), T.Tensor((NT, Hq), "float32"))
