"""TileLang programs of V4's model-side row ops (the math: :mod:`.model`).

``build_norm_rope``: one block per (token, head) row of ``D`` values, thread ``x`` owning dim ``x``: an optional
RMS norm (a shared-memory tree for the sum of squares, with or without a weight), optional rounding to bf16, then
GPT-J RoPE of the last 64 dims at the token's position (or its inverse), rounded to the output dtype. It serves
the q head norm + RoPE, the bf16 K path's norm + RoPE, the inverse RoPE of the attention output (``D`` = 64, no
norm) and the SWA store's norm + RoPE before the FP8 writer.

``build_silu_mul_clamp``: the clamped SwiGLU, ``[M, 2I] -> [M, I]``, 256 columns a block.

Both read contiguous inputs and write contiguous outputs (the launch glue copies from and to other strides); the
row counts are dynamic. Barriers are placed by hand: every thread of a block passes each one.
"""

import functools

from ...._tilelang import tl_lang as T

ACC = "float32"
ROPE = 64


@functools.lru_cache(maxsize=None)
def build_norm_rope(D: int, H: int, in_dtype: str, out_dtype: str, norm: str, round_mid: bool, inverse: bool):
    """``Y [T, H, D]`` from ``X [T, H, D]``. ``norm``: ``"none"``, ``"plain"`` (``x * rsqrt(mean(x^2) + eps)``) or
    ``"weight"`` (times ``weight [D]``); ``round_mid``: round the normed row to bf16 before the rotation."""
    assert norm in ("none", "plain", "weight") and D >= ROPE and D <= 1024 and D & (D - 1) == 0
    NT, MP = T.dynamic("num_tokens"), T.dynamic("max_pos")
    steps = D.bit_length() - 1  # log2(D): the tree's levels
    sign = -1.0 if inverse else 1.0

    @T.prim_func
    def norm_rope(
        X: T.Tensor((NT, H, D), in_dtype),
        weight: T.Tensor((D,), ACC),
        positions: T.Tensor((NT,), "int64"),
        cos: T.Tensor((MP, ROPE // 2), ACC),
        sin: T.Tensor((MP, ROPE // 2), ACC),
        eps: T.float32,
        Y: T.Tensor((NT, H, D), out_dtype),
    ):
        with T.Kernel(NT, H, threads=D) as (t, h):  # tokens on x: any count
            x = T.get_thread_binding()
            v_s = T.alloc_shared([D], ACC)
            y = T.alloc_var(ACC)
            y = T.Cast(ACC, X[t, h, x])
            if norm != "none":
                v_s[x] = y * y
                T.sync_threads()
                for s in T.unroll(steps):  # the row's sum of squares, a tree
                    if x < ((D // 2) >> s):
                        v_s[x] = v_s[x] + v_s[x + ((D // 2) >> s)]
                    T.sync_threads()
                y = y * T.rsqrt(v_s[0] / D + eps)
                if norm == "weight":
                    y = y * weight[x]
                T.sync_threads()  # every thread has read v_s[0]
            if round_mid:
                y = T.Cast(ACC, T.Cast("bfloat16", y))
            v_s[x] = y
            T.sync_threads()
            at = T.max(T.min(positions[t], MP - 1), 0)
            r = x - (D - ROPE)
            pair = T.max(r, 0) // 2
            if r >= 0:
                if r % 2 == 0:
                    y = v_s[x] * cos[at, pair] - v_s[x + 1] * (sin[at, pair] * sign)
                else:
                    y = v_s[x - 1] * (sin[at, pair] * sign) + v_s[x] * cos[at, pair]
            Y[t, h, x] = T.Cast(out_dtype, y)

    return norm_rope


@functools.lru_cache(maxsize=None)
def build_silu_mul_clamp(I: int, dtype: str, block: int = 256):
    """``Y [M, I] = silu(min(g, limit)) * clamp(u, -limit, limit)`` with ``g, u = X[:, :I], X[:, I:]``: the clamps
    in ``dtype``, the product in float32, rounded to ``dtype``."""
    M = T.dynamic("rows")

    @T.prim_func
    def silu_mul_clamp(
        X: T.Tensor((M, 2 * I), dtype),
        limit: T.float32,
        Y: T.Tensor((M, I), dtype),
    ):
        with T.Kernel(T.ceildiv(I, block), M, threads=block) as (bx, m):
            x = T.get_thread_binding()
            i = bx * block + x
            if i < I:
                g = T.Cast(ACC, T.Cast(dtype, T.min(T.Cast(ACC, X[m, i]), limit)))
                u = T.Cast(ACC, T.Cast(dtype, T.max(T.min(T.Cast(ACC, X[m, I + i]), limit), -limit)))
                Y[m, i] = T.Cast(dtype, g / (1.0 + T.exp(-g)) * u)

    return silu_mul_clamp


@functools.lru_cache(maxsize=None)
def build_mhc_pre(n: int, H: int, iters: int, head: bool, has_norm: bool, out_dtype: str, threads: int = 256):
    """mHC before a sublayer (``head``: before the final norm), per token, from its ``mixes [T, n (n + 2)]``
    (float32, the GEMM's output, already scaled by the streams' inverse RMS) and its streams ``R [T, n, H]``:

    - ``pre[k] = sigmoid(m[k] s0 + b[k]) + pre_eps`` (``head``: ``sigmoid(m[k] s0 + b[k]) + pre_eps`` over the
      ``n`` mixes a head has);
    - ``post[k] = post_mult sigmoid(m[n + k] s1 + b[n + k])`` and ``comb``: a row softmax of ``m s2 + b`` plus
      ``eps``, then ``iters`` column / row normalisations, column first, each dividing by the sum plus ``eps``
      (not for ``head``);
    - ``Y[h] = sum_k pre[k] R[k, h]`` in float32, rounded to ``out_dtype``; with ``has_norm``, then RMS-normalised
      with ``weight``, the mean square taken on the float32 sum and applied to the rounded one.

    Every thread runs the tiny Sinkhorn itself (no exchange needed); the streams are read by all threads in
    strides of ``threads``."""
    NT = T.dynamic("num_tokens")
    nn = n * n
    M = n if head else n * (n + 2)
    per = (H + threads - 1) // threads
    steps = threads.bit_length() - 1

    @T.prim_func
    def mhc_pre(
        mixes: T.Tensor((NT, M), ACC),
        scale: T.Tensor((3,), ACC),
        base: T.Tensor((M,), ACC),
        R: T.Tensor((NT, n, H), "bfloat16"),
        weight: T.Tensor((H,), ACC),
        pre_eps: T.float32,
        sk_eps: T.float32,
        post_mult: T.float32,
        norm_eps: T.float32,
        post: T.Tensor((NT, n), ACC),
        comb: T.Tensor((NT, n, n), ACC),
        Y: T.Tensor((NT, H), out_dtype),
    ):
        with T.Kernel(NT, threads=threads) as t:
            x = T.get_thread_binding()
            pre = T.alloc_local([n], ACC)
            c = T.alloc_local([nn], ACC)
            acc = T.alloc_local([per], ACC)
            red = T.alloc_shared([threads], ACC)
            s = T.alloc_var(ACC)
            mx = T.alloc_var(ACC)
            for k in T.serial(n):
                pre[k] = 1.0 / (1.0 + T.exp(-(mixes[t, k] * scale[0] + base[k]))) + pre_eps
            if not head:
                for i in T.serial(n):  # row softmax of the n x n block, plus eps
                    mx = -3.0e38
                    for j in T.serial(n):
                        c[i * n + j] = mixes[t, 2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j]
                        mx = T.max(mx, c[i * n + j])
                    s = 0.0
                    for j in T.serial(n):
                        c[i * n + j] = T.exp(c[i * n + j] - mx)
                        s = s + c[i * n + j]
                    for j in T.serial(n):
                        c[i * n + j] = c[i * n + j] / s + sk_eps
                for it in T.serial(2 * iters - 1):  # column, then (row, column) pairs
                    if it % 2 == 0:
                        for j in T.serial(n):
                            s = sk_eps
                            for i in T.serial(n):
                                s = s + c[i * n + j]
                            for i in T.serial(n):
                                c[i * n + j] = c[i * n + j] / s
                    else:
                        for i in T.serial(n):
                            s = sk_eps
                            for j in T.serial(n):
                                s = s + c[i * n + j]
                            for j in T.serial(n):
                                c[i * n + j] = c[i * n + j] / s
                if x == 0:
                    for k in T.serial(n):
                        post[t, k] = post_mult / (1.0 + T.exp(-(mixes[t, n + k] * scale[1] + base[n + k])))
                    for k in T.serial(nn):
                        comb[t, k // n, k % n] = c[k]
            s = 0.0
            for p in T.serial(per):
                acc[p] = 0.0
                if p * threads + x < H:
                    for k in T.serial(n):
                        acc[p] = acc[p] + pre[k] * T.Cast(ACC, R[t, k, p * threads + x])
                    s = s + acc[p] * acc[p]
            if has_norm:
                red[x] = s
                T.sync_threads()
                for st in T.unroll(steps):  # the sum of squares over the block, a tree
                    if x < ((threads // 2) >> st):
                        red[x] = red[x] + red[x + ((threads // 2) >> st)]
                    T.sync_threads()
                s = T.rsqrt(red[0] / H + norm_eps)
            for p in T.serial(per):
                if p * threads + x < H:
                    if has_norm:
                        Y[t, p * threads + x] = T.Cast(out_dtype, T.Cast(ACC, T.Cast(out_dtype, acc[p])) * s
                                                       * weight[p * threads + x])
                    else:
                        Y[t, p * threads + x] = T.Cast(out_dtype, acc[p])

    return mhc_pre


@functools.lru_cache(maxsize=None)
def build_mhc_post(n: int, H: int, dtype: str, block: int = 256):
    """mHC after a sublayer: ``R'[t, i, h] = post[t, i] X[t, h] + sum_j comb[t, j, i] R[t, j, h]`` in float32,
    rounded once to ``dtype``; a thread per (token, h)."""
    NT = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post(
        X: T.Tensor((NT, H), dtype),
        R: T.Tensor((NT, n, H), dtype),
        post: T.Tensor((NT, n), ACC),
        comb: T.Tensor((NT, n, n), ACC),
        Rout: T.Tensor((NT, n, H), dtype),
    ):
        with T.Kernel(NT, T.ceildiv(H, block), threads=block) as (t, bx):  # tokens on x: no 65,535 cap
            x = T.get_thread_binding()
            h = bx * block + x
            r = T.alloc_local([n], ACC)
            y = T.alloc_var(ACC)
            if h < H:
                for j in T.serial(n):
                    r[j] = T.Cast(ACC, R[t, j, h])
                for i in T.serial(n):
                    y = post[t, i] * T.Cast(ACC, X[t, h])
                    for j in T.serial(n):
                        y = y + comb[t, j, i] * r[j]
                    Rout[t, i, h] = T.Cast(dtype, y)

    return mhc_post
