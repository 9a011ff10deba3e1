"""TileLang sparse MQA over DeepSeek-V4's FP8 caches: one block per (KV split, block of 64 query heads, query
token); all the block's heads share each gathered row.

The caches come in as flat byte views of their storage (one view per element type: e4m3 for the nope values,
bf16 for the RoPE values, uint8 for the scale exponents), each starting at the cache's first byte; a row's
offset is computed in 16-byte units (``page * stride16 + row * 36``), so TileLang can prove the 16-byte
alignment of every row it gathers. Key tiles are ``block_N`` entries of the token's index list: the main set's
tiles first, then the extra set's. An entry past the token's length, negative, or at or past its cache's slot
count is invalid: its row is zero-filled without a read and its score masked. Each row is dequantised into a
bf16 shared tile (``e4m3 * 2^(exponent - 127)``, exact in bf16), which serves as both K and V.

The softmax runs in base 2 (``scale_log2 = sm_scale * log2(e)``). Unsplit, the block writes the final output
(the sink in the denominator) and the natural-log LSE without the sink; split, it writes a partial output
normalised by its own sum and its LSE in log2 units, merged by :mod:`.combine_kernel`.
"""

import functools

from ..._tilelang import tl_lang as T
from ..attention.tl_common import ACC, LOG2E, Tiles, attention_macros
from . import layout as L

ROW16 = L.DATA_BYTES // 16  # a data row in 16-byte units (36)
ROPE_AT = L.D_NOPE // 2  # the RoPE values' first bf16 element within a data row (224)


