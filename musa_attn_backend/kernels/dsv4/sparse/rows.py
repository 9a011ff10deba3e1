"""The FP8 row producer the Hopper sparse MQA programs share (:mod:`.sched_kernel`,
:mod:`.paired_kernel`): a producer warp group of 128 threads gathers a 64-row key tile of DeepSeek-V4's
FP8 cache (584-byte rows: 448 e4m3 nope bytes, 64 bf16 RoPE values, a UE8M0 scale a 64 columns) and writes it to
shared memory as bf16, in two 256-column halves (``Kl`` columns 0-255, ``Kr`` 256-511).

Four lanes a cache row, two rows a thread (rows ``r`` and ``r + 32`` of the tile): lane ``q`` of a row loads the
row's 16-byte units ``q, q + 4, ..., q + 24`` (the nope bytes) and ``28 + q, 32 + q`` (the RoPE values), so that
eight rows' 64 contiguous bytes make one warp load. Each nope byte becomes bf16 by integer moves: the magnitude
``eeeemmm`` shifted into the bf16 exponent and mantissa fields and the sign into its bit, which is the value times
``2^-120`` exactly (subnormals included; byte permutes, a multiply-add and masks, nothing on the conversion pipe);
then ``x 2^120`` and ``x 2^(e - 127)`` for the tile's UE8M0 exponent ``e``, two packed bf16 multiplies, exact but
for the final rounding of a result below bf16's normal range, as the reference rounds it (an e4m3 NaN byte, which
no writer stores, decodes to 480 times the scale instead of NaN). An invalid entry (past its length, negative, at
or past its cache's slot count) is not read: its row is zeros.
"""

from pathlib import Path
from typing import NamedTuple

from ...._tilelang import tl_lang as T
from .. import layout as L

BH, BN = 64, 64  # query heads a block, index entries a key tile
HD = L.D // 2  # the columns of a half tile
UNITS = L.DATA_BYTES // 16  # a data row in 16-byte units (36)
NOPE_STEPS = L.D_NOPE // 64  # 64-byte steps over the nope bytes (7): one 16-byte unit a lane each
ROPE_STEPS = L.D_ROPE * 2 // 64  # and over the RoPE bytes (2)
LOADS = NOPE_STEPS + ROPE_STEPS  # 16-byte loads a lane makes per row (9)
LEFT_STEPS = HD // 64  # nope steps in the left half (4); the rest of the nope and the RoPE are the right half's
ROWS = 2  # rows a producer thread loads per tile: 64 rows over 32 groups of four lanes
PRODUCER = 128
TWO_POW_120 = 0x7B80  # bf16 bits of 2^120


def byte_perm(x, y, sel):
    """CUDA's ``__byte_perm(x, y, sel)`` (the ``PRMT`` instruction) on 32-bit words."""
    return T.call_extern("int32", "__byte_perm", x, y, sel)


def nope_bytes_to_bf16(word, perm=byte_perm):
    """``(lo, hi)``: the four e4m3 bytes of the 32-bit ``word`` (int32) as two words of two bf16 each, each value
    times ``2^-120`` (exact): bf16 bits ``(b & 0x7F) << 4 | (b & 0x80) << 8`` per byte ``b``, the bytes spread by
    ``perm`` (CUDA's byte permute; the tests pass a model of it). No sum below overflows: the magnitudes' words
    are at most ``0x07F007F0``."""
    mag = word & 0x7F7F7F7F
    sign = word ^ mag
    lo = perm(mag, 0, 0x4140) * 16 + perm(sign, 0, 0x1404)
    hi = perm(mag, 0, 0x4342) * 16 + perm(sign, 0, 0x3424)
    return lo, hi


class RowMacros(NamedTuple):
    load_q: object
    entry: object
    load_rows: object
    store_row: object
    store_half: object
    load_one: object
    store_row_sent: object
    prefetch_row: object


