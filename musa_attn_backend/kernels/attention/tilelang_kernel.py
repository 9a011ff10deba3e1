"""TileLang programs for paged attention: prefill/extend, split-KV decode and the split combine.

Conventions shared by the programs:

* A K (or V) cache is seen as token rows: ``[num_slots, width]`` with a compile-time row stride ``RS``
  (elements between consecutive tokens) and head stride ``HS``, where slot = ``page * page_size + offset``.
  SGLang's pools (``RS = H*D``) and vLLM's NHD K|V buffer (``RS = H*2D``, V starting ``D`` elements in)
  both have this form. Constant strides let TileLang prove 16-byte alignment, so the row gather becomes
  ``cp.async`` copies; a position past the sequence maps to slot -1, whose bounds predicate zero-fills the
  row instead of reading it. The page size is a runtime scalar (one kernel serves every page size).
* Softmax runs in base 2: logits are multiplied by ``scale_log2`` (``sm_scale * k_scale * log2(e)``, or
  ``log2(e)`` after a softcap, which works in natural units) and exponentiated with ``exp2``.
* An FP8 cache is gathered into an FP8 staging tile and converted to the query dtype in shared memory; the
  per-head scales fold into the logit scale (K) and the output (V), so the matmuls stay in bf16/fp16.
* Final LSE outputs are natural-log; split-KV partial LSEs stay in log2 units.

No ``from __future__ import annotations`` here: TileLang evaluates the prim_func annotations.
"""

import functools

from ..._tilelang import tl_lang as T

LOG2E = 1.4426950408889634
ACC = "float32"
SLOT_TILES = 8  # tiles whose cache rows are resolved together before each pipelined run


def _rows_tensor(width: int, row_stride: int, dtype: str, name: str):
    return T.StridedTensor((T.dynamic(f"{name}_slots"), width), (row_stride, 1), dtype)


def _visible(kpos, qpos, sk, window, causal: bool, has_window: bool):
    """Key at ``kpos`` is inside the sequence, not in the future (causal) and inside the left window."""
    v = kpos < sk
    if causal:
        v = T.And(v, kpos <= qpos)
    if has_window:
        v = T.And(v, kpos >= qpos - window)
    return v


def _page_row(page_table, b, pos, page_size):
    """Cache row of key ``pos`` of request ``b``."""
    return page_table[b, pos // page_size] * page_size + pos % page_size


def _slot(page_table, b, pos, sk, page_size, max_pages):
    """Cache row of key ``pos`` of request ``b``; -1 (zero-filled by the copy) past the sequence end."""
    page = page_table[b, T.min(T.truncdiv(pos, page_size), max_pages - 1)]
    return T.if_then_else(pos < sk, page * page_size + T.truncmod(pos, page_size), -1)


def _slot_buffer(n: int):
    """Shared buffer for ``n`` resolved cache rows, in static shared memory rather than the dynamic pool that
    holds the tiles: TileLang's barrier insertion then sees that a row copy reads a buffer other than the one
    it writes. In the pool it could not tell them apart and put a block-wide barrier before every 16-byte
    copy (16 per 64-key decode tile)."""
    return T.alloc_shared([n], "int32", scope="shared")


def _attention_macros(BM, BN, D, DV, HS_K, HS_V, is_fp8, slot_tiles=SLOT_TILES):
    """Tile loads and the online-softmax step shared by the prefill and decode programs."""
    NEG_INF = -T.infinity(ACC)

    @T.macro
    def resolve_slots(slot_s, pos0, page_table, b, sk, page_size, max_pages):
        """Cache rows of ``slot_tiles`` tiles from key ``pos0`` on: one page-table read per row, all rows in
        parallel, before the pipelined loop that copies them (which then reads addresses from shared)."""
        for r in T.Parallel(slot_tiles * BN):
            slot_s[r] = _slot(page_table, b, pos0 + r, sk, page_size, max_pages)

    @T.macro
    def load_kv(KC, VC, K_s, V_s, K8_s, V8_s, row, kvh):
        """Gather the K and V rows of a tile: ``row(j)`` is the cache row of its key ``j`` (-1: zero-filled). K
        and V share one copy loop when D == DV (TileLang 0.1.15 mis-counts the cp.async groups of a pipeline
        stage that commits two)."""
        K_dst = K8_s if is_fp8 else K_s
        V_dst = V8_s if is_fp8 else V_s
        if D == DV:
            for j, d in T.Parallel(BN, D):
                K_dst[j, d] = KC[row(j), kvh * HS_K + d]
                V_dst[j, d] = VC[row(j), kvh * HS_V + d]
        else:
            for j, d in T.Parallel(BN, D):
                K_dst[j, d] = KC[row(j), kvh * HS_K + d]
            for j, d in T.Parallel(BN, DV):
                V_dst[j, d] = VC[row(j), kvh * HS_V + d]
        if is_fp8:
            T.copy(K8_s, K_s)
            T.copy(V8_s, V_s)

    @T.macro
    def softmax_step(acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, scale_log2, guard):
        """Online softmax of the masked scores in ``acc_s`` (P to ``acc_p``, ``acc_o`` rescaled). ``guard``:
        a row may have seen only masked keys so far (its running max is -inf)."""
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        if guard:
            for i in T.Parallel(BM):
                alpha[i] = T.if_then_else(m_i[i] == NEG_INF, 1.0, T.exp2((m_prev[i] - m_i[i]) * scale_log2))
            for i, j in T.Parallel(BM, BN):
                acc_s[i, j] = T.if_then_else(m_i[i] == NEG_INF, 0.0,
                                             T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2))
        else:
            for i in T.Parallel(BM):
                alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
            for i, j in T.Parallel(BM, BN):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for i in T.Parallel(BM):
            l_i[i] = l_i[i] * alpha[i] + row_sum[i]
        T.copy(acc_s, acc_p)
        for i, d in T.Parallel(BM, DV):
            acc_o[i, d] *= alpha[i]

    @T.macro
    def finish_rows(m_i, l_i, m_tile, row_sum, alpha, scale_log2, sinks, head_of_row, with_sink):
        """alpha <- row LSE (log2 units, sink included if ``with_sink``); l_i <- the full denominator."""
        for i in T.Parallel(BM):
            m_tile[i] = m_i[i] * scale_log2
            if with_sink:
                row_sum[i] = T.if_then_else(m_i[i] == NEG_INF, 0.0,
                                            T.exp2(sinks[head_of_row(i)] * LOG2E - m_tile[i]))
                alpha[i] = T.if_then_else(m_i[i] == NEG_INF, sinks[head_of_row(i)] * LOG2E,
                                          T.log2(l_i[i] + row_sum[i]) + m_tile[i])
                l_i[i] = l_i[i] + row_sum[i]
            else:
                alpha[i] = T.if_then_else(l_i[i] == 0.0, NEG_INF, T.log2(l_i[i]) + m_tile[i])

    return resolve_slots, load_kv, softmax_step, finish_rows


