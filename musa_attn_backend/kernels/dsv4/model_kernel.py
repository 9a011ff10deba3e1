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

from ..._tilelang import tl_lang as T

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