# the device functions of the clustered programs' stores into the peer CTA (force-included where they are built)
CLUSTER_STORE_HEADER = Path(__file__).with_name("cluster_store.cuh")
# the hinted cache load of a producer built with ``load_hint`` (force-included where it is built)
LOAD_HINT_HEADER = Path(__file__).with_name("load_hint.cuh")


def prefetch_l2(src, nbytes):
    """``nbytes`` (a multiple of 16) at the global element ``src`` (its address taken) into L2, asynchronously
    (:data:`LOAD_HINT_HEADER`; CUDA sm_90)."""
    return T.call_extern("handle", "musa_attn_prefetch_l2", T.address_of(src), nbytes)


def load16_hinted(dst, src):
    """The 16 bytes at global ``src`` (an element's address is taken) into the local ``dst`` element and the three
    after it, with an L1 evict-last and a 256-byte L2 prefetch hint (:data:`LOAD_HINT_HEADER`; CUDA)."""
    return T.call_extern("handle", "musa_attn_ld16_hint", T.address_of(dst), T.address_of(src))


def evict_last_policy():
    """An L2 evict-last cache policy (a uint64 for :func:`copy16_hinted`; :data:`LOAD_HINT_HEADER`; CUDA)."""
    return T.call_extern("uint64", "musa_attn_evict_last_policy")


def copy16_hinted(dst, src, pred, policy):
    """``cp.async`` of the 16 bytes at global ``src`` into shared ``dst`` (elements whose addresses are taken)
    under the L2 cache ``policy`` with a 256-byte L2 prefetch, zeros where ``pred`` is 0 (:data:`LOAD_HINT_HEADER`;
    CUDA sm_80+)."""
    return T.call_extern("handle", "musa_attn_cp_async16_hint", T.address_of(dst), T.address_of(src), pred, policy)


def copy16_row(dst, lane_base, row, row_bytes, byte_off, pred, policy):
    """:func:`copy16_hinted` from row ``row`` of a table of ``row_bytes``-byte rows, ``byte_off`` bytes into it;
    ``lane_base``: this thread's element of row 0 (its address is taken; :data:`LOAD_HINT_HEADER`; CUDA sm_80+)."""
    return T.call_extern("handle", "musa_attn_cp_async16_row", T.address_of(dst), T.address_of(lane_base), row,
                         row_bytes, byte_off, pred, policy)


def load_i32(first, i):
    """The int32 ``i`` elements after ``first`` (an element whose address is taken), a read-only load
    (:data:`LOAD_HINT_HEADER`; CUDA)."""
    return T.call_extern("int32", "musa_attn_ldg_i32", T.address_of(first), i)


def send16(elem, peer, w0, w1, w2, w3, bar):
    """The 16 bytes ``w0 .. w3`` (32-bit words) into CTA ``peer`` of the cluster at the shared address ``elem`` has
    here, completing 16 bytes on the peer's barrier at the address ``bar`` has here (``st.async``; CUDA sm_90+,
    :data:`CLUSTER_STORE_HEADER`)."""
    return T.call_extern("handle", "musa_attn_st_async_v4", T.address_of(elem), peer, w0, w1, w2, w3,
                         T.address_of(bar))


def send4(elem, peer, w, bar):
    """One 32-bit word, as :func:`send16`."""
    return T.call_extern("handle", "musa_attn_st_async_b32", T.address_of(elem), peer, w, T.address_of(bar))


