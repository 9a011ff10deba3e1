"""Pieces shared by the TileLang paged-attention programs, one program per module: :mod:`.prefill_kernel`
(prefill/extend, row gathers or whole-tile copies), :mod:`.prefill_pingpong_kernel` (the warp-specialised
prefill of Hopper-class GPUs), :mod:`.decode_kernel` (split-KV decode) and :mod:`.combine_kernel` (the merge of
the decode's splits).

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

Grouped state: macros take the block's buffers as small frozen dataclasses (:class:`Tiles`,
:class:`SoftmaxState`, allocated by :func:`alloc_softmax_state`, :class:`QueryTile`) whose fields are TileLang
buffers or bound scalars. TileLang passes
a non-expression macro argument through as it is, so a field is the buffer or variable it was bound to, under
its own name; expressions that a macro should bind under a name of its own stay separate parameters.

No ``from __future__ import annotations`` in the program modules: TileLang evaluates the prim_func
annotations.
"""

import dataclasses
from typing import Any, NamedTuple

from ..._tilelang import tl_lang as T
from .._tir import CHUNK_BYTES

LOG2E = 1.4426950408889634
ACC = "float32"
NEG_INF = -T.infinity(ACC)  # minus infinity in the accumulators' type: the running max of a row that saw no key
SLOT_TILES = 8  # tiles whose cache rows are resolved together before each pipelined run
# the 16-bit row width MUSA's GEMM layouts take: at most this many elements, or multiples of it
GEMM_EXTENT_CHUNK = CHUNK_BYTES // 2


def head_parts(d: int, split: bool) -> tuple:
    """The widths the ``Q K^T`` GEMMs cut a head dim ``d`` into: ``(d,)``, or with ``split`` (a target without
    ``platform.gemm_any_extent``: MUSA) ``(lead, d - lead)`` where ``d`` is over :data:`GEMM_EXTENT_CHUNK` and no
    multiple of it (192 -> 128 + 64), so that every operand's contiguous extent is one the target takes."""
    if not split or d <= GEMM_EXTENT_CHUNK or d % GEMM_EXTENT_CHUNK == 0:
        return (d,)
    lead = d // GEMM_EXTENT_CHUNK * GEMM_EXTENT_CHUNK
    return (lead, d - lead)


def rows_tensor(width: int, row_stride: int, dtype: str, name: str):
    """A cache seen as token rows (see the module docstring); ``name`` prefixes its dynamic row count."""
    return T.StridedTensor((T.dynamic(f"{name}_slots"), width), (row_stride, 1), dtype)


class PagedSizes(NamedTuple):
    """The dynamic sizes of a paged-attention program's arguments."""

    NT: Any  # the batch's query tokens
    B: Any  # its requests
    B1: Any  # requests + 1 (``cu_seqlens_q``)
    MP: Any  # page-table columns


def paged_sizes() -> PagedSizes:
    return PagedSizes(T.dynamic("num_tokens"), T.dynamic("batch"), T.dynamic("batch_plus_1"),
                      T.dynamic("max_pages"))


def paged_program(name: str, body, sizes: PagedSizes, Hq: int, Hkv: int, D: int, q_dtype: str, kv_dtype: str,
                  k_layout: tuple, v_layout: tuple, O_type, LSE_type):
    """The prim_func ``name`` of a paged-attention program: the argument list the decode and both prefill
    programs take, in the order their launch glue passes it, around ``body``, a macro that takes the arguments
    in that order and opens the kernel. The one scalar that differs is the grid's extent (``grid_extent``: the
    decode's split count, the prefill's longest query); ``O_type`` / ``LSE_type``: the outputs' annotations
    (the decode's split form writes float32 partials)."""
    NT, B, B1, MP = sizes

    @T.prim_func
    def program(
        Q: T.Tensor((NT, Hq, D), q_dtype),
        KC: rows_tensor(k_layout[0], k_layout[1], kv_dtype, "k"),
        VC: rows_tensor(v_layout[0], v_layout[1], kv_dtype, "v"),
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
        grid_extent: T.int32,
        O: O_type,
        LSE: LSE_type,
    ):
        body(Q, KC, VC, cu_seqlens_q, seqlens_k, page_table, sinks, k_scale, v_scale, sm_scale, softcap, window,
             page_size, grid_extent, O, LSE)

    return program.with_attr("global_symbol", name)


