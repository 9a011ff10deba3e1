"""TileLang sparse MQA over DeepSeek-V4's FP8 caches: one block per (KV split, block of 64 query heads, query
token); all the block's heads share each gathered row.

The caches come in as views of their storage from the cache's first byte, in 16-byte units for the data
(``[units, 16]`` e4m3 for the nope values, ``[units, 8]`` bf16 for the RoPE values) and 8-byte units for the
scale exponents (``[units, 8]`` uint8); a row's offset is a unit index (``page * stride16 + row * 36``), so each
copy of 16 (8) bytes is bounds-checked once, as a whole, and gathers become 16-byte copies. Key tiles are ``block_N`` entries of the
token's index list: the main set's tiles first, then the extra set's. An entry past the token's length,
negative, or at or past its cache's slot count is invalid: its row is zero-filled without a read (its offsets
point below the buffer, where the copies' bounds checks stop them) and its score masked. The raw bytes go to
shared staging tiles, then each row is dequantised into a bf16 shared tile (``e4m3 * 2^(exponent - 127)``, exact
in bf16), which serves as both K and V; with ``separate_v`` the row goes to a K tile and a V tile of its own, as a
target that lays a shared GEMM operand out by its majorness needs (``platform.gemm_tile_two_majors`` false: MUSA):
``Q K^T`` reads K with the 512 values contiguous (K-major), ``P V`` reads V with them as its N side (MN-major).

The softmax runs in base 2 (``scale_log2 = sm_scale * log2(e)``). Unsplit, the block writes the final output
(the sink in the denominator) and the natural-log LSE without the sink; split, it writes a partial output
normalised by its own sum and its LSE in log2 units, merged by :mod:`.combine_kernel`.
"""

import functools

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E, Tiles, attention_macros
from .. import layout as L
from .args import sparse_sizes, unit_sets
from .tl_macros import sparse_macros

ROW16 = L.DATA_BYTES // 16  # a data row in 16-byte units (36)
ROPE16 = L.D_NOPE // 16  # the RoPE values' first 16-byte unit within a data row (28)
INVALID16 = -(1 << 26)  # the offsets of an invalid entry: below the buffer