def fp8_row_macros(H: int, has_extra: bool, q_dtype: str, K1, K2, buf_rows: int = ROWS,
                   load_hint: bool = False) -> RowMacros:
    """The producer's macros for ``H`` query heads (blocks of ``BH``) and index lists of ``K1`` / ``K2`` entries
    (the program's dynamic sizes); ``buf_rows``: the rows the producer's byte buffer holds (``ROWS``, or 1 for a
    producer that loads and stores one row at a time); ``load_hint``: the cache rows' 16-byte loads by
    :func:`load16_hinted` (the program is then built with :data:`LOAD_HINT_HEADER`)."""
    D = L.D

    # ---- producer ---------------------------------------------------------------------------------------------

    @T.macro
    def load_q(Q, Ql_s, Qr_s, t, h0, p):
        """The token's 64 query rows into shared memory: 16-byte ``cp.async`` copies, rows past ``H`` zero-filled
        without a read; committed here, waited for once the first key tile's loads are in flight."""
        for i in T.unroll(BH * D // 8 // PRODUCER):
            u = i * PRODUCER + p
            h = u // (D // 8)
            c = u % (D // 8)
            ok = h0 + h < H
            if c < HD // 8:
                T.ptx_cp_async(T.access_ptr(Ql_s[h, c * 8], "w", 8),
                               T.access_ptr(Q[t, T.min(h0 + h, H - 1), c * 8], "r", 8), 8, ok)
            else:
                T.ptx_cp_async(T.access_ptr(Qr_s[h, (c - HD // 8) * 8], "w", 8),
                               T.access_ptr(Q[t, T.min(h0 + h, H - 1), c * 8], "r", 8), 8, ok)
        T.ptx_commit_group()

    @T.macro
    def entry(dst, r, gi, n1, e_in_tile, t, I1, L1, I2, L2):
        """``dst[r]`` <- the index of entry ``e_in_tile`` of token ``t``'s key tile ``gi`` (the main set's ``n1``
        tiles, then the extra set's); -1 past its set's length (or with no extra set)."""
        if gi < n1:
            e1 = gi * BN + e_in_tile
            dst[r] = T.if_then_else(e1 < T.min(L1[t], K1), I1[t, T.min(e1, K1 - 1)], -1)
        else:
            if has_extra:
                e2 = (gi - n1) * BN + e_in_tile
                dst[r] = T.if_then_else(e2 < T.min(L2[t], K2), I2[t, T.min(e2, K2 - 1)], -1)
            else:
                dst[r] = -1

    def row_page(idx, rows):
        """The page of slot ``idx`` (int64); with ``load_hint`` by one unsigned division (no floor fix-ups: a
        negative index is not read)."""
        if load_hint:
            return T.Cast("int64", T.Cast("uint32", idx) // T.Cast("uint32", rows))
        return T.Cast("int64", idx // rows)

    def row_offset(idx, rows, scale, add=0):
        """``add + (idx % rows) * scale`` as int64 (the slot's place in its page, in units of ``scale``)."""
        if load_hint:
            return T.Cast("int64", add) + T.Cast("int64", T.Cast("uint32", idx) % T.Cast("uint32", rows)) * scale
        if scale == 1:
            return T.Cast("int64", add + idx % rows)
        return T.Cast("int64", idx % rows * scale)

    def data_unit(page, idx, rows, stride16):
        """The first 16-byte unit of slot ``idx``'s data row (in page ``page``)."""
        return page * stride16 + row_offset(idx, rows, UNITS)

    def scale_unit(page, idx, rows, stride16):
        """The 8-byte unit of slot ``idx``'s scale bytes (after its page's data rows)."""
        return page * stride16 * 2 + row_offset(idx, rows, 1, rows * (L.DATA_BYTES // 8))

    @T.macro
    def load_row(raw, sw, r, idx, q, CW, CS, rows, stride16, slots):
        """Row ``r``'s loads for lane ``q`` of its four: the nope and RoPE units into ``raw[r]`` (zeros for an
        invalid index, not read) and the row's eight scale bytes into ``sw[r]``."""
        page = row_page(idx, rows)
        base = data_unit(page, idx, rows, stride16)
        sbase = scale_unit(page, idx, rows, stride16)
        if T.And(idx >= 0, idx < slots):
            for s in T.unroll(LOADS):
                if load_hint:
                    T.evaluate(load16_hinted(raw[r, s * 4], CW[base + s * 4 + q, 0]))
                else:
                    for v in T.vectorized(4):
                        raw[r, s * 4 + v] = CW[base + s * 4 + q, v]
            for v in T.vectorized(2):
                sw[r, v] = CS[sbase, v]
        else:
            for s in T.unroll(LOADS):
                for v in T.vectorized(4):
                    raw[r, s * 4 + v] = 0
            for v in T.vectorized(2):
                sw[r, v] = 0

    @T.macro
    def prefetch_from(idx, q, CW, CS, rows, stride16, slots):
        """Slot ``idx``'s data row into L2 by lane 0 of its four (one bulk prefetch of its 576 bytes) and the line
        of its scale bytes by lane 1; nothing for an invalid slot."""
        if T.And(idx >= 0, idx < slots):
            page = row_page(idx, rows)
            if q == 0:
                T.evaluate(prefetch_l2(CW[data_unit(page, idx, rows, stride16), 0], L.DATA_BYTES))
            if q == 1:  # the bulk prefetch takes 16-byte-aligned addresses: the pair of scale units holding it
                sunit = scale_unit(page, idx, rows, stride16)
                T.evaluate(prefetch_l2(CS[sunit - sunit % 2, 0], 16))

    @T.macro
    def prefetch_row(idx, q, main, CW, CS, rows1, stride1, slots1, XW, XS, rows2, stride2, slots2):
        """:func:`prefetch_from` of slot ``idx`` in the main cache where ``main``, else in the extra one."""
        if main:
            prefetch_from(idx, q, CW, CS, rows1, stride1, slots1)
        else:
            prefetch_from(idx, q, XW, XS, rows2, stride2, slots2)

    @T.macro
    def load_one(raw, sw, b, r, idx, ok, q, main, CW, CS, rows1, stride1, slots1, XW, XS, rows2, stride2, slots2):
        """Row ``r`` of this lane's ``ROWS`` (slot ``idx[r]``) into buffer row ``b``: from the main cache where
        ``main``, else from the extra one; ``ok[r]``: whether its slot is valid (read) or not (zeros)."""
        if main:
            ok[r] = T.if_then_else(T.And(idx[r] >= 0, idx[r] < slots1), 1, 0)
            load_row(raw, sw, b, idx[r], q, CW, CS, rows1, stride1, slots1)
        else:
            ok[r] = T.if_then_else(T.And(idx[r] >= 0, idx[r] < slots2), 1, 0)
            load_row(raw, sw, b, idx[r], q, XW, XS, rows2, stride2, slots2)

    @T.macro
    def load_rows(raw, sw, idx, ok, q, main, CW, CS, rows1, stride1, slots1, XW, XS, rows2, stride2, slots2):
        """This lane's loads of its ``ROWS`` rows of a tile (slots ``idx``), row ``r`` into buffer row ``r``."""
        for r in T.unroll(ROWS):
            load_one(raw, sw, r, r, idx, ok, q, main, CW, CS, rows1, stride1, slots1, XW, XS, rows2, stride2, slots2)

    @T.macro
    def dequant_step(raw, sw, r, s, outw, fac):
        """Nope step ``s`` of row ``r`` (this lane's 16 bytes of it) as 16 bf16 values in ``outw``."""
        outb = T.view(outw, [16], q_dtype)
        facb = T.view(fac, [2], q_dtype)
        e = (sw[r, s // 4] >> ((s % 4) * 8)) & 255
        # 2^(e - 127) as bf16 bits (e = 0: the subnormal 2^-127)
        fac[1] = T.Cast("uint16", T.if_then_else(e == 0, 0x40, e * 128))
        fac[0] = T.uint16(TWO_POW_120)
        for i in T.unroll(4):
            lo, hi = nope_bytes_to_bf16(raw[r, s * 4 + i])
            outw[2 * i] = lo
            outw[2 * i + 1] = hi
        for v in T.vectorized(16):
            outb[v] = outb[v] * facb[0] * facb[1]

    @T.macro
    def store_row_sent(Kl_s, Kr_s, st, row, raw, sw, r, q, outw, fac, peer, bars):
        """:func:`store_row`, each 16 bytes also stored into CTA ``peer`` of the cluster at the same place of its stage,
        completing on its barrier ``bars[st]`` (:func:`send16`; ``peer`` None: this CTA's stage only). The barrier
        goes in as its array: a macro binds an element argument to a local copy, whose address is not the
        barrier's."""
        outb = T.view(outw, [16], q_dtype)
        for s in T.unroll(NOPE_STEPS):
            dequant_step(raw, sw, r, s, outw, fac)
            col = s * 64 + q * 16
            if s < 4:
                for v in T.vectorized(8):
                    Kl_s[st, row, col + v] = outb[v]
                for v in T.vectorized(8):
                    Kl_s[st, row, col + 8 + v] = outb[8 + v]
                if peer is not None:
                    send16(Kl_s[st, row, col], peer, outw[0], outw[1], outw[2], outw[3], bars[st])
                    send16(Kl_s[st, row, col + 8], peer, outw[4], outw[5], outw[6], outw[7], bars[st])
            else:
                for v in T.vectorized(8):
                    Kr_s[st, row, col - HD + v] = outb[v]
                for v in T.vectorized(8):
                    Kr_s[st, row, col - HD + 8 + v] = outb[8 + v]
                if peer is not None:
                    send16(Kr_s[st, row, col - HD], peer, outw[0], outw[1], outw[2], outw[3], bars[st])
                    send16(Kr_s[st, row, col - HD + 8], peer, outw[4], outw[5], outw[6], outw[7], bars[st])
        rope = T.view(raw, [buf_rows, LOADS * 8], q_dtype)
        for s in T.unroll(ROPE_STEPS):
            for v in T.vectorized(8):
                Kr_s[st, row, L.D_NOPE - HD + s * 32 + q * 8 + v] = rope[r, (NOPE_STEPS + s) * 8 + v]
            if peer is not None:
                w = (NOPE_STEPS + s) * 4
                send16(Kr_s[st, row, L.D_NOPE - HD + s * 32 + q * 8], peer, raw[r, w], raw[r, w + 1], raw[r, w + 2],
                       raw[r, w + 3], bars[st])

    @T.macro
    def store_row(Kl_s, Kr_s, st, row, raw, sw, r, q, outw, fac):
        """Row ``r`` of this lane (tile row ``row``) dequantised into stage ``st``: nope step ``s`` covers columns
        ``64 s + 16 q ..``; the RoPE values land at columns ``448 + 32 s + 8 q ..``."""
        store_row_sent(Kl_s, Kr_s, st, row, raw, sw, r, q, outw, fac, None, None)

    @T.macro
    def store_half(K_s, st, row, raw, sw, r, q, outw, fac, half):
        """Like ``store_row``, one half of the row into ``K_s`` (``half`` 0: columns 0-255, 1: 256-511 with the
        RoPE values), so that a consumer done with one half of a stage frees it apart from the other."""
        outb = T.view(outw, [16], q_dtype)
        for s0 in T.unroll(LEFT_STEPS if half == 0 else NOPE_STEPS - LEFT_STEPS):
            s = s0 + half * LEFT_STEPS
            dequant_step(raw, sw, r, s, outw, fac)
            col = s * 64 + q * 16 - half * HD
            for v in T.vectorized(8):
                K_s[st, row, col + v] = outb[v]
            for v in T.vectorized(8):
                K_s[st, row, col + 8 + v] = outb[8 + v]
        if half == 1:
            rope = T.view(raw, [buf_rows, LOADS * 8], q_dtype)
            for s in T.unroll(ROPE_STEPS):
                for v in T.vectorized(8):
                    K_s[st, row, L.D_NOPE - HD + s * 32 + q * 8 + v] = rope[r, (NOPE_STEPS + s) * 8 + v]

    return RowMacros(load_q, entry, load_rows, store_row, store_half, load_one, store_row_sent, prefetch_row)