@functools.lru_cache(maxsize=None)
def build_sparse_mqa(H: int, has_extra: bool, has_sink: bool, split: bool, q_dtype: str = "bfloat16",
                     block_H: int = 64, block_N: int = 64, threads: int = 256, shared_p: bool = True):
    """Sparse MQA for ``H`` query heads (any count: blocks of ``block_H``, rows past ``H`` padded inside).
    ``shared_p``: the probabilities go through a shared tile to the ``P V`` product (where the target's GEMMs
    take no register A operand), else they stay in registers."""
    BH, BN, D = block_H, block_N, L.D
    NT = T.dynamic("num_tokens")
    K1 = T.dynamic("topk")
    K2 = T.dynamic("extra_topk")
    NB1, NH1 = T.dynamic("cache_bytes"), T.dynamic("cache_halves")
    NB2, NH2 = T.dynamic("extra_bytes"), T.dynamic("extra_halves")
    SPLITS = T.dynamic("num_splits")
    NEG_INF = -T.infinity(ACC)
    head_blocks = (H + BH - 1) // BH
    O_shape = (SPLITS, NT, H, D) if split else (NT, H, D)
    L_shape = (SPLITS, NT, H) if split else (NT, H)
    alloc_state, _, _, softmax_step, pv_product, finish_rows = attention_macros(BH, BN, D, D, 0, 0, False, q_dtype)

    @T.macro
    def resolve(base_s, scale_at_s, ok_s, I, Lens, t, e0, K, slots, rows, stride16):
        """Row offsets (16-byte units; -1: invalid) and scale offsets (bytes) of entries ``e0 ..`` of token ``t``."""
        for j in T.Parallel(BN):
            e = e0 + j
            idx = T.if_then_else(e < T.min(Lens[t], K), I[t, T.min(e, K - 1)], -1)
            ok = T.And(idx >= 0, idx < slots)
            page = T.if_then_else(ok, idx // rows, 0)
            row = T.if_then_else(ok, idx % rows, 0)
            ok_s[j] = T.if_then_else(ok, 1, 0)
            base_s[j] = page * stride16 + row * ROW16
            scale_at_s[j] = (page * stride16) * 16 + rows * L.DATA_BYTES + row * L.SCALE_BYTES

    @T.macro
    def gather(KV_s, scale_s, base_s, scale_at_s, ok_s, C8, CH, CS):
        """Dequantise the tile's rows into ``KV_s`` (invalid rows: zeros, nothing read)."""
        for j, g in T.Parallel(BN, L.NUM_TILES):
            scale_s[j, g] = T.if_then_else(ok_s[j] > 0, T.exp2(T.Cast(ACC, CS[scale_at_s[j] + g]) - 127.0), 0.0)
        for j, d in T.Parallel(BN, L.D_NOPE):
            KV_s[j, d] = T.if_then_else(
                ok_s[j] > 0, T.Cast(q_dtype, T.Cast(ACC, C8[base_s[j] * 16 + d]) * scale_s[j, d // L.TILE]),
                T.Cast(q_dtype, 0))
        for j, d in T.Parallel(BN, L.D_ROPE):
            KV_s[j, L.D_NOPE + d] = T.if_then_else(ok_s[j] > 0, CH[base_s[j] * 8 + ROPE_AT + d], T.Cast(q_dtype, 0))

    @T.prim_func
    def sparse_mqa(
        Q: T.Tensor((NT, H, D), q_dtype),
        C8: T.Tensor((NB1,), "float8_e4m3"),
        CH: T.Tensor((NH1,), "bfloat16"),
        CS: T.Tensor((NB1,), "uint8"),
        I1: T.Tensor((NT, K1), "int32"),
        L1: T.Tensor((NT,), "int32"),
        X8: T.Tensor((NB2,), "float8_e4m3"),
        XH: T.Tensor((NH2,), "bfloat16"),
        XS: T.Tensor((NB2,), "uint8"),
        I2: T.Tensor((NT, K2), "int32"),
        L2: T.Tensor((NT,), "int32"),
        sinks: T.Tensor((H,), "float32"),
        sm_scale: T.float32,
        rows1: T.int32,
        stride1: T.int32,
        slots1: T.int32,
        rows2: T.int32,
        stride2: T.int32,
        slots2: T.int32,
        num_splits: T.int32,
        O: T.Tensor(O_shape, ACC if split else q_dtype),
        LSE: T.Tensor(L_shape, "float32"),
    ):
        with T.Kernel(num_splits, head_blocks, NT, threads=threads) as (bs, bh, bt):
            Q_s = T.alloc_shared([BH, D], q_dtype)
            KV_s = T.alloc_shared([BN, D], q_dtype)
            P_s = T.alloc_shared([BH, BN], q_dtype) if shared_p else None
            scale_s = T.alloc_shared([BN, L.NUM_TILES], ACC)
            base_s = T.alloc_shared([BN], "int32", scope="shared")
            scale_at_s = T.alloc_shared([BN], "int32", scope="shared")
            ok_s = T.alloc_shared([BN], "int32", scope="shared")
            state = alloc_state()
            tiles = Tiles(Q_s, KV_s, KV_s, None, None, P_s)
            t = bt
            h0 = bh * BH
            scale_log2 = sm_scale * LOG2E

            n1 = T.ceildiv(T.max(T.min(L1[t], K1), 0), BN)
            n2 = T.ceildiv(T.max(T.min(L2[t], K2), 0), BN) if has_extra else 0
            per_split = T.ceildiv(n1 + n2, num_splits)
            it_lo = bs * per_split
            n_iters = T.max(T.min(per_split, n1 + n2 - it_lo), 0)

            for h, d in T.Parallel(BH, D):
                Q_s[h, d] = T.if_then_else(h0 + h < H, Q[t, T.min(h0 + h, H - 1), d], T.Cast(q_dtype, 0))
            T.fill(state.acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)

            for it in T.serial(n_iters):
                g = it_lo + it
                if g < n1:
                    resolve(base_s, scale_at_s, ok_s, I1, L1, t, g * BN, K1, slots1, rows1, stride1)
                    gather(KV_s, scale_s, base_s, scale_at_s, ok_s, C8, CH, CS)
                else:
                    resolve(base_s, scale_at_s, ok_s, I2, L2, t, (g - n1) * BN, K2, slots2, rows2, stride2)
                    gather(KV_s, scale_s, base_s, scale_at_s, ok_s, X8, XH, XS)
                acc_s = state.acc_s
                T.clear(acc_s)
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for h, j in T.Parallel(BH, BN):
                    acc_s[h, j] = T.if_then_else(ok_s[j] > 0, acc_s[h, j], NEG_INF)
                softmax_step(state, scale_log2, True, P_s)
                pv_product(state, tiles, T.GemmWarpPolicy.FullRow)

            finish_rows(state, scale_log2, sinks, lambda h: h, False)  # alpha <- log2 LSE without the sink
            acc_o, l_i, m_i, lse2 = state.acc_o, state.l_i, state.m_i, state.alpha
            if split:
                for h, d in T.Parallel(BH, D):
                    if h0 + h < H:
                        O[bs, t, h0 + h, d] = T.if_then_else(l_i[h] == 0.0, 0.0, acc_o[h, d] / l_i[h])
                for h in T.Parallel(BH):
                    if h0 + h < H:
                        LSE[bs, t, h0 + h] = lse2[h]
            else:
                den = state.row_sum
                for h in T.Parallel(BH):
                    if has_sink:
                        den[h] = l_i[h] + T.if_then_else(
                            m_i[h] == NEG_INF, 0.0,
                            T.exp2(sinks[T.min(h0 + h, H - 1)] * LOG2E - m_i[h] * scale_log2))
                    else:
                        den[h] = l_i[h]
                for h, d in T.Parallel(BH, D):
                    if h0 + h < H:
                        O[t, h0 + h, d] = T.Cast(q_dtype, T.if_then_else(l_i[h] == 0.0, 0.0, acc_o[h, d] / den[h]))
                for h in T.Parallel(BH):
                    if h0 + h < H:
                        LSE[t, h0 + h] = lse2[h] / LOG2E

    return sparse_mqa
