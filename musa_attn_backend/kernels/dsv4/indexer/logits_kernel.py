"""TileLang indexer logits of DeepSeek-V4 (the math: :mod:`.reference`): FP8 query rows against FP8 keys,
``relu``, weighted sum over the heads, times the key's scale.

Both programs put the keys on the GEMM's M side and one token's heads on its N side
(``S[key, head] = k . q[head]``), so the sum over heads is a row reduction of the accumulator; a block reuses
each key tile for all its tokens, one GEMM per token. Every output element a block owns is written exactly once:
a computed logit inside its token's range, ``-inf`` outside (``clean``; else the columns outside are left as
they were). Key rows are read at clamped indices (never past the keys) and their results masked.

Both key loops run a block-dependent number of steps. TileLang 0.1.15 cannot pipeline such a loop over more than
one stage: its pipeline epilogue waits on a cp.async group count that depends on the loop variable, and CUDA code
generation rejects it (``cp.async.wait_group`` takes an immediate). So ``num_stages`` defaults to 1 (each step's
loads are still asynchronous); the blocks resident on an SM overlap one another's loads.
"""

import functools

from ...._tilelang import tl_lang as T
from .. import layout as L

ACC = "float32"
D = L.INDEX_D
FP8 = "float8_e4m3"


def tile_logits(NR: int, H: int, clean: bool):
    """The macro that computes a key tile's logits for ``NR`` query rows (``NR * H`` q rows in ``Q_s``, one GEMM:
    keys on M, rows x heads on N; the head sum a reduction of the accumulator seen as ``[keys, NR, H]``) and
    writes row ``r``'s: ``Out[row0 + r, col0 + n]`` for columns below ``ncols[r]``; inside ``[lo[r], hi[r])`` the
    logit, outside ``-inf`` (``clean``) or nothing; ``ok`` false: the tile's keys are not real (``-inf``
    wherever a row would have read them)."""
    NEG_INF = -T.infinity(ACC)

    @T.macro
    def write_tile(K_s, KS_s, Q_s, W_s, acc, logit, Out, row0, col0, lo, hi, ncols, ok):
        T.gemm(K_s, Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
        acc3 = T.reshape(acc, [acc.shape[0], NR, H])
        for n, r, h in T.Parallel(acc.shape[0], NR, H):
            acc3[n, r, h] = T.max(acc3[n, r, h], 0.0) * W_s[r, h]
        T.reduce_sum(acc3, logit, dim=2)
        for r, n in T.Parallel(NR, acc.shape[0]):
            col = col0 + n
            inside = T.And(col >= lo[r], col < hi[r])
            if col < ncols[r]:
                if clean:
                    Out[row0 + r, col] = T.if_then_else(T.And(inside, ok), logit[n, r] * KS_s[n], NEG_INF)
                elif inside:
                    Out[row0 + r, col] = T.if_then_else(ok, logit[n, r] * KS_s[n], NEG_INF)

    return write_tile


@functools.lru_cache(maxsize=None)
def build_indexer_logits(H: int, clean: bool, block_T: int = 2, block_N: int = 64, tiles: int = 8,
                         num_stages: int = 1, threads: int = 128):
    """Logits of ``Q [T * H, 128]`` against ``K [S, 128]`` for per-token key ranges ``[starts, ends)``. One block
    per (``tiles * block_N`` keys, ``block_T`` tokens): its tiles that meet some token's range run the GEMMs
    (pipelined), the others only write ``-inf`` (``clean``). The default tiling keeps the accumulator at 64
    registers a thread, so several blocks share an SM and one's epilogue overlaps another's GEMM."""
    BT, BN = block_T, block_N
    KB = BN * tiles
    write_tile = tile_logits(BT, H, clean)
    NT, S = T.dynamic("num_tokens"), T.dynamic("num_keys")
    NEG_INF = -T.infinity(ACC)

    @T.prim_func
    def indexer_logits(
        Q: T.Tensor((NT * H, D), FP8),
        W: T.Tensor((NT, H), ACC),
        K: T.Tensor((S, D), FP8),
        KS: T.Tensor((S,), ACC),
        starts: T.Tensor((NT,), "int32"),
        ends: T.Tensor((NT,), "int32"),
        Out: T.Tensor((NT, S), ACC),
    ):
        with T.Kernel(T.ceildiv(S, KB), T.ceildiv(NT, BT), threads=threads) as (bk, bt):
            Q_s = T.alloc_shared([BT * H, D], FP8)
            K_s = T.alloc_shared([BN, D], FP8)
            W_s = T.alloc_shared([BT, H], ACC)
            KS_s = T.alloc_shared([BN], ACC)
            lo_s = T.alloc_shared([BT], "int32", scope="shared")  # each token's range, cut to [0, S)
            hi_s = T.alloc_shared([BT], "int32", scope="shared")
            nc_s = T.alloc_shared([BT], "int32", scope="shared")  # its columns: S, or 0 past the tokens
            acc = T.alloc_fragment([BN, BT * H], ACC)
            logit = T.alloc_fragment([BN, BT], ACC)
            t0 = bt * BT
            key0 = bk * KB

            for i in T.Parallel(BT):
                real = t0 + i < NT
                lo_s[i] = T.if_then_else(real, T.max(starts[T.min(t0 + i, NT - 1)], 0), S)
                hi_s[i] = T.if_then_else(real, T.min(ends[T.min(t0 + i, NT - 1)], S), 0)
                nc_s[i] = T.if_then_else(real, S, 0)
            for i, h in T.Parallel(BT, H):
                W_s[i, h] = T.if_then_else(t0 + i < NT, W[T.min(t0 + i, NT - 1), h], 0.0)
            for r, d in T.Parallel(BT * H, D):  # rows past the tokens repeat the last token's (their writes are cut)
                Q_s[r, d] = Q[T.min(t0 * H + r, NT * H - 1), d]
            # the block's tiles that meet the union of its tokens' ranges: [it_lo, it_hi) of its `tiles`
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            lo = S
            hi = 0
            for i in T.serial(BT):
                if lo_s[i] < hi_s[i]:
                    lo = T.min(lo, lo_s[i])
                    hi = T.max(hi, hi_s[i])
            it_lo = T.max(T.min(T.floordiv(lo - key0, BN), tiles), 0)
            it_hi = T.max(T.min(T.ceildiv(T.max(hi - key0, 0), BN), tiles), it_lo)

            for it in T.Pipelined(it_hi - it_lo, num_stages=num_stages):
                n0 = key0 + (it_lo + it) * BN
                for n, d in T.Parallel(BN, D):
                    K_s[n, d] = K[T.min(n0 + n, S - 1), d]
                for n in T.Parallel(BN):
                    KS_s[n] = KS[T.min(n0 + n, S - 1)]
                write_tile(K_s, KS_s, Q_s, W_s, acc, logit, Out, t0, n0, lo_s, hi_s, nc_s, True)
            if clean:
                for it in T.serial(tiles):
                    if T.Or(it < it_lo, it >= it_hi):
                        for i, n in T.Parallel(BT, BN):
                            if T.And(t0 + i < NT, key0 + it * BN + n < S):
                                Out[t0 + i, key0 + it * BN + n] = NEG_INF

    return indexer_logits


@functools.lru_cache(maxsize=None)
def build_paged_indexer_logits(H: int, next_n: int, clean: bool, num_stages: int = 1, threads: int = 128):
    """Logits of ``Q [B * next_n * H, 128]`` against the paged indexer keys: one block per (split, request),
    one 64-key page per step. The cache comes in as views of its storage from its first byte (``C8 [units, 16]``
    e4m3 in 16-byte units, ``CF [words]`` float32); page ``p``'s keys start at unit ``p * stride16``, their
    scales at word ``p * stride16 * 4 + 64 * 128 / 4``. Request ``b``'s rows ``j`` see ``Lens[b * next_n + j]``
    keys (cut to ``max_len``); its block of pages ``[0, ceil(max length / 64))`` is split ``num_splits`` ways.
    A page entry outside ``[0, num_pages)`` reads page 0 and its logits are ``-inf``."""
    R = 64
    write_tile = tile_logits(next_n, H, clean)
    NB, P = T.dynamic("batch"), T.dynamic("table_width")
    NU, NF, ML = T.dynamic("cache_units16", "int64"), T.dynamic("cache_words", "int64"), T.dynamic("max_len")
    NEG_INF = -T.infinity(ACC)
    scale_words = R * D // 4

    @T.prim_func
    def paged_indexer_logits(
        Q: T.Tensor((NB * next_n * H, D), FP8),
        W: T.Tensor((NB * next_n, H), ACC),
        C8: T.Tensor((NU, 16), FP8),
        CF: T.Tensor((NF,), ACC),
        Lens: T.Tensor((NB * next_n,), "int32"),
        table: T.Tensor((NB, P), "int32"),
        stride16: T.int64,
        num_pages: T.int32,
        num_splits: T.int32,
        Out: T.Tensor((NB * next_n, ML), ACC),
    ):
        with T.Kernel(num_splits, NB, threads=threads) as (bs, b):
            Q_s = T.alloc_shared([next_n * H, D], FP8)
            K_s = T.alloc_shared([R, D], FP8)
            W_s = T.alloc_shared([next_n, H], ACC)
            KS_s = T.alloc_shared([R], ACC)
            zero_s = T.alloc_shared([next_n], "int32", scope="shared")
            len_s = T.alloc_shared([next_n], "int32", scope="shared")
            ml_s = T.alloc_shared([next_n], "int32", scope="shared")
            acc = T.alloc_fragment([R, next_n * H], ACC)
            logit = T.alloc_fragment([R, next_n], ACC)
            row0 = b * next_n

            for j in T.Parallel(next_n):
                len_s[j] = T.max(T.min(Lens[row0 + j], ML), 0)
                zero_s[j] = 0
                ml_s[j] = ML
            for j, h in T.Parallel(next_n, H):
                W_s[j, h] = W[row0 + j, h]
            for r, d in T.Parallel(next_n * H, D):
                Q_s[r, d] = Q[row0 * H + r, d]
            n_max = T.alloc_var("int32")
            n_max = 0
            for j in T.serial(next_n):
                n_max = T.max(n_max, len_s[j])
            n_pages = T.ceildiv(n_max, R)
            per_split = T.ceildiv(n_pages, num_splits)
            p_lo = T.min(bs * per_split, n_pages)
            p_hi = T.min(p_lo + per_split, n_pages)

            for it in T.Pipelined(p_hi - p_lo, num_stages=num_stages):
                p = p_lo + it
                entry = table[b, p]
                ok = T.And(entry >= 0, entry < num_pages)
                page = T.if_then_else(ok, entry, 0)
                for n, d in T.Parallel(R, D):
                    K_s[n, d] = C8[page * stride16 + n * (D // 16) + d // 16, d % 16]
                for n in T.Parallel(R):
                    KS_s[n] = CF[page * stride16 * 4 + scale_words + n]
                write_tile(K_s, KS_s, Q_s, W_s, acc, logit, Out, row0, p * R, zero_s, len_s, ml_s, ok)
            if clean:  # the columns past the pages any row reads, shared out over the splits
                tail = T.max(ML - n_pages * R, 0)
                per = T.ceildiv(tail, num_splits)
                for c in T.serial(T.ceildiv(per, threads)):
                    for j, x in T.Parallel(next_n, threads):
                        col = n_pages * R + bs * per + c * threads + x
                        if T.And(c * threads + x < per, col < ML):
                            Out[row0 + j, col] = NEG_INF

    return paged_indexer_logits
