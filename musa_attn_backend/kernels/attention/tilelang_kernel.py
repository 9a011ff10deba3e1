"""TileLang programs for paged attention: prefill/extend, split-KV decode and the split combine.

Conventions shared by the three programs:

* K/V caches are strided ``[num_pages, page_size, num_kv_heads, head_dim]`` tensors (unit stride on the head
  dim only), so SGLang's pools and vLLM's views of one K|V buffer are read in place. Keys are gathered
  row by row through the page table, which serves every page size (1 .. 128+).
* Softmax runs in base 2: logits are multiplied by ``scale_log2`` (``sm_scale * k_scale * log2(e)``, or
  ``log2(e)`` after a softcap, which works in natural units) and exponentiated with ``exp2``.
* An FP8 cache is converted to the query dtype while it is staged in shared memory; its per-head scales
  are folded into the logit scale (K) and the output (V), so the matmuls stay in bf16/fp16.
* LSE outputs are natural-log; partial LSEs of split-KV are kept in log2 units.

No ``from __future__ import annotations`` here: TileLang evaluates the prim_func annotations.
"""

import functools

from ..._tilelang import tl_lang as T

LOG2E = 1.4426950408889634
ACC = "float32"


def _kv_tensors(Hkv, D, DV, kv_dtype):
    """Strided paged caches; the page size is a runtime value (one kernel serves every page size)."""
    NP = T.dynamic("num_pages")
    P = T.dynamic("page_size")
    ks = [T.dynamic(f"k_stride_{i}", "int64") for i in range(3)]
    vs = [T.dynamic(f"v_stride_{i}", "int64") for i in range(3)]
    k_t = T.StridedTensor((NP, P, Hkv, D), (ks[0], ks[1], ks[2], 1), kv_dtype)
    v_t = T.StridedTensor((NP, P, Hkv, DV), (vs[0], vs[1], vs[2], 1), kv_dtype)
    return k_t, v_t, P


def _visible(kpos, qpos, sk, window, causal: bool, has_window: bool):
    """Key at ``kpos`` is inside the sequence, not in the future (causal) and inside the left window."""
    v = kpos < sk
    if causal:
        v = T.And(v, kpos <= qpos)
    if has_window:
        v = T.And(v, kpos >= qpos - window)
    return v