def e4m3_to_float(b, fp8_convert: bool):
    """The float32 value of an e4m3 element (``fp8_convert``: the target's FP8 conversion) or byte (otherwise:
    ``(-1)^s 2^(e-7) (1 + m/8)``, subnormal ``(-1)^s 2^-6 m/8``; the writers never store NaN)."""
    if fp8_convert:
        return T.Cast(ACC, b)
    bits = T.Cast("int32", b)
    e = (bits // 8) % 16
    m = T.Cast(ACC, bits % 8)
    mag = T.if_then_else(e == 0, m * (2.0 ** -9), (m + 8.0) * T.exp2(T.Cast(ACC, e) - 10.0))
    return T.if_then_else(bits >= 128, -mag, mag)


@functools.lru_cache(maxsize=None)
def build_sparse_mqa(H: int, has_extra: bool, has_sink: bool, split: bool, q_dtype: str = "bfloat16",
                     block_H: int = 64, block_N: int = 64, threads: int = 256, shared_p: bool = True,
                     fp8_convert: bool = True, separate_v: bool = False):
    """Sparse MQA for ``H`` query heads (any count: blocks of ``block_H``, rows past ``H`` padded inside).
    ``shared_p``: the probabilities go through a shared tile to the ``P V`` product (where the target's GEMMs
    take no register A operand), else they stay in registers. ``fp8_convert``: the e4m3 bytes become values
    through the target's FP8 conversion; without one (``platform.fp8`` false: MP22) they are decoded from their
    sign, exponent and mantissa fields by integer arithmetic. ``separate_v``: K and V in tiles of their own (see
    the module docstring; two 64-row tiles beside the query tile need more shared memory than MUSA's 192 KB, so
    that form takes 32-row tiles)."""
    BH, BN, D = block_H, block_N, L.D
    sizes = sparse_sizes()
    NT, K1, K2 = sizes.NT, sizes.K1, sizes.K2
    SPLITS = T.dynamic("num_splits")
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + BH - 1) // BH
    O_shape = (SPLITS, NT, H, D) if split else (NT, H, D)
    L_shape = (SPLITS, NT, H) if split else (NT, H)
    alloc_state, _, _, softmax_step, pv_product, finish_rows = attention_macros(BH, BN, D, D, 0, 0, False, q_dtype)
    split_tiles, store_output = sparse_macros(H, BH, BN, has_extra, has_sink, split, q_dtype, K1, K2)
    nope_dtype = "float8_e4m3" if fp8_convert else "uint8"
    main, extra = unit_sets(sizes, nope_dtype)

    def e4m3_value(b):
        return e4m3_to_float(b, fp8_convert)

    @T.macro
    def resolve(base_s, scale_at_s, ok_s, I, Lens, t, e0, K, slots, rows, stride16):
        """Row offsets (16-byte units) and scale offsets (8-byte units) of entries ``e0 ..`` of token ``t``; an
        invalid entry gets offsets below zero, so the copies' bounds checks zero-fill its row without a read."""
        for j in T.Parallel(BN):
            e = e0 + j
            idx = T.if_then_else(e < T.min(Lens[t], K), I[t, T.min(e, K - 1)], -1)
            ok = T.And(idx >= 0, idx < slots)
            page = T.if_then_else(ok, idx // rows, 0)
            row = T.if_then_else(ok, idx % rows, 0)
            ok_s[j] = T.if_then_else(ok, 1, 0)
            base_s[j] = T.if_then_else(ok, page * stride16 + row * ROW16, INVALID16)
            scale_at_s[j] = T.if_then_else(ok, page * stride16 * 2 + rows * (L.DATA_BYTES // 8) + row, INVALID16)

    @T.macro
    def gather(KV_s, V_s, K8_s, S8_s, base_s, scale_at_s, C8, CH, CS):
        """The tile's rows into ``KV_s`` (and ``V_s`` with ``separate_v``): the raw bytes copied (16-byte copies;
        invalid rows zero-filled), then the nope values dequantised in shared memory (``e4m3 * 2^(exponent -
        127)``; a zero-filled row stays zero)."""
        for j, d in T.Parallel(BN, L.D_NOPE):
            K8_s[j, d] = C8[base_s[j] + d // 16, d % 16]
        for j, d in T.Parallel(BN, L.D_ROPE):
            KV_s[j, L.D_NOPE + d] = CH[base_s[j] + ROPE16 + d // 8, d % 8]
        if separate_v:
            for j, d in T.Parallel(BN, L.D_ROPE):
                V_s[j, L.D_NOPE + d] = CH[base_s[j] + ROPE16 + d // 8, d % 8]
        for j, g in T.Parallel(BN, L.SCALE_BYTES):
            S8_s[j, g] = CS[scale_at_s[j], g]
        for j, d in T.Parallel(BN, L.D_NOPE):
            KV_s[j, d] = T.Cast(q_dtype, e4m3_value(K8_s[j, d]) * T.exp2(T.Cast(ACC, S8_s[j, d // L.TILE]) - 127.0))
        if separate_v:
            for j, d in T.Parallel(BN, L.D_NOPE):
                V_s[j, d] = T.Cast(q_dtype,
                                   e4m3_value(K8_s[j, d]) * T.exp2(T.Cast(ACC, S8_s[j, d // L.TILE]) - 127.0))

    @T.prim_func
    def sparse_mqa(
        Q: T.Tensor((NT, H, D), q_dtype),
        C8: main.nope, CH: main.rope, CS: main.scales, I1: main.indices, L1: main.lengths,
        X8: extra.nope, XH: extra.rope, XS: extra.scales, I2: extra.indices, L2: extra.lengths,
        sinks: T.Tensor((H,), "float32"),
        sm_scale: T.float32,
        rows1: T.int32, stride1: T.int64, slots1: T.int32,  # each cache's geometry (see _glue._flat_views)
        rows2: T.int32, stride2: T.int64, slots2: T.int32,
        num_splits: T.int32,
        O: T.Tensor(O_shape, ACC if split else q_dtype),
        LSE: T.Tensor(L_shape, "float32"),
    ):
        with T.Kernel(NT, head_blocks, num_splits, threads=threads) as (bt, bh, bs):  # tokens on x: no 65,535 cap
            Q_s = T.alloc_shared([BH, D], q_dtype)
            KV_s = T.alloc_shared([BN, D], q_dtype)
            V_s = T.alloc_shared([BN, D], q_dtype) if separate_v else None
            P_s = T.alloc_shared([BH, BN], q_dtype) if shared_p else None
            K8_s = T.alloc_shared([BN, L.D_NOPE], nope_dtype)
            S8_s = T.alloc_shared([BN, L.SCALE_BYTES], "uint8")
            base_s = T.alloc_shared([BN], "int64", scope="shared")
            scale_at_s = T.alloc_shared([BN], "int64", scope="shared")
            ok_s = T.alloc_shared([BN], "int32", scope="shared")
            state = alloc_state()
            tiles = Tiles(Q_s, KV_s, V_s if separate_v else KV_s, None, None, P_s)
            t = bt
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E

            n1, it_lo, n_iters = split_tiles(L1, L2, t, bs, num_splits)

            for h, d in T.Parallel(BH, D):
                Q_s[h, d] = T.if_then_else(h0 + h < H, Q[t, T.min(h0 + h, H - 1), d], T.Cast(q_dtype, 0))
            T.fill(state.acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)

            for it in T.serial(n_iters):
                g = it_lo + it
                if g < n1:
                    resolve(base_s, scale_at_s, ok_s, I1, L1, t, g * BN, K1, slots1, rows1, stride1)
                    gather(KV_s, V_s, K8_s, S8_s, base_s, scale_at_s, C8, CH, CS)
                else:
                    resolve(base_s, scale_at_s, ok_s, I2, L2, t, (g - n1) * BN, K2, slots2, rows2, stride2)
                    gather(KV_s, V_s, K8_s, S8_s, base_s, scale_at_s, X8, XH, XS)
                acc_s = state.acc_s
                T.clear(acc_s)
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for h, j in T.Parallel(BH, BN):
                    acc_s[h, j] = T.if_then_else(ok_s[j] > 0, acc_s[h, j], NEG_INF)
                softmax_step(state, scale_log2, True, P_s)
                pv_product(state, tiles, T.GemmWarpPolicy.FullRow)

            finish_rows(state, scale_log2, sinks, lambda h: h, False)  # alpha <- log2 LSE without the sink
            store_output(state, O, LSE, sinks, scale_log2, t, bs, h0, 0, D, True)

    return sparse_mqa