@functools.lru_cache(maxsize=None)
def build_prefill(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, kv_dtype: str, causal: bool,
                  has_window: bool, has_softcap: bool, has_sinks: bool, is_fp8: bool,
                  k_layout: tuple, v_layout: tuple,
                  block_M: int = 128, block_N: int = 128, num_stages: int = 2, threads: int = 256,
                  tma: bool = False, ragged: bool = False):
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
    cross a boundary compute it; the others start from zero.
    """
    G = Hq // Hkv
    BM, BN = block_M, block_N
    NT = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    B1 = T.dynamic("batch_plus_1")
    MP = T.dynamic("max_pages")
    NEG_INF = -T.infinity(ACC)
    HS_K, HS_V = k_layout[2], v_layout[2]
    assert not tma or (not is_fp8 and not has_window), "TMA tiles: bf16/fp16 caches without a window"
    assert not ragged or tma, "ragged: TMA tiles"
    # Only with a window can a row see no key of a whole tile (otherwise key 0, in the first tile, is
    # visible to every row), so only then does the softmax guard against an all-masked row.
    guard_empty = has_window
    resolve_slots, load_kv, softmax_step, finish_rows = _attention_macros(BM, BN, D, DV, HS_K, HS_V, is_fp8)

    def _tile_crosses(n0, qpos0, sk, window):
        """Some (row, key) of the tile of keys from ``n0`` is masked (rows: query positions from ``qpos0``)."""
        c = n0 + BN > sk
        if causal:
            c = T.Or(c, n0 + BN - 1 > qpos0)
        if has_window:
            c = T.Or(c, n0 < qpos0 + BM - 1 - window)
        return c

    def tile_row(page_table, b, n0, page_size, q0):
        return q0 + n0 if ragged else _page_row(page_table, b, n0, page_size)

    @T.macro
    def load_tma(KC, VC, K_s, V_s, page_table, b, n0, page_size, kvh, q0):
        # whole tiles only: TileLang 0.1.15 lowers a block copy into a slice of a shared tile without TMA
        T.copy(KC[tile_row(page_table, b, n0, page_size, q0):tile_row(page_table, b, n0, page_size, q0) + BN,
                  kvh * HS_K:kvh * HS_K + D], K_s)
        T.copy(VC[tile_row(page_table, b, n0, page_size, q0):tile_row(page_table, b, n0, page_size, q0) + BN,
                  kvh * HS_V:kvh * HS_V + DV], V_s)

    @T.macro
    def tile_scores(Q_s, K_s, acc_s, n0, qpos0, sk, window, logit_scale, softcap):
        """acc_s <- masked QK^T of the tile of keys from ``n0`` (rows: query positions from ``qpos0``)."""
        crosses = _tile_crosses(n0, qpos0, sk, window)
        if has_softcap:
            T.clear(acc_s)
            T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(BM, BN):
                acc_s[i, j] = T.if_then_else(
                    T.Or(T.Not(crosses), _visible(n0 + j, qpos0 + i, sk, window, causal, has_window)),
                    softcap * T.tanh(acc_s[i, j] * (logit_scale / softcap)), NEG_INF)
        else:
            if crosses:  # the mask as the initial value of the product: no pass of its own
                for i, j in T.Parallel(BM, BN):
                    acc_s[i, j] = T.if_then_else(_visible(n0 + j, qpos0 + i, sk, window, causal, has_window),
                                                 0, NEG_INF)
            else:
                T.clear(acc_s)
            T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

    @T.prim_func
    def prefill(
        Q: T.Tensor((NT, Hq, D), q_dtype),
        KC: _rows_tensor(k_layout[0], k_layout[1], kv_dtype, "k"),
        VC: _rows_tensor(v_layout[0], v_layout[1], kv_dtype, "v"),
        cu_seqlens_q: T.Tensor((B1,), "int32"),
        seqlens_k: T.Tensor((B,), "int32"),
        page_table: T.Tensor((B, MP), "int32"),
        sinks: T.Tensor((Hq,), "float32"),
        k_scale: T.Tensor((Hkv,), "float32"),
        v_scale: T.Tensor((Hkv,), "float32"),
        sm_scale: T.float32,
        softcap: T.float32,
        window: T.int32,
        page_size: T.int32,
        max_seqlen_q: T.int32,
        O: T.Tensor((NT, Hq, DV), q_dtype),
        LSE: T.Tensor((NT, Hq), "float32"),
    ):
        with T.Kernel(T.ceildiv(max_seqlen_q, BM), Hq, B, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([BM, D], q_dtype)
            K_s = T.alloc_shared([BN, D], q_dtype)
            V_s = T.alloc_shared([BN, DV], q_dtype)
            K8_s = T.alloc_shared([BN, D], kv_dtype) if is_fp8 else None
            V8_s = T.alloc_shared([BN, DV], kv_dtype) if is_fp8 else None
            slot_s = None if tma else _slot_buffer(SLOT_TILES * BN)
            acc_s = T.alloc_fragment([BM, BN], ACC)
            acc_p = T.alloc_fragment([BM, BN], q_dtype)
            acc_o = T.alloc_fragment([BM, DV], ACC)
            m_i = T.alloc_fragment([BM], ACC)
            m_prev = T.alloc_fragment([BM], ACC)
            m_tile = T.alloc_fragment([BM], ACC)
            alpha = T.alloc_fragment([BM], ACC)
            row_sum = T.alloc_fragment([BM], ACC)
            l_i = T.alloc_fragment([BM], ACC)

            b = bz
            h = by
            kvh = h // G
            q0 = cu_seqlens_q[b]
            qlen = cu_seqlens_q[b + 1] - q0
            sk = seqlens_k[b]
            prefix = sk - qlen
            # causal: the last query tiles see the most keys; they get the lowest block ids so that they are
            # scheduled first and the short tiles fill the tail of the last wave
            m0 = (T.ceildiv(max_seqlen_q, BM) - 1 - bx) * BM if causal else bx * BM
            logit_scale = sm_scale * k_scale[kvh] if is_fp8 else sm_scale
            scale_log2 = LOG2E if has_softcap else logit_scale * LOG2E

            kv_hi = T.min(sk, prefix + m0 + BM) if causal else sk
            kv_lo = T.max(prefix + m0 - window, 0) if has_window else 0
            n_lo = kv_lo // BN
            n_iters = T.if_then_else(m0 < qlen, T.max(T.ceildiv(kv_hi, BN) - n_lo, 0), 0)

            for i, d in T.Parallel(BM, D):
                Q_s[i, d] = T.if_then_else(m0 + i < qlen, Q[q0 + m0 + i, h, d], T.Cast(q_dtype, 0))
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, NEG_INF)

            if tma:
                for k in T.Pipelined(n_iters, num_stages=num_stages):
                    load_tma(KC, VC, K_s, V_s, page_table, b, (n_lo + k) * BN, page_size, kvh, q0)
                    tile_scores(Q_s, K_s, acc_s, (n_lo + k) * BN, prefix + m0, sk, window, logit_scale, softcap)
                    softmax_step(acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, scale_log2, guard_empty)
                    T.gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
            else:
                for c in T.serial(T.ceildiv(n_iters, SLOT_TILES)):
                    resolve_slots(slot_s, (n_lo + c * SLOT_TILES) * BN, page_table, b, sk, page_size, MP)
                    for it in T.Pipelined(T.min(SLOT_TILES, n_iters - c * SLOT_TILES), num_stages=num_stages):
                        load_kv(KC, VC, K_s, V_s, K8_s, V8_s, lambda j: slot_s[it * BN + j], kvh)
                        tile_scores(Q_s, K_s, acc_s, (n_lo + c * SLOT_TILES + it) * BN, prefix + m0, sk, window,
                                    logit_scale, softcap)
                        softmax_step(acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, scale_log2,
                                     guard_empty)
                        T.gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            finish_rows(m_i, l_i, m_tile, row_sum, alpha, scale_log2, sinks, lambda i: h, has_sinks)
            out_scale = v_scale[kvh] if is_fp8 else 1.0
            for i, d in T.Parallel(BM, DV):
                if m0 + i < qlen:
                    O[q0 + m0 + i, h, d] = T.Cast(
                        q_dtype, T.if_then_else(l_i[i] == 0.0, 0.0, acc_o[i, d] * out_scale / l_i[i]))
            for i in T.Parallel(BM):
                if m0 + i < qlen:
                    LSE[q0 + m0 + i, h] = alpha[i] / LOG2E

    return prefill


# Named barriers of the ping-pong prefill (ids 0 = __syncthreads; TileLang's own partial syncs are not used by
# its consumer code, which only touches registers, and shared memory through TMA and WGMMA)
_PP_BAR = (5, 6)
_PRODUCER_BAR = 7  # the gathering producer warp group's own sync (its tile's page-table rows resolved)


@functools.lru_cache(maxsize=None)
def build_prefill_pingpong(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, causal: bool, has_softcap: bool,
                           has_sinks: bool, k_layout: tuple, v_layout: tuple, block_N: int = 128,
                           num_stages: int = 2, gather: bool = False, persistent_ctas: int = 0,
                           tma_rows: int = 0, ragged: bool = False):
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
    Same arguments and results as :func:`build_prefill`; bf16/fp16 cache, no window.
    """
    G = Hq // Hkv
    BM, HM, BN, S = 128, 64, block_N, num_stages
    NT = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    B1 = T.dynamic("batch_plus_1")
    MP = T.dynamic("max_pages")
    NEG_INF = -T.infinity(ACC)
    HS_K, HS_V = k_layout[2], v_layout[2]
    PERSIST = persistent_ctas > 0
    R = tma_rows or BN  # rows per TMA copy
    assert not (gather or PERSIST) or R == BN, "tma_rows: TMA tiles, one block per tile"
    assert BN % R == 0 and R % 8 == 0, f"tma_rows {R} must divide the {BN}-key tile into 8-row multiples"
    assert not (PERSIST and gather), "persistent schedule: TMA tiles only"
    assert not ragged or (R == BN and not gather and not PERSIST), "ragged: whole TMA tiles, one block per tile"
    *_, finish_rows = _attention_macros(HM, BN, D, DV, HS_K, HS_V, False)
    assert not gather or (BN <= 128 and D % 8 == 0 and DV % 8 == 0 and 128 % (D // 8) == 0
                          and 128 % (DV // 8) == 0), "gather producer: one page-table row per thread"
    # registers: 2 x 128 consumer + 128 producer threads in the 64K register file; gathers need addresses
    CONSUMER_REGS, PRODUCER_REGS = (232, 40) if gather or R < BN else (240, 24)
    FULL = 128 if gather else 32  # arrivals completing a full barrier: the threads that copy

    def crosses(n0, qpos0, sk):
        """Some (row, key) of the 64 x BN tile of keys from ``n0`` (rows: query positions from ``qpos0``) is
        masked."""
        c = n0 + BN > sk
        if causal:
            c = T.Or(c, n0 + BN - 1 > qpos0)
        return c

    @T.macro
    def gather_rows(C, X_s, slot_s, st, p, col0, W):
        """Producer thread ``p`` (of 128) issues its 16-byte ``cp.async`` chunks of the tile's rows (explicit
        copies: TileLang's own lowering of a bounds-checked gather loop outside a pipeline is synchronous)."""
        CH = W // 8  # chunks per row
        RP = 128 // CH  # rows per pass of the warp group
        for i in T.serial(BN // RP):
            T.ptx_cp_async(T.access_ptr(X_s[st, i * RP + p // CH, (p % CH) * 8], "w", 8),
                           T.access_ptr(C[slot_s[st, i * RP + p // CH], col0 + (p % CH) * 8], "r", 8), 8)

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
                    acc_s[i, j] = T.if_then_else(_visible(n0 + j, qpos0 + i, sk, 0, causal, False), 0, NEG_INF)

    @T.macro
    def issue_scores(Q_g, K_st, acc_s, cross):
        if has_softcap:
            T.wgmma_gemm(Q_g, K_st, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
        else:
            T.wgmma_gemm(Q_g, K_st, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                         clear_accum=T.Not(cross))

    @T.macro
    def online_softmax(acc_s, m_i, m_prev, alpha, row_sum, l_i, n0, qpos0, sk, cross, logit_scale, softcap,
                       scale_log2):
        """P (in acc_s), the new running max / denominator, and alpha (the factor for O)."""
        if has_softcap:
            for i, j in T.Parallel(HM, BN):
                acc_s[i, j] = T.if_then_else(
                    T.Or(T.Not(cross), _visible(n0 + j, qpos0 + i, sk, 0, causal, False)),
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

    def tile(kc, k):
        """Index of tile ``k`` of this work item among all the tiles this block has streamed (stage and phase
        of its buffers): ``kc`` tiles came before (0 without a persistent schedule)."""
        return k if isinstance(kc, int) and kc == 0 else kc + k

    @T.macro
    def consumer_item(g, acc_s, acc_p, acc_o, m_i, m_prev, m_tile, alpha, row_sum, l_i, Q_s, K_s, V_s, q_full,
                      q_empty, k_full, k_empty, v_full, v_empty, O, LSE, sinks, h, q0, qlen, m0, prefix, sk, n_iters,
                      logit_scale, softcap, kc, qi):
        """One 128-row query tile of one head (this group's 64 rows): ``kc`` tiles and ``qi`` query tiles came
        before it in this block."""
        T.fill(acc_o, 0)
        T.fill(l_i, 0)
        T.fill(m_i, NEG_INF)
        scale_log2 = LOG2E if has_softcap else logit_scale * LOG2E
        qpos0 = prefix + m0 + g * HM  # query position of this group's first row
        my_bar, other_bar = _PP_BAR[g], _PP_BAR[1 - g]
        T.mbarrier_wait_parity(q_full, 0 if q_empty is None else qi & 1)
        if g == 1 and q_empty is None:
            T.named_barrier_arrive(_PP_BAR[0], 2 * 128)  # group 0 issues first
        if n_iters > 0:
            cross0 = crosses(0, qpos0, sk)
            init_scores(acc_s, 0, qpos0, sk, cross0)
            T.sync_threads(my_bar, 2 * 128)
            wait_full(k_full, tile(kc, 0) % S, (tile(kc, 0) // S) & 1)
            issue_scores(Q_s[g, :, :], K_s[tile(kc, 0) % S, :, :], acc_s, cross0)
            T.named_barrier_arrive(other_bar, 2 * 128)
            T.wait_wgmma(0)
            T.mbarrier_arrive(k_empty[tile(kc, 0) % S])
            online_softmax(acc_s, m_i, m_prev, alpha, row_sum, l_i, 0, qpos0, sk, cross0, logit_scale,
                           softcap, scale_log2)
            T.copy(acc_s, acc_p)
            for k in T.serial(1, n_iters):
                n0 = k * BN
                st = tile(kc, k) % S
                sp = tile(kc, k - 1) % S
                cross = crosses(n0, qpos0, sk)
                init_scores(acc_s, n0, qpos0, sk, cross)
                T.sync_threads(my_bar, 2 * 128)
                wait_full(k_full, st, (tile(kc, k) // S) & 1)
                issue_scores(Q_s[g, :, :], K_s[st, :, :], acc_s, cross)
                for i, d in T.Parallel(HM, DV):  # O to the running max P was computed with
                    acc_o[i, d] *= alpha[i]
                wait_full(v_full, sp, (tile(kc, k - 1) // S) & 1)
                T.wgmma_gemm(acc_p, V_s[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.named_barrier_arrive(other_bar, 2 * 128)
                T.wait_wgmma(1)  # S is ready, P V of the previous tile may still run
                T.mbarrier_arrive(k_empty[st])
                online_softmax(acc_s, m_i, m_prev, alpha, row_sum, l_i, n0, qpos0, sk, cross, logit_scale,
                               softcap, scale_log2)
                T.wait_wgmma(0)
                T.mbarrier_arrive(v_empty[sp])
                T.copy(acc_s, acc_p)
            if q_empty is not None:
                T.mbarrier_arrive(q_empty)  # the last Q K^T is done: the producer may load the next Q
            sl = tile(kc, n_iters - 1) % S
            for i, d in T.Parallel(HM, DV):
                acc_o[i, d] *= alpha[i]
            wait_full(v_full, sl, (tile(kc, n_iters - 1) // S) & 1)
            T.wgmma_gemm(acc_p, V_s[sl, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            T.mbarrier_arrive(v_empty[sl])
        if g == 0 and q_empty is None:
            T.sync_threads(_PP_BAR[0], 2 * 128)  # group 1's last turn signal
        finish_rows(m_i, l_i, m_tile, row_sum, alpha, scale_log2, sinks, lambda i: h, has_sinks)
        for i, d in T.Parallel(HM, DV):
            if m0 + g * HM + i < qlen:
                O[q0 + m0 + g * HM + i, h, d] = T.Cast(
                    q_dtype, T.if_then_else(l_i[i] == 0.0, 0.0, acc_o[i, d] / l_i[i]))
        for i in T.Parallel(HM):
            if m0 + g * HM + i < qlen:
                LSE[q0 + m0 + g * HM + i, h] = alpha[i] / LOG2E


    @T.macro
    def tma_tile(C, X_s, st, bars, col0, W, r0, rows):
        """TMA copies of one key or value tile (``W`` columns from ``col0``) into stage ``st`` (arriving on
        ``bars[st]``): one copy of the whole tile from row ``r0``, or one per ``R``-row chunk (from ``rows[c]``)
        and 64-column swizzle block (a contiguous box)."""
        if R == BN:
            T.tma_copy(C[r0:r0 + BN, col0:col0 + W], X_s[st, :, :], barrier=bars[st])
        else:
            for c in T.unroll(BN // R):
                for h in T.unroll(W // 64):
                    T.tma_copy(C[rows[c]:rows[c] + R, col0 + h * 64:col0 + h * 64 + 64],
                               X_s[st, c * R:(c + 1) * R, h * 64:h * 64 + 64], barrier=bars[st])

    @T.macro
    def tma_kv_tiles(KC, VC, K_s, V_s, k_full, k_empty, v_full, v_empty, page_table, b, kvh, page_size, n_iters,
                     kc, sk, rows, row0, pv):
        """Producer warp: TMA copies of each key / value tile into the stage buffers, one per tile (a whole tile
        of one page, or with ``ragged`` from the request's first row ``row0``) or one per ``R``-row chunk of a
        page. Paged: the cache rows of ``32 / (BN / R)`` tiles' chunks are read from the page table at once, one
        per lane into ``pv`` (so the first tiles' copies do not wait for one page-table read each), and each
        tile's are taken from their lanes (``rows``) before its stage is free. Chunks past the sequence: its
        last chunk again (own page; masked)."""
        C = BN // R  # copies (chunks) per tile
        TPW = 32 // C  # tiles per page-table read of the warp
        for k in T.serial(n_iters):
            st = tile(kc, k) % S
            if not ragged:
                if k % TPW == 0:
                    pv[0] = _page_row(page_table, b, T.min((k * C + T.get_thread_binding() % 32) * R,
                                                           (sk - 1) // R * R), page_size)
                for c in T.unroll(C):
                    rows[c] = T.shfl_sync(pv[0], (k % TPW) * C + c)
            r0 = (row0 + k * BN if ragged else rows[0]) if R == BN else None  # a whole tile's first row
            T.mbarrier_wait_parity(k_empty[st], ((tile(kc, k) // S) & 1) ^ 1)
            tma_tile(KC, K_s, st, k_full, kvh * HS_K, D, r0, rows)
            T.mbarrier_arrive(k_full[st])
            T.mbarrier_wait_parity(v_empty[st], ((tile(kc, k) // S) & 1) ^ 1)
            tma_tile(VC, V_s, st, v_full, kvh * HS_V, DV, r0, rows)
            T.mbarrier_arrive(v_full[st])

    def work_item(item, cu_seqlens_q, seqlens_k, max_seqlen_q):
        """Persistent schedule: work item ``item`` -> its request, head and query tile (query tiles outermost,
        longest first when causal, then requests, then heads, so the heads of a KV group run side by side)."""
        nq = T.ceildiv(max_seqlen_q, BM)
        qt = item // (Hq * B)
        b = (item // Hq) % B
        h = item % Hq
        q0 = cu_seqlens_q[b]
        qlen = cu_seqlens_q[b + 1] - q0
        sk = seqlens_k[b]
        m0 = (nq - 1 - qt) * BM if causal else qt * BM
        kv_hi = T.min(sk, sk - qlen + m0 + BM) if causal else sk
        return b, h, q0, qlen, sk, sk - qlen, m0, T.if_then_else(m0 < qlen, T.ceildiv(kv_hi, BN), 0)

    def num_work_items(max_seqlen_q):
        return T.ceildiv(max_seqlen_q, BM) * Hq * B

    @T.macro
    def consumer(g, Q_s, K_s, V_s, q_full, k_full, k_empty, v_full, v_empty, O, LSE, sinks, h, q0, qlen, m0,
                 prefix, sk, n_iters, logit_scale, softcap, q_empty, cu_seqlens_q, seqlens_k, max_seqlen_q, cta):
        # The loop body is straight-line in the WGMMAs (tile 0 peeled off): ptxas then sees which groups are in
        # flight and does not insert waits of its own.
        with T.ws(g):
            T.set_max_nreg(CONSUMER_REGS, 1)
            acc_s = T.alloc_fragment([HM, BN], ACC)
            acc_p = T.alloc_fragment([HM, BN], q_dtype)
            acc_o = T.alloc_fragment([HM, DV], ACC)
            m_i = T.alloc_fragment([HM], ACC)
            m_prev = T.alloc_fragment([HM], ACC)
            m_tile = T.alloc_fragment([HM], ACC)
            alpha = T.alloc_fragment([HM], ACC)
            row_sum = T.alloc_fragment([HM], ACC)
            l_i = T.alloc_fragment([HM], ACC)
            if cta is not None:  # persistent schedule
                kc = T.alloc_var("int32")
                qi = T.alloc_var("int32")
                kc = 0
                qi = 0
                # the two groups' turns run on across work items (both walk the same items): group 0 first,
                # once; group 1's last turn signal is taken after the last item
                if g == 1:
                    T.named_barrier_arrive(_PP_BAR[0], 2 * 128)
                for w in T.serial(T.ceildiv(T.max(num_work_items(max_seqlen_q) - cta, 0), persistent_ctas)):
                    b, h, q0, qlen, sk, prefix, m0, n_iters = work_item(w * persistent_ctas + cta, cu_seqlens_q,
                                                                        seqlens_k, max_seqlen_q)
                    if n_iters > 0:
                        consumer_item(g, acc_s, acc_p, acc_o, m_i, m_prev, m_tile, alpha, row_sum, l_i, Q_s, K_s,
                                      V_s, q_full, q_empty, k_full, k_empty, v_full, v_empty, O, LSE, sinks, h, q0,
                                      qlen, m0, prefix, sk, n_iters, logit_scale, softcap, kc, qi)
                        kc = kc + n_iters
                        qi = qi + 1
                if g == 0:
                    T.sync_threads(_PP_BAR[0], 2 * 128)
            else:
                consumer_item(g, acc_s, acc_p, acc_o, m_i, m_prev, m_tile, alpha, row_sum, l_i, Q_s, K_s, V_s,
                              q_full, None, k_full, k_empty, v_full, v_empty, O, LSE, sinks, h, q0, qlen, m0, prefix,
                              sk, n_iters, logit_scale, softcap, 0, 0)

    @T.prim_func
    def prefill(
        Q: T.Tensor((NT, Hq, D), q_dtype),
        KC: _rows_tensor(k_layout[0], k_layout[1], q_dtype, "k"),
        VC: _rows_tensor(v_layout[0], v_layout[1], q_dtype, "v"),
        cu_seqlens_q: T.Tensor((B1,), "int32"),
        seqlens_k: T.Tensor((B,), "int32"),
        page_table: T.Tensor((B, MP), "int32"),
        sinks: T.Tensor((Hq,), "float32"),
        k_scale: T.Tensor((Hkv,), "float32"),
        v_scale: T.Tensor((Hkv,), "float32"),
        sm_scale: T.float32,
        softcap: T.float32,
        window: T.int32,
        page_size: T.int32,
        max_seqlen_q: T.int32,
        O: T.Tensor((NT, Hq, DV), q_dtype),
        LSE: T.Tensor((NT, Hq), "float32"),
    ):
        if PERSIST:
            # one block per SM walks the work items cta, cta + ctas, ...; the producer runs ahead into the next
            # item (its Q once both consumer groups have issued their last Q K^T) while the consumers finish one
            with T.Kernel(persistent_ctas, threads=384) as cta:
                Q_s = T.alloc_shared([2, HM, D], q_dtype)
                K_s = T.alloc_shared([S, BN, D], q_dtype)
                V_s = T.alloc_shared([S, BN, DV], q_dtype)
                q_full = T.alloc_barrier(32)
                q_empty = T.alloc_barrier(256)
                k_full = T.alloc_barrier([FULL] * S)
                v_full = T.alloc_barrier([FULL] * S)
                k_empty = T.alloc_barrier([256] * S)
                v_empty = T.alloc_barrier([256] * S)
                tx = T.get_thread_binding()
                if tx >= 256:
                    T.set_max_nreg(PRODUCER_REGS, 0)
                if tx >= 256 and tx < 288:
                    kc = T.alloc_var("int32")
                    qi = T.alloc_var("int32")
                    rows = T.alloc_local([1], "int32")
                    pv = T.alloc_local([1], "int32")
                    kc = 0
                    qi = 0
                    for w in T.serial(T.ceildiv(T.max(num_work_items(max_seqlen_q) - cta, 0), persistent_ctas)):
                        b, h, q0, qlen, sk, prefix, m0, n_iters = work_item(w * persistent_ctas + cta, cu_seqlens_q,
                                                                            seqlens_k, max_seqlen_q)
                        kvh = h // G
                        if n_iters > 0:
                            T.mbarrier_wait_parity(q_empty, (qi & 1) ^ 1)
                            T.tma_copy(Q[q0 + m0:q0 + m0 + HM, h, :], Q_s[0, :, :], barrier=q_full)
                            T.tma_copy(Q[q0 + m0 + HM:q0 + m0 + BM, h, :], Q_s[1, :, :], barrier=q_full)
                            T.mbarrier_arrive(q_full)
                            tma_kv_tiles(KC, VC, K_s, V_s, k_full, k_empty, v_full, v_empty, page_table, b, kvh,
                                         page_size, n_iters, kc, sk, rows, None, pv)
                            kc = kc + n_iters
                            qi = qi + 1
                logit_scale = sm_scale
                consumer(0, Q_s, K_s, V_s, q_full, k_full, k_empty, v_full, v_empty, O, LSE, sinks, None, None, None,
                         None, None, None, None, logit_scale, softcap, q_empty, cu_seqlens_q, seqlens_k, max_seqlen_q,
                         cta)
                consumer(1, Q_s, K_s, V_s, q_full, k_full, k_empty, v_full, v_empty, O, LSE, sinks, None, None, None,
                         None, None, None, None, logit_scale, softcap, q_empty, cu_seqlens_q, seqlens_k, max_seqlen_q,
                         cta)
        else:
            with T.Kernel(T.ceildiv(max_seqlen_q, BM), Hq, B, threads=384) as (bx, by, bz):
                Q_s = T.alloc_shared([2, HM, D], q_dtype)
                K_s = T.alloc_shared([S, BN, D], q_dtype)
                V_s = T.alloc_shared([S, BN, DV], q_dtype)
                slot_s = T.alloc_shared([S, BN], "int32") if gather else None
                q_full = T.alloc_barrier(32)
                k_full = T.alloc_barrier([FULL] * S)
                v_full = T.alloc_barrier([FULL] * S)
                k_empty = T.alloc_barrier([256] * S)
                v_empty = T.alloc_barrier([256] * S)
                tx = T.get_thread_binding()

                b = bz
                h = by
                kvh = h // G
                q0 = cu_seqlens_q[b]
                qlen = cu_seqlens_q[b + 1] - q0
                sk = seqlens_k[b]
                prefix = sk - qlen
                m0 = (T.ceildiv(max_seqlen_q, BM) - 1 - bx) * BM if causal else bx * BM
                kv_hi = T.min(sk, prefix + m0 + BM) if causal else sk
                n_iters = T.if_then_else(m0 < qlen, T.ceildiv(kv_hi, BN), 0)

                if tx >= 256:
                    T.set_max_nreg(PRODUCER_REGS, 0)
                if tx >= 256 and tx < 288:
                    if n_iters > 0:
                        T.tma_copy(Q[q0 + m0:q0 + m0 + HM, h, :], Q_s[0, :, :], barrier=q_full)
                        T.tma_copy(Q[q0 + m0 + HM:q0 + m0 + BM, h, :], Q_s[1, :, :], barrier=q_full)
                    T.mbarrier_arrive(q_full)
                    if not gather:
                        rows = None if ragged else T.alloc_local([BN // R], "int32")
                        pv = None if ragged else T.alloc_local([1], "int32")
                        tma_kv_tiles(KC, VC, K_s, V_s, k_full, k_empty, v_full, v_empty, page_table, b, kvh, page_size,
                                     n_iters, 0, sk, rows, q0, pv)
                if gather:
                    if tx >= 256:
                        p = tx - 256
                        for k in T.serial(n_iters):
                            st = k % S
                            T.mbarrier_wait_parity(k_empty[st], ((k // S) & 1) ^ 1)
                            if p < BN:
                                # one row per thread; rows past the sequence read its last key (finite, masked)
                                slot_s[st, p] = _slot(page_table, b, T.min(k * BN + p, sk - 1), sk, page_size, MP)
                            T.sync_threads(_PRODUCER_BAR, 128)
                            gather_rows(KC, K_s, slot_s, st, p, kvh * HS_K, D)
                            T.cp_async_barrier_noinc(k_full[st])
                            T.mbarrier_wait_parity(v_empty[st], ((k // S) & 1) ^ 1)
                            gather_rows(VC, V_s, slot_s, st, p, kvh * HS_V, DV)
                            T.cp_async_barrier_noinc(v_full[st])
                logit_scale = sm_scale
                consumer(0, Q_s, K_s, V_s, q_full, k_full, k_empty, v_full, v_empty, O, LSE, sinks, h, q0, qlen, m0,
                         prefix, sk, n_iters, logit_scale, softcap, None, None, None, None, None)
                consumer(1, Q_s, K_s, V_s, q_full, k_full, k_empty, v_full, v_empty, O, LSE, sinks, h, q0, qlen, m0,
                         prefix, sk, n_iters, logit_scale, softcap, None, None, None, None, None)

    return prefill


@functools.lru_cache(maxsize=None)
def build_decode(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, kv_dtype: str, max_q: int,
                 has_window: bool, has_softcap: bool, has_sinks: bool, is_fp8: bool, split: bool,
                 k_layout: tuple, v_layout: tuple,
                 block_M: int = 64, block_N: int = 64, num_stages: int = 2, threads: int = 128,
                 slot_tiles: int = SLOT_TILES, full_runs: bool = False, pdl: bool = False):
    """Split-KV decode (and short causal queries, up to ``max_q`` tokens per request, e.g. speculative verify).

    One block per (KV split, KV head, request); its rows are the ``max_q x G`` (token, query head) pairs that
    share the KV head, so each K/V tile is read once for the whole group. With ``split`` the block writes a
    partial (output normalised by its own sum, LSE in log2 units) for :func:`build_combine`; without it, the
    final output. ``slot_tiles``: tiles whose cache rows are resolved together; the copy pipeline restarts
    after each such run. 0: the copies resolve each row themselves, in one pipeline over all the tiles.
    ``full_runs``: every run's pipeline has the fixed trip count ``slot_tiles`` (TileLang lowers 3+ stages only
    for a fixed count); tiles past the split's end are fully masked, their rows zero-filled (no memory
    traffic). ``pdl`` (split only): trigger the dependent launch of the combine kernel (programmatic dependent
    launch) as the block starts, so the combine's launch overlaps this kernel's last wave.
    """
    G = Hq // Hkv
    rows = max_q * G
    BM, BN = block_M, block_N
    assert rows <= BM, f"{max_q} tokens x {G} heads do not fit a {BM}-row tile"
    NT = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    B1 = T.dynamic("batch_plus_1")
    MP = T.dynamic("max_pages")
    S = T.dynamic("num_splits")
    NEG_INF = -T.infinity(ACC)
    out_dtype = ACC if split else q_dtype
    # Fewer than 64 rows (e.g. 1 token x 4 heads): 16-row tiles on mma.sync with warps splitting the
    # columns, instead of 64-row warpgroup MMAs that are mostly padding.
    small = BM < 64
    policy = T.GemmWarpPolicy.FullCol if small else T.GemmWarpPolicy.FullRow
    O_shape = (S, NT, Hq, DV) if split else (NT, Hq, DV)
    L_shape = (S, NT, Hq) if split else (NT, Hq)
    resolve_slots, load_kv, softmax_step, finish_rows = _attention_macros(BM, BN, D, DV, k_layout[2], v_layout[2],
                                                                          is_fp8, slot_tiles)

    @T.macro
    def tile_step(Q_s, K_s, V_s, P_s, acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, n0, prefix, sk, window,
                  logit_scale, softcap, scale_log2):
        """Scores, mask, online softmax and ``P V`` of the key tile from ``n0`` (its K/V rows are in K_s/V_s)."""
        T.clear(acc_s)
        T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=policy)
        for r, j in T.Parallel(BM, BN):
            acc_s[r, j] = T.if_then_else(
                _visible(n0 + j, prefix + r // G, sk, window, True, has_window),
                softcap * T.tanh(acc_s[r, j] * (logit_scale / softcap)) if has_softcap else acc_s[r, j],
                NEG_INF)
        # a split may hold only keys that some rows (earlier tokens, or a window) cannot see
        softmax_step(acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, scale_log2, True)
        if small:
            # each warp owns a column slice of the scores; P goes through shared memory to feed the second
            # product, whose warps own column slices of the output
            T.copy(acc_p, P_s)
            T.gemm(P_s, V_s, acc_o, policy=policy)
        else:
            T.gemm(acc_p, V_s, acc_o, policy=policy)

    @T.prim_func
    def decode(
        Q: T.Tensor((NT, Hq, D), q_dtype),
        KC: _rows_tensor(k_layout[0], k_layout[1], kv_dtype, "k"),
        VC: _rows_tensor(v_layout[0], v_layout[1], kv_dtype, "v"),
        cu_seqlens_q: T.Tensor((B1,), "int32"),
        seqlens_k: T.Tensor((B,), "int32"),
        page_table: T.Tensor((B, MP), "int32"),
        sinks: T.Tensor((Hq,), "float32"),
        k_scale: T.Tensor((Hkv,), "float32"),
        v_scale: T.Tensor((Hkv,), "float32"),
        sm_scale: T.float32,
        softcap: T.float32,
        window: T.int32,
        page_size: T.int32,
        num_splits: T.int32,
        O: T.Tensor(O_shape, out_dtype),
        LSE: T.Tensor(L_shape, "float32"),
    ):
        with T.Kernel(num_splits, Hkv, B, threads=threads) as (bs, bh, bb):
            if pdl:
                T.pdl_trigger()
            Q_s = T.alloc_shared([BM, D], q_dtype)
            P_s = T.alloc_shared([BM, BN], q_dtype) if small else None
            K_s = T.alloc_shared([BN, D], q_dtype)
            V_s = T.alloc_shared([BN, DV], q_dtype)
            K8_s = T.alloc_shared([BN, D], kv_dtype) if is_fp8 else None
            V8_s = T.alloc_shared([BN, DV], kv_dtype) if is_fp8 else None
            slot_s = _slot_buffer(slot_tiles * BN) if slot_tiles > 0 else None
            acc_s = T.alloc_fragment([BM, BN], ACC)
            acc_p = T.alloc_fragment([BM, BN], q_dtype)
            acc_o = T.alloc_fragment([BM, DV], ACC)
            m_i = T.alloc_fragment([BM], ACC)
            m_prev = T.alloc_fragment([BM], ACC)
            m_tile = T.alloc_fragment([BM], ACC)
            alpha = T.alloc_fragment([BM], ACC)
            row_sum = T.alloc_fragment([BM], ACC)
            l_i = T.alloc_fragment([BM], ACC)

            b = bb
            kvh = bh
            q0 = cu_seqlens_q[b]
            qlen = cu_seqlens_q[b + 1] - q0
            sk = seqlens_k[b]
            prefix = sk - qlen
            logit_scale = sm_scale * k_scale[kvh] if is_fp8 else sm_scale
            scale_log2 = LOG2E if has_softcap else logit_scale * LOG2E

            kv_lo = T.max(prefix - window, 0) if has_window else 0
            n_lo = kv_lo // BN
            n_total = T.max(T.ceildiv(sk, BN) - n_lo, 0)
            per_split = T.ceildiv(n_total, num_splits)
            it_lo = bs * per_split
            n_iters = T.max(T.min(per_split, n_total - it_lo), 0)

            # row r: token r // G of this request, query head kvh * G + r % G
            for r, d in T.Parallel(BM, D):
                Q_s[r, d] = T.if_then_else(T.And(r < rows, r // G < qlen), Q[q0 + r // G, kvh * G + r % G, d],
                                           T.Cast(q_dtype, 0))
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, NEG_INF)

            if slot_tiles > 0:
                # full runs: the keys of this split end at kv_end, later tiles of its last run are masked and
                # their rows -1; else each run's pipeline stops at the split's last tile
                kv_end = T.min(sk, (n_lo + it_lo + n_iters) * BN) if full_runs else sk
                for c in T.serial(T.ceildiv(n_iters, slot_tiles)):
                    resolve_slots(slot_s, (n_lo + it_lo + c * slot_tiles) * BN, page_table, b, kv_end, page_size,
                                  MP)
                    run = slot_tiles if full_runs else T.min(slot_tiles, n_iters - c * slot_tiles)
                    for it in T.Pipelined(run, num_stages=num_stages):
                        n0 = (n_lo + it_lo + c * slot_tiles + it) * BN
                        load_kv(KC, VC, K_s, V_s, K8_s, V8_s, lambda j: slot_s[it * BN + j], kvh)
                        tile_step(Q_s, K_s, V_s, P_s, acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, n0,
                                  prefix, kv_end, window, logit_scale, softcap, scale_log2)
            else:
                # rows resolved inline by the copies (one page-table read per row, cached): one pipeline over
                # all the split's tiles, no restarts
                for it in T.Pipelined(n_iters, num_stages=num_stages):
                    n0 = (n_lo + it_lo + it) * BN
                    load_kv(KC, VC, K_s, V_s, K8_s, V8_s, lambda j: _slot(page_table, b, n0 + j, sk, page_size, MP),
                            kvh)
                    tile_step(Q_s, K_s, V_s, P_s, acc_s, acc_p, acc_o, m_i, m_prev, alpha, row_sum, l_i, n0,
                              prefix, sk, window, logit_scale, softcap, scale_log2)

            finish_rows(m_i, l_i, m_tile, row_sum, alpha, scale_log2, sinks, lambda r: kvh * G + r % G,
                        has_sinks and not split)
            out_scale = v_scale[kvh] if is_fp8 else 1.0
            for r, d in T.Parallel(BM, DV):
                if r < rows and r // G < qlen:
                    if split:
                        O[bs, q0 + r // G, kvh * G + r % G, d] = T.if_then_else(
                            l_i[r] == 0.0, 0.0, acc_o[r, d] * out_scale / l_i[r])
                    else:
                        O[q0 + r // G, kvh * G + r % G, d] = T.Cast(
                            q_dtype, T.if_then_else(l_i[r] == 0.0, 0.0, acc_o[r, d] * out_scale / l_i[r]))
            for r in T.Parallel(BM):
                if r < rows and r // G < qlen:
                    if split:
                        LSE[bs, q0 + r // G, kvh * G + r % G] = alpha[r]
                    else:
                        LSE[q0 + r // G, kvh * G + r % G] = alpha[r] / LOG2E

    return decode


@functools.lru_cache(maxsize=None)
def build_combine(Hq: int, DV: int, q_dtype: str, has_sinks: bool, threads: int = 128, pdl: bool = False,
                  max_splits: int = 0, chunk: int = 8):
    """Merge split-KV partials: ``O = sum_s 2^(lse_s - lse) o_s`` with ``lse = log2 sum_s 2^lse_s`` (+ sink).
    ``pdl``: launched as a programmatic dependent of the decode kernel; it waits for the decode grid's
    completion (and its memory) before it reads a partial.

    ``max_splits`` (0: one split after the other, each a dependent round trip to L2): the block reads all the
    partial LSEs at once into shared memory (at most ``max_splits``, the launcher's cap), then the partial
    outputs ``chunk`` splits at a time, unrolled, so their loads are in flight together (past the last split a
    chunk re-reads it with weight 0)."""
    NT = T.dynamic("num_tokens")
    S = T.dynamic("num_splits")
    NEG_INF = -T.infinity(ACC)

    @T.prim_func
    def combine(
        O_part: T.Tensor((S, NT, Hq, DV), ACC),
        L_part: T.Tensor((S, NT, Hq), ACC),
        sinks: T.Tensor((Hq,), "float32"),
        O: T.Tensor((NT, Hq, DV), q_dtype),
        LSE: T.Tensor((NT, Hq), "float32"),
    ):
        with T.Kernel(NT, Hq, threads=threads) as (t, h):
            if pdl:
                T.pdl_sync()
            acc = T.alloc_fragment([DV], ACC)
            m = T.alloc_var(ACC)
            total = T.alloc_var(ACC)
            w = T.alloc_var(ACC)
            m = NEG_INF
            if max_splits:
                lse_s = T.alloc_shared([max_splits], ACC)
                for s in T.Parallel(max_splits):
                    lse_s[s] = T.if_then_else(s < S, L_part[T.min(s, S - 1), t, h], NEG_INF)
                for c in T.serial(T.ceildiv(S, chunk)):
                    for j in T.unroll(chunk):
                        m = T.max(m, lse_s[c * chunk + j])
            else:
                for s in T.serial(S):
                    m = T.max(m, L_part[s, t, h])
            if has_sinks:
                m = T.max(m, sinks[h] * LOG2E)
            total = 0.0
            T.fill(acc, 0)
            if m != NEG_INF:
                if max_splits:
                    for c in T.serial(T.ceildiv(S, chunk)):
                        for j in T.unroll(chunk):
                            w = T.exp2(lse_s[c * chunk + j] - m)  # 0 past the last split (its LSE is -inf)
                            total = total + w
                            for d in T.Parallel(DV):
                                acc[d] += w * O_part[T.min(c * chunk + j, S - 1), t, h, d]
                else:
                    for s in T.serial(S):
                        w = T.exp2(L_part[s, t, h] - m)
                        total = total + w
                        for d in T.Parallel(DV):
                            acc[d] += w * O_part[s, t, h, d]
                if has_sinks:
                    total = total + T.exp2(sinks[h] * LOG2E - m)
            for d in T.Parallel(DV):
                O[t, h, d] = T.Cast(q_dtype, T.if_then_else(total > 0.0, acc[d] / total, 0.0))
            LSE[t, h] = T.if_then_else(total > 0.0, (T.log2(total) + m) / LOG2E, NEG_INF)

    return combine