def visible(kpos, qpos, sk, window, causal: bool, has_window: bool):
    """Key at ``kpos`` is inside the sequence, not in the future (causal) and inside the left window."""
    v = kpos < sk
    if causal:
        v = T.And(v, kpos <= qpos)
    if has_window:
        v = T.And(v, kpos >= qpos - window)
    return v


def page_row(page_table, b, pos, page_size):
    """Cache row of key ``pos`` of request ``b``."""
    return page_table[b, pos // page_size] * page_size + pos % page_size


def slot_row(page_table, b, pos, sk, page_size, max_pages):
    """Cache row of key ``pos`` of request ``b``; -1 (zero-filled by the copy) past the sequence end."""
    page = page_table[b, T.min(T.truncdiv(pos, page_size), max_pages - 1)]
    return T.if_then_else(pos < sk, page * page_size + T.truncmod(pos, page_size), -1)


def slot_buffer(n: int):
    """Shared buffer for ``n`` resolved cache rows, in static shared memory rather than the dynamic pool that
    holds the tiles: TileLang's barrier insertion then sees that a row copy reads a buffer other than the one
    it writes. In the pool it could not tell them apart and put a block-wide barrier before every 16-byte
    copy (16 per 64-key decode tile)."""
    return T.alloc_shared([n], "int32", scope="shared")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A block's shared-memory tiles: the query tile, one key and one value tile in the query dtype, their FP8
    staging tiles (FP8 caches) and the P tile (else None): where the target's GEMMs take no A operand from
    registers (``platform.gemm_a_in_registers`` false) and in the decode's 16-row tiling, the probabilities
    go through it to the ``P V`` product. With a head dim cut in two (:func:`head_parts`), ``Q_s`` / ``K_s`` /
    ``K8_s`` hold its first part and ``Q2_s`` / ``K2_s`` / ``K82_s`` the rest (else None)."""

    Q_s: Any
    K_s: Any
    V_s: Any
    K8_s: Any = None
    V8_s: Any = None
    P_s: Any = None
    Q2_s: Any = None
    K2_s: Any = None
    K82_s: Any = None


@T.macro
def qk_product(tiles, acc_s, policy):
    """``acc_s += Q K^T`` over the tiles' head dim: one GEMM, or one a part (:func:`head_parts`)."""
    T.gemm(tiles.Q_s, tiles.K_s, acc_s, transpose_B=True, policy=policy)
    if tiles.K2_s is not None:
        T.gemm(tiles.Q2_s, tiles.K2_s, acc_s, transpose_B=True, policy=policy)


@dataclasses.dataclass(frozen=True)
class SoftmaxState:
    """Per-row online-softmax state of a block's (or consumer warp group's) rows, in registers: the scores
    ``acc_s`` and probabilities ``acc_p`` of the current key tile, the output accumulator ``acc_o``, the
    running max ``m_i`` (and the previous one), the running denominator ``l_i``, and scratch rows
    (``m_tile``, ``alpha``: the rescale factor, then the row LSE; ``row_sum``)."""

    acc_s: Any
    acc_p: Any
    acc_o: Any
    m_i: Any
    m_prev: Any
    m_tile: Any
    alpha: Any
    row_sum: Any
    l_i: Any

    def registers(self) -> tuple:
        """The state's buffers in field order, ``m_tile`` left out where it is None."""
        return tuple(v for v in (getattr(self, f.name) for f in dataclasses.fields(self)) if v is not None)


@T.macro
def alloc_softmax_state(BM, BN, DV, q_dtype, with_m_tile=True):
    """The registers of :class:`SoftmaxState` for ``BM`` rows of ``BN``-key score tiles and a ``DV``-wide output
    (``m_tile`` None unless ``with_m_tile``)."""
    acc_s = T.alloc_fragment([BM, BN], ACC)
    acc_p = T.alloc_fragment([BM, BN], q_dtype)
    acc_o = T.alloc_fragment([BM, DV], ACC)
    m_i = T.alloc_fragment([BM], ACC)
    m_prev = T.alloc_fragment([BM], ACC)
    m_tile = T.alloc_fragment([BM], ACC) if with_m_tile else None
    alpha = T.alloc_fragment([BM], ACC)
    row_sum = T.alloc_fragment([BM], ACC)
    l_i = T.alloc_fragment([BM], ACC)
    return SoftmaxState(acc_s, acc_p, acc_o, m_i, m_prev, m_tile, alpha, row_sum, l_i)


@dataclasses.dataclass(frozen=True)
class QueryTile:
    """Where a prefill block's query tile is: request ``b``, query head ``h`` (KV head ``kvh``), the request's
    first row ``q0`` in the packed batch, its ``qlen`` query rows and ``sk`` keys, of which the first
    ``prefix`` were cached before (query row ``i`` is key position ``prefix + i``), and the tile's first query
    row ``m0`` within the request. ``n_iters``: the key tiles the block visits (set by the program)."""

    b: Any
    h: Any
    kvh: Any
    q0: Any
    qlen: Any
    sk: Any
    prefix: Any
    m0: Any
    n_iters: Any = None

    def visiting(self, n_iters):
        """The same tile, visiting ``n_iters`` key tiles."""
        return dataclasses.replace(self, n_iters=n_iters)


@T.macro
def request_rows(cu_seqlens_q, seqlens_k, b):
    """``(q0, qlen, sk, prefix)`` of request ``b`` (see :class:`QueryTile`)."""
    q0 = cu_seqlens_q[b]
    qlen = cu_seqlens_q[b + 1] - q0
    sk = seqlens_k[b]
    prefix = sk - qlen
    return q0, qlen, sk, prefix


def query_tile_macro(G: int, BM: int, causal: bool):
    """A macro ``(cu_seqlens_q, seqlens_k, max_seqlen_q, bx, by, bz) -> QueryTile`` for a prefill grid of (query
    tile, query head, request). Causal: the last query tiles see the most keys; they get the lowest block ids
    so that they are scheduled first and the short tiles fill the tail of the last wave."""

    @T.macro
    def query_tile(cu_seqlens_q, seqlens_k, max_seqlen_q, bx, by, bz):
        b = bz
        h = by
        kvh = h // G
        q0, qlen, sk, prefix = request_rows(cu_seqlens_q, seqlens_k, b)
        m0 = (T.ceildiv(max_seqlen_q, BM) - 1 - bx) * BM if causal else bx * BM
        return QueryTile(b, h, kvh, q0, qlen, sk, prefix, m0)

    return query_tile


class AttentionMacros(NamedTuple):
    """The macros of :func:`attention_macros`."""

    alloc_state: Any
    resolve_slots: Any
    load_kv: Any
    softmax_step: Any
    pv_product: Any
    finish_rows: Any


def attention_macros(BM, BN, D, DV, HS_K, HS_V, is_fp8, q_dtype, slot_tiles=SLOT_TILES,
                     D1=None) -> AttentionMacros:
    """Tile loads and the online-softmax step shared by the prefill and decode programs (the step also by
    DeepSeek-V4's portable and scheduled sparse programs; ``BM`` x ``BN`` score tiles, head dims ``D`` / ``DV``,
    head strides ``HS_K`` / ``HS_V`` of the cache rows; ``D1``: the width of the head dim's first part where the K
    tiles are cut in two, :func:`head_parts`)."""
    D1 = D1 or D

    @T.macro
    def alloc_state():
        """The registers of :class:`SoftmaxState` for ``BM`` rows."""
        return alloc_softmax_state(BM, BN, DV, q_dtype)

    @T.macro
    def resolve_slots(slot_s, pos0, page_table, b, sk, page_size, max_pages):
        """Cache rows of ``slot_tiles`` tiles from key ``pos0`` on: one page-table read per row, all rows in
        parallel, before the pipelined loop that copies them (which then reads addresses from shared)."""
        for r in T.Parallel(slot_tiles * BN):
            slot_s[r] = slot_row(page_table, b, pos0 + r, sk, page_size, max_pages)

    @T.macro
    def load_kv(KC, VC, tiles, row, kvh):
        """Gather the K and V rows of a tile: ``row(j)`` is the cache row of its key ``j`` (-1: zero-filled). K
        and V share one copy loop when D == DV (TileLang 0.1.15 mis-counts the cp.async groups of a pipeline
        stage that commits two)."""
        K_dst = tiles.K8_s if is_fp8 else tiles.K_s
        V_dst = tiles.V8_s if is_fp8 else tiles.V_s
        if D == DV and D1 == D:
            for j, d in T.Parallel(BN, D):
                K_dst[j, d] = KC[row(j), kvh * HS_K + d]
                V_dst[j, d] = VC[row(j), kvh * HS_V + d]
        else:
            for j, d in T.Parallel(BN, D1):
                K_dst[j, d] = KC[row(j), kvh * HS_K + d]
            if D1 < D:
                K2_dst = tiles.K82_s if is_fp8 else tiles.K2_s
                for j, d in T.Parallel(BN, D - D1):
                    K2_dst[j, d] = KC[row(j), kvh * HS_K + D1 + d]
            for j, d in T.Parallel(BN, DV):
                V_dst[j, d] = VC[row(j), kvh * HS_V + d]
        if is_fp8:
            T.copy(tiles.K8_s, tiles.K_s)
            if D1 < D:
                T.copy(tiles.K82_s, tiles.K2_s)
            T.copy(tiles.V8_s, tiles.V_s)

    @T.macro
    def softmax_step(state, scale_log2, guard, P_s=None):
        """Online softmax of the masked scores in ``acc_s`` (P to the shared tile ``P_s`` if given, else to
        ``acc_p``; ``acc_o`` rescaled). ``guard``: a row may have seen only masked keys so far (its running max
        is -inf)."""
        acc_s, m_i, alpha = state.acc_s, state.m_i, state.alpha
        T.copy(m_i, state.m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        if guard:
            for i in T.Parallel(BM):
                alpha[i] = T.if_then_else(m_i[i] == NEG_INF, 1.0,
                                          T.exp2((state.m_prev[i] - m_i[i]) * scale_log2))
            for i, j in T.Parallel(BM, BN):
                acc_s[i, j] = T.if_then_else(m_i[i] == NEG_INF, 0.0,
                                             T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2))
        else:
            for i in T.Parallel(BM):
                alpha[i] = T.exp2((state.m_prev[i] - m_i[i]) * scale_log2)
            for i, j in T.Parallel(BM, BN):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
        T.reduce_sum(acc_s, state.row_sum, dim=1)
        for i in T.Parallel(BM):
            state.l_i[i] = state.l_i[i] * alpha[i] + state.row_sum[i]
        T.copy(acc_s, state.acc_p if P_s is None else P_s)
        for i, d in T.Parallel(BM, DV):
            state.acc_o[i, d] *= alpha[i]

    @T.macro
    def pv_product(state, tiles, policy):
        """``acc_o += P V`` from the P the softmax step left: in the shared tile ``tiles.P_s`` where there is
        one, else in registers (``acc_p``)."""
        if tiles.P_s is not None:
            T.gemm(tiles.P_s, tiles.V_s, state.acc_o, policy=policy)
        else:
            T.gemm(state.acc_p, tiles.V_s, state.acc_o, policy=policy)

    @T.macro
    def finish_rows(state, scale_log2, sinks, head_of_row, with_sink):
        """alpha <- row LSE (log2 units, sink included if ``with_sink``); l_i <- the full denominator."""
        m_i, l_i, m_tile, row_sum, alpha = state.m_i, state.l_i, state.m_tile, state.row_sum, state.alpha
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

    return AttentionMacros(alloc_state, resolve_slots, load_kv, softmax_step, pv_product, finish_rows)
