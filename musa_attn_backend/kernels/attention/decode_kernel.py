"""TileLang split-KV decode program: one block per (KV split, KV head, request), the rows of a block are the
(token, query head) pairs of one KV head (conventions: :mod:`.tl_common`)."""

import functools

from ..._tilelang import tl_lang as T
from .tl_common import (ACC, LOG2E, NEG_INF, SLOT_TILES, Tiles, attention_macros, paged_program, paged_sizes,
                        qk_product, request_rows, slot_buffer, slot_row, visible)


@functools.lru_cache(maxsize=None)
def build_decode(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, kv_dtype: str, max_q: int,
                 has_window: bool, has_softcap: bool, has_sinks: bool, is_fp8: bool, split: bool,
                 k_layout: tuple, v_layout: tuple,
                 block_M: int = 64, block_N: int = 64, num_stages: int = 2, threads: int = 128,
                 slot_tiles: int = SLOT_TILES, full_runs: bool = False, pdl: bool = False,
                 shared_p: bool = False, d_parts: tuple = ()):
    """Split-KV decode (and short causal queries, up to ``max_q`` tokens per request, e.g. speculative verify).

    One block per (KV split, KV head, request); its rows are the ``max_q x G`` (token, query head) pairs that
    share the KV head, so each K/V tile is read once for the whole group. With ``split`` the block writes a
    partial (output normalised by its own sum, LSE in log2 units) for :func:`.combine_kernel.build_combine`;
    without it, the final output. ``slot_tiles``: tiles whose cache rows are resolved together; the copy
    pipeline restarts after each such run. 0: the copies resolve each row themselves, in one pipeline over all
    the tiles. ``full_runs``: every run's pipeline has the fixed trip count ``slot_tiles`` (TileLang lowers 3+
    stages only for a fixed count); tiles past the split's end are fully masked, their rows zero-filled (no
    memory traffic). ``pdl`` (split only): trigger the dependent launch of the combine kernel (programmatic
    dependent launch) as the block starts, so the combine's launch overlaps this kernel's last wave.
    ``shared_p``: the probabilities go through a shared tile to the ``P V`` product (targets whose GEMMs take
    no register A operand; the 16-row tiling always does), else they stay in registers. ``d_parts``: the head
    dim cut in two, as in :func:`.prefill_kernel.build_prefill`.
    """
    G = Hq // Hkv
    rows = max_q * G
    BM, BN = block_M, block_N
    assert rows <= BM, f"{max_q} tokens x {G} heads do not fit a {BM}-row tile"
    sizes = paged_sizes()
    NT, B, _, MP = sizes
    SPLITS = T.dynamic("num_splits")  # leading dimension of the partials
    out_dtype = ACC if split else q_dtype
    # Fewer than 64 rows (e.g. 1 token x 4 heads): 16-row tiles on mma.sync with warps splitting the
    # columns, instead of 64-row warpgroup MMAs that are mostly padding.
    small = BM < 64
    policy = T.GemmWarpPolicy.FullCol if small else T.GemmWarpPolicy.FullRow
    # each warp of the 16-row tiling owns a column slice of the scores, and of the output in the second product:
    # P goes through shared memory between them
    shared_p = shared_p or small
    O_shape = (SPLITS, NT, Hq, DV) if split else (NT, Hq, DV)
    L_shape = (SPLITS, NT, Hq) if split else (NT, Hq)
    D1 = d_parts[0] if d_parts else D  # the first part of the head dim; D - D1 the second (0: not cut)
    assert sum(d_parts or (D,)) == D and len(d_parts) <= 2, d_parts
    alloc_state, resolve_slots, load_kv, softmax_step, pv_product, finish_rows = attention_macros(
        BM, BN, D, DV, k_layout[2], v_layout[2], is_fp8, q_dtype, slot_tiles, D1=D1)

    @T.macro
    def tile_step(tiles, state, n0, prefix, sk, window, logit_scale, softcap, scale_log2):
        """Scores, mask, online softmax and ``P V`` of the key tile from ``n0`` (its K/V rows are in the
        tiles)."""
        acc_s = state.acc_s
        T.clear(acc_s)
        qk_product(tiles, acc_s, policy)
        for r, j in T.Parallel(BM, BN):
            acc_s[r, j] = T.if_then_else(
                visible(n0 + j, prefix + r // G, sk, window, True, has_window),
                softcap * T.tanh(acc_s[r, j] * (logit_scale / softcap)) if has_softcap else acc_s[r, j],
                NEG_INF)
        # a split may hold only keys that some rows (earlier tokens, or a window) cannot see
        softmax_step(state, scale_log2, True, tiles.P_s)
        pv_product(state, tiles, policy)

    @T.macro
    def decode(Q, KC, VC, cu_seqlens_q, seqlens_k, page_table, sinks, k_scale, v_scale, sm_scale, softcap, window,
               page_size, num_splits, O, LSE):
        with T.Kernel(num_splits, Hkv, B, threads=threads) as (bs, bh, bb):
            if pdl:
                T.pdl_trigger()
            Q_s = T.alloc_shared([BM, D1], q_dtype)
            P_s = T.alloc_shared([BM, BN], q_dtype) if shared_p else None
            K_s = T.alloc_shared([BN, D1], q_dtype)
            V_s = T.alloc_shared([BN, DV], q_dtype)
            K8_s = T.alloc_shared([BN, D1], kv_dtype) if is_fp8 else None
            V8_s = T.alloc_shared([BN, DV], kv_dtype) if is_fp8 else None
            Q2_s = T.alloc_shared([BM, D - D1], q_dtype) if D1 < D else None
            K2_s = T.alloc_shared([BN, D - D1], q_dtype) if D1 < D else None
            K82_s = T.alloc_shared([BN, D - D1], kv_dtype) if is_fp8 and D1 < D else None
            slot_s = slot_buffer(slot_tiles * BN) if slot_tiles > 0 else None
            state = alloc_state()
            tiles = Tiles(Q_s, K_s, V_s, K8_s, V8_s, P_s, Q2_s, K2_s, K82_s)

            b = bb
            kvh = bh
            q0, qlen, sk, prefix = request_rows(cu_seqlens_q, seqlens_k, b)
            logit_scale = sm_scale * k_scale[kvh] if is_fp8 else sm_scale
            scale_log2 = LOG2E if has_softcap else logit_scale * LOG2E

            kv_lo = T.max(prefix - window, 0) if has_window else 0
            n_lo = kv_lo // BN
            n_total = T.max(T.ceildiv(sk, BN) - n_lo, 0)
            per_split = T.ceildiv(n_total, num_splits)
            it_lo = bs * per_split
            n_iters = T.max(T.min(per_split, n_total - it_lo), 0)

            # row r: token r // G of this request, query head kvh * G + r % G
            for r, d in T.Parallel(BM, D1):
                Q_s[r, d] = T.if_then_else(T.And(r < rows, r // G < qlen), Q[q0 + r // G, kvh * G + r % G, d],
                                           T.Cast(q_dtype, 0))
            if D1 < D:
                for r, d in T.Parallel(BM, D - D1):
                    Q2_s[r, d] = T.if_then_else(T.And(r < rows, r // G < qlen),
                                                Q[q0 + r // G, kvh * G + r % G, D1 + d], T.Cast(q_dtype, 0))
            T.fill(state.acc_o, 0)
            T.fill(state.l_i, 0)
            T.fill(state.m_i, NEG_INF)

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
                        load_kv(KC, VC, tiles, lambda j: slot_s[it * BN + j], kvh)
                        tile_step(tiles, state, n0, prefix, kv_end, window, logit_scale, softcap, scale_log2)
            else:
                # rows resolved inline by the copies (one page-table read per row, cached): one pipeline over
                # all the split's tiles, no restarts
                for it in T.Pipelined(n_iters, num_stages=num_stages):
                    n0 = (n_lo + it_lo + it) * BN
                    load_kv(KC, VC, tiles, lambda j: slot_row(page_table, b, n0 + j, sk, page_size, MP), kvh)
                    tile_step(tiles, state, n0, prefix, sk, window, logit_scale, softcap, scale_log2)

            finish_rows(state, scale_log2, sinks, lambda r: kvh * G + r % G, has_sinks and not split)
            out_scale = v_scale[kvh] if is_fp8 else 1.0
            acc_o, l_i, alpha = state.acc_o, state.l_i, state.alpha  # alpha: the row LSE
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

    return paged_program("decode", decode, sizes, Hq, Hkv, D, q_dtype, kv_dtype, k_layout, v_layout,
                         T.Tensor(O_shape, out_dtype), T.Tensor(L_shape, "float32"))
