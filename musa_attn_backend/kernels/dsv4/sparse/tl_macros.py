"""TileLang macros of the portable sparse MQA program (:mod:`.mqa_kernel`): the
split's range of key tiles and the output epilogue."""

from typing import Any, NamedTuple

from ...._tilelang import tl_lang as T
from ...attention.tl_common import ACC, LOG2E


class SplitTiles(NamedTuple):
    """The key tiles a block visits: ``n_iters`` tiles from tile ``it_lo`` of the token's list (the main set's
    ``n1`` tiles, then the extra set's)."""

    n1: Any
    it_lo: Any
    n_iters: Any


def sparse_macros(H: int, BH: int, BN: int, has_extra: bool, has_sink: bool, split: bool, q_dtype: str, K1, K2):
    """``(split_tiles, store_output)`` for ``H`` heads in blocks of ``BH``, ``BN``-entry key tiles, index lists of
    ``K1`` / ``K2`` entries (the programs' dynamic sizes)."""
    NEG_INF = -T.infinity(ACC)

    @T.macro
    def split_tiles(L1, L2, t, bs, num_splits):
        """Token ``t``'s valid entries in ``BN``-entry tiles, split ``num_splits`` ways; split ``bs``'s share."""
        n1 = T.ceildiv(T.max(T.min(L1[t], K1), 0), BN)
        n2 = T.ceildiv(T.max(T.min(L2[t], K2), 0), BN) if has_extra else 0
        per_split = T.ceildiv(n1 + n2, num_splits)
        it_lo = bs * per_split
        return SplitTiles(n1, it_lo, T.max(T.min(per_split, n1 + n2 - it_lo), 0))

    @T.macro
    def store_output(state, O, LSE, sinks, scale_log2, t, bs, h0, col0, width, write_lse):
        """Output columns ``col0 .. col0 + width`` of heads ``h0 ..`` (rows past ``H`` not written) from the state
        :func:`finish_rows` left (``alpha``: the log2 LSE without the sink), and the LSE if ``write_lse``. Split:
        the partial output normalised by its own sum, the LSE in log2 units; else the final output (the sink in
        the denominator) and the natural-log LSE."""
        acc_o, l_i, m_i, lse2 = state.acc_o, state.l_i, state.m_i, state.alpha
        if split:
            for h, d in T.Parallel(BH, width):
                if h0 + h < H:
                    O[bs, t, h0 + h, col0 + d] = T.if_then_else(l_i[h] == 0.0, 0.0, acc_o[h, d] / l_i[h])
            if write_lse:
                for h in T.Parallel(BH):
                    if h0 + h < H:
                        LSE[bs, t, h0 + h] = lse2[h]
        else:
            den = state.row_sum
            for h in T.Parallel(BH):
                if has_sink:
                    den[h] = l_i[h] + T.if_then_else(
                        m_i[h] == NEG_INF, 0.0, T.exp2(sinks[T.min(h0 + h, H - 1)] * LOG2E - m_i[h] * scale_log2))
                else:
                    den[h] = l_i[h]
            for h, d in T.Parallel(BH, width):
                if h0 + h < H:
                    O[t, h0 + h, col0 + d] = T.Cast(q_dtype,
                                                    T.if_then_else(l_i[h] == 0.0, 0.0, acc_o[h, d] / den[h]))
            if write_lse:
                for h in T.Parallel(BH):
                    if h0 + h < H:
                        LSE[t, h0 + h] = lse2[h] / LOG2E

    return split_tiles, store_output


class WorkspaceArgs(NamedTuple):
    """The tensor types of a program over a bf16 workspace (:mod:`.paired_ws_kernel`, :mod:`.portable_ws_kernel`,
    :mod:`.staged_ws_kernel`: one signature, so one launch, ``tilelang_impl._launch_ws``): the query ``Q [NT, H,
    512]``, the workspace rows ``W [R, 512]`` (bf16), each token's list ``I [NT, K]`` and length ``Ln [NT]``, the
    sinks, and the outputs ``O``, ``LSE`` and ``MaxL``; beside them ``sm_scale`` and ``empty_lse`` (float32 scalars).
    ``NT``, ``K``, ``R``: the dynamic sizes."""

    Q: Any
    W: Any
    I: Any
    Ln: Any
    sinks: Any
    O: Any
    LSE: Any
    MaxL: Any
    NT: Any
    K: Any
    R: Any


def workspace_args(H: int, q_dtype: str, D: int) -> WorkspaceArgs:
    NT, K, R = T.dynamic("num_tokens"), T.dynamic("ws_topk"), T.dynamic("ws_rows")
    return WorkspaceArgs(T.Tensor((NT, H, D), q_dtype), T.Tensor((R, D), "bfloat16"), T.Tensor((NT, K), "int32"),
                         T.Tensor((NT,), "int32"), T.Tensor((H,), "float32"), T.Tensor((NT, H, D), q_dtype),
                         T.Tensor((NT, H), "float32"), T.Tensor((NT, H), "float32"), NT, K, R)