@functools.lru_cache(maxsize=None)
def build_prefill(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, kv_dtype: str, causal: bool,
                  has_window: bool, has_softcap: bool, has_sinks: bool, is_fp8: bool,
                  block_M: int = 128, block_N: int = 128, num_stages: int = 2, threads: int = 256):
    """Varlen prefill/extend: one block per (query tile of one request, query head)."""
    G = Hq // Hkv
    NT = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    B1 = T.dynamic("batch_plus_1")
    MP = T.dynamic("max_pages")
    KT, VT, P = _kv_tensors(Hkv, D, DV, kv_dtype)
    NEG_INF = -T.infinity(ACC)

    @T.prim_func
    def prefill(
        Q: T.Tensor((NT, Hq, D), q_dtype),
        KC: KT,
        VC: VT,
        cu_seqlens_q: T.Tensor((B1,), "int32"),
        seqlens_k: T.Tensor((B,), "int32"),
        page_table: T.Tensor((B, MP), "int32"),
        sinks: T.Tensor((Hq,), "float32"),
        k_scale: T.Tensor((Hkv,), "float32"),
        v_scale: T.Tensor((Hkv,), "float32"),
        sm_scale: T.float32,
        softcap: T.float32,
        window: T.int32,
        max_seqlen_q: T.int32,
        O: T.Tensor((NT, Hq, DV), q_dtype),
        LSE: T.Tensor((NT, Hq), "float32"),
    ):
        with T.Kernel(T.ceildiv(max_seqlen_q, block_M), Hq, B, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([block_M, D], q_dtype)
            K_s = T.alloc_shared([block_N, D], q_dtype)
            V_s = T.alloc_shared([block_N, DV], q_dtype)
            acc_s = T.alloc_fragment([block_M, block_N], ACC)
            acc_p = T.alloc_fragment([block_M, block_N], q_dtype)
            acc_o = T.alloc_fragment([block_M, DV], ACC)
            m_i = T.alloc_fragment([block_M], ACC)
            m_prev = T.alloc_fragment([block_M], ACC)
            m_tile = T.alloc_fragment([block_M], ACC)
            alpha = T.alloc_fragment([block_M], ACC)
            row_sum = T.alloc_fragment([block_M], ACC)
            l_i = T.alloc_fragment([block_M], ACC)

            b = bz
            h = by
            kvh = h // G
            q0 = cu_seqlens_q[b]
            qlen = cu_seqlens_q[b + 1] - q0
            sk = seqlens_k[b]
            prefix = sk - qlen
            m0 = bx * block_M
            ksc = k_scale[kvh] if is_fp8 else T.float32(1.0)
            scale_log2 = LOG2E if has_softcap else sm_scale * ksc * LOG2E

            kv_hi = T.min(sk, prefix + m0 + block_M) if causal else sk
            kv_lo = T.max(prefix + m0 - window, 0) if has_window else 0
            n_lo = kv_lo // block_N
            n_iters = T.if_then_else(m0 < qlen, T.max(T.ceildiv(kv_hi, block_N) - n_lo, 0), 0)

            for i, d in T.Parallel(block_M, D):
                Q_s[i, d] = T.if_then_else(m0 + i < qlen, Q[q0 + m0 + i, h, d], T.Cast(q_dtype, 0))
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, NEG_INF)

            for it in T.Pipelined(n_iters, num_stages=num_stages):
                n0 = (n_lo + it) * block_N
                for j, d in T.Parallel(block_N, D):
                    K_s[j, d] = T.if_then_else(
                        n0 + j < sk,
                        T.Cast(q_dtype, KC[page_table[b, (n0 + j) // P], (n0 + j) % P, kvh, d]),
                        T.Cast(q_dtype, 0))
                T.clear(acc_s)
                T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if has_softcap:
                    for i, j in T.Parallel(block_M, block_N):
                        acc_s[i, j] = softcap * T.tanh(acc_s[i, j] * (sm_scale * ksc / softcap))
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.if_then_else(_visible(n0 + j, prefix + m0 + i, sk, window, causal, has_window),
                                                 acc_s[i, j], NEG_INF)
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_tile, dim=1, clear=True)
                for i in T.Parallel(block_M):
                    m_i[i] = T.max(m_prev[i], m_tile[i])
                for i in T.Parallel(block_M):
                    alpha[i] = T.if_then_else(m_i[i] == NEG_INF, 1.0,
                                              T.exp2((m_prev[i] - m_i[i]) * scale_log2))
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.if_then_else(m_i[i] == NEG_INF, 0.0,
                                                 T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2))
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_M):
                    l_i[i] = l_i[i] * alpha[i] + row_sum[i]
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_M, DV):
                    acc_o[i, d] *= alpha[i]
                for j, d in T.Parallel(block_N, DV):
                    V_s[j, d] = T.if_then_else(
                        n0 + j < sk,
                        T.Cast(q_dtype, VC[page_table[b, (n0 + j) // P], (n0 + j) % P, kvh, d]),
                        T.Cast(q_dtype, 0))
                T.gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # Epilogue: the sink joins the denominator; LSE in natural log.
            for i in T.Parallel(block_M):
                m_tile[i] = m_i[i] * scale_log2  # running max, log2 units
                if has_sinks:
                    row_sum[i] = T.if_then_else(
                        m_i[i] == NEG_INF, 0.0, T.exp2(sinks[h] * LOG2E - m_i[i] * scale_log2))
                    # all keys masked: only the sink remains, the output is 0
                    alpha[i] = T.if_then_else(m_i[i] == NEG_INF, sinks[h] * LOG2E,
                                              T.log2(l_i[i] + row_sum[i]) + m_tile[i])
                    l_i[i] = l_i[i] + row_sum[i]
                else:
                    alpha[i] = T.if_then_else(l_i[i] == 0.0, NEG_INF, T.log2(l_i[i]) + m_tile[i])
            vsc = v_scale[kvh] if is_fp8 else T.float32(1.0)
            for i, d in T.Parallel(block_M, DV):
                if m0 + i < qlen:
                    O[q0 + m0 + i, h, d] = T.Cast(
                        q_dtype, T.if_then_else(l_i[i] == 0.0, 0.0, acc_o[i, d] * vsc / l_i[i]))
            for i in T.Parallel(block_M):
                if m0 + i < qlen:
                    LSE[q0 + m0 + i, h] = alpha[i] / LOG2E

    return prefill


@functools.lru_cache(maxsize=None)
def build_decode(Hq: int, Hkv: int, D: int, DV: int, q_dtype: str, kv_dtype: str, max_q: int,
                 has_window: bool, has_softcap: bool, has_sinks: bool, is_fp8: bool, split: bool,
                 block_M: int = 64, block_N: int = 64, num_stages: int = 2, threads: int = 128):
    """Split-KV decode (and short causal queries, up to ``max_q`` tokens per request, e.g. speculative verify).

    One block per (KV split, KV head, request); its rows are the ``max_q x G`` (token, query head) pairs that
    share the KV head, so each K/V tile is read once for the whole group. With ``split`` the block writes an
    unnormalised partial (output normalised by its own sum, LSE in log2 units) for :func:`build_combine`;
    without it, the final output.
    """
    G = Hq // Hkv
    rows = max_q * G
    assert rows <= block_M, f"{max_q} tokens x {G} heads do not fit a {block_M}-row tile"
    NT = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    B1 = T.dynamic("batch_plus_1")
    MP = T.dynamic("max_pages")
    S = T.dynamic("num_splits")
    KT, VT, P = _kv_tensors(Hkv, D, DV, kv_dtype)
    NEG_INF = -T.infinity(ACC)
    out_dtype = ACC if split else q_dtype
    O_shape = (S, NT, Hq, DV) if split else (NT, Hq, DV)
    L_shape = (S, NT, Hq) if split else (NT, Hq)

    @T.prim_func
    def decode(
        Q: T.Tensor((NT, Hq, D), q_dtype),
        KC: KT,
        VC: VT,
        cu_seqlens_q: T.Tensor((B1,), "int32"),
        seqlens_k: T.Tensor((B,), "int32"),
        page_table: T.Tensor((B, MP), "int32"),
        sinks: T.Tensor((Hq,), "float32"),
        k_scale: T.Tensor((Hkv,), "float32"),
        v_scale: T.Tensor((Hkv,), "float32"),
        sm_scale: T.float32,
        softcap: T.float32,
        window: T.int32,
        num_splits: T.int32,
        O: T.Tensor(O_shape, out_dtype),
        LSE: T.Tensor(L_shape, "float32"),
    ):
        with T.Kernel(num_splits, Hkv, B, threads=threads) as (bs, bh, bb):
            Q_s = T.alloc_shared([block_M, D], q_dtype)
            K_s = T.alloc_shared([block_N, D], q_dtype)
            V_s = T.alloc_shared([block_N, DV], q_dtype)
            acc_s = T.alloc_fragment([block_M, block_N], ACC)
            acc_p = T.alloc_fragment([block_M, block_N], q_dtype)
            acc_o = T.alloc_fragment([block_M, DV], ACC)
            m_i = T.alloc_fragment([block_M], ACC)
            m_prev = T.alloc_fragment([block_M], ACC)
            m_tile = T.alloc_fragment([block_M], ACC)
            alpha = T.alloc_fragment([block_M], ACC)
            row_sum = T.alloc_fragment([block_M], ACC)
            l_i = T.alloc_fragment([block_M], ACC)

            b = bb
            kvh = bh
            q0 = cu_seqlens_q[b]
            qlen = cu_seqlens_q[b + 1] - q0
            sk = seqlens_k[b]
            prefix = sk - qlen
            ksc = k_scale[kvh] if is_fp8 else T.float32(1.0)
            scale_log2 = LOG2E if has_softcap else sm_scale * ksc * LOG2E

            kv_lo = T.max(prefix - window, 0) if has_window else 0
            n_lo = kv_lo // block_N
            n_total = T.max(T.ceildiv(sk, block_N) - n_lo, 0)
            per_split = T.ceildiv(n_total, num_splits)
            it_lo = bs * per_split
            n_iters = T.max(T.min(per_split, n_total - it_lo), 0)

            # row r = token (r // G) of this request, query head kvh * G + (r % G)
            for r, d in T.Parallel(block_M, D):
                Q_s[r, d] = T.if_then_else(r < rows and r // G < qlen, Q[q0 + r // G, kvh * G + r % G, d],
                                           T.Cast(q_dtype, 0))
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, NEG_INF)

            for it in T.Pipelined(n_iters, num_stages=num_stages):
                n0 = (n_lo + it_lo + it) * block_N
                for j, d in T.Parallel(block_N, D):
                    K_s[j, d] = T.if_then_else(
                        n0 + j < sk,
                        T.Cast(q_dtype, KC[page_table[b, (n0 + j) // P], (n0 + j) % P, kvh, d]),
                        T.Cast(q_dtype, 0))
                T.clear(acc_s)
                T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if has_softcap:
                    for r, j in T.Parallel(block_M, block_N):
                        acc_s[r, j] = softcap * T.tanh(acc_s[r, j] * (sm_scale * ksc / softcap))
                for r, j in T.Parallel(block_M, block_N):
                    acc_s[r, j] = T.if_then_else(_visible(n0 + j, prefix + r // G, sk, window, True, has_window),
                                                 acc_s[r, j], NEG_INF)
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_tile, dim=1, clear=True)
                for r in T.Parallel(block_M):
                    m_i[r] = T.max(m_prev[r], m_tile[r])
                for r in T.Parallel(block_M):
                    alpha[r] = T.if_then_else(m_i[r] == NEG_INF, 1.0,
                                              T.exp2((m_prev[r] - m_i[r]) * scale_log2))
                for r, j in T.Parallel(block_M, block_N):
                    acc_s[r, j] = T.if_then_else(m_i[r] == NEG_INF, 0.0,
                                                 T.exp2(acc_s[r, j] * scale_log2 - m_i[r] * scale_log2))
                T.reduce_sum(acc_s, row_sum, dim=1)
                for r in T.Parallel(block_M):
                    l_i[r] = l_i[r] * alpha[r] + row_sum[r]
                T.copy(acc_s, acc_p)
                for r, d in T.Parallel(block_M, DV):
                    acc_o[r, d] *= alpha[r]
                for j, d in T.Parallel(block_N, DV):
                    V_s[j, d] = T.if_then_else(
                        n0 + j < sk,
                        T.Cast(q_dtype, VC[page_table[b, (n0 + j) // P], (n0 + j) % P, kvh, d]),
                        T.Cast(q_dtype, 0))
                T.gemm(acc_p, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            vsc = v_scale[kvh] if is_fp8 else T.float32(1.0)
            for r in T.Parallel(block_M):
                m_tile[r] = m_i[r] * scale_log2
                if has_sinks and not split:
                    row_sum[r] = T.if_then_else(
                        m_i[r] == NEG_INF, 0.0,
                        T.exp2(sinks[kvh * G + r % G] * LOG2E - m_i[r] * scale_log2))
                    alpha[r] = T.if_then_else(m_i[r] == NEG_INF, sinks[kvh * G + r % G] * LOG2E,
                                              T.log2(l_i[r] + row_sum[r]) + m_tile[r])
                    l_i[r] = l_i[r] + row_sum[r]
                else:
                    alpha[r] = T.if_then_else(l_i[r] == 0.0, NEG_INF, T.log2(l_i[r]) + m_tile[r])
            for r, d in T.Parallel(block_M, DV):
                if r < rows and r // G < qlen:
                    if split:
                        O[bs, q0 + r // G, kvh * G + r % G, d] = T.if_then_else(
                            l_i[r] == 0.0, 0.0, acc_o[r, d] * vsc / l_i[r])
                    else:
                        O[q0 + r // G, kvh * G + r % G, d] = T.Cast(
                            q_dtype, T.if_then_else(l_i[r] == 0.0, 0.0, acc_o[r, d] * vsc / l_i[r]))
            for r in T.Parallel(block_M):
                if r < rows and r // G < qlen:
                    if split:
                        LSE[bs, q0 + r // G, kvh * G + r % G] = alpha[r]
                    else:
                        LSE[q0 + r // G, kvh * G + r % G] = alpha[r] / LOG2E

    return decode


@functools.lru_cache(maxsize=None)
def build_combine(Hq: int, DV: int, q_dtype: str, has_sinks: bool, threads: int = 128):
    """Merge split-KV partials: ``O = sum_s 2^(lse_s - lse) o_s`` with ``lse = log2 sum_s 2^lse_s`` (+ sink)."""
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
            acc = T.alloc_fragment([DV], ACC)
            m = T.alloc_var(ACC)
            total = T.alloc_var(ACC)
            w = T.alloc_var(ACC)
            m = NEG_INF
            for s in T.serial(S):
                m = T.max(m, L_part[s, t, h])
            if has_sinks:
                m = T.max(m, sinks[h] * LOG2E)
            total = 0.0
            T.fill(acc, 0)
            if m != NEG_INF:
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
