"""TileLang program of the indexer's query rows (the math: :func:`.reference.indexer_q_reference`): one
block of 128 threads per (token, head), thread ``x`` owning dim ``x``. The RoPE pairs, the Hadamard butterflies
and the amax exchange values through shared memory; the barriers are placed by hand (every thread of a block
passes each one)."""

import functools

from ...._tilelang import tl_lang as T
from .. import layout as L
from ..compressor.kernel import hadamard_128
from ..writers.kernel import fp8_scale, to_e4m3

ACC = "float32"
D = L.INDEX_D


@functools.lru_cache(maxsize=None)
def build_indexer_q(H: int, in_dtype: str, rotate: bool, pow2: bool, bf16_rope: bool):
    """``Q8 [T, H, 128]`` e4m3 and ``Wout [T, H]`` from ``Q [T, H, 128]`` and ``Win [T, H]``."""
    NT, MP = T.dynamic("num_tokens"), T.dynamic("max_pos")

    @T.prim_func
    def indexer_q(
        Q: T.Tensor((NT, H, D), in_dtype),
        Win: T.Tensor((NT, H), in_dtype),
        positions: T.Tensor((NT,), "int64"),
        cos: T.Tensor((MP, 32), ACC),
        sin: T.Tensor((MP, 32), ACC),
        weight_scale: T.float32,
        Q8: T.Tensor((NT, H, D), "float8_e4m3"),
        Wout: T.Tensor((NT, H), ACC),
    ):
        with T.Kernel(NT, H, threads=D) as (t, h):  # tokens on x: any count
            x = T.get_thread_binding()
            v_s = T.alloc_shared([D], ACC)
            a_s = T.alloc_shared([D], ACC)
            y = T.alloc_var(ACC)
            at = T.max(T.min(positions[t], MP - 1), 0)
            v_s[x] = T.Cast(ACC, Q[t, h, x])
            T.sync_threads()
            r = x - 64
            pair = T.max(r, 0) // 2
            y = v_s[x]
            if r >= 0:
                if r % 2 == 0:
                    y = v_s[x] * cos[at, pair] - v_s[x + 1] * sin[at, pair]
                else:
                    y = v_s[x - 1] * sin[at, pair] + v_s[x] * cos[at, pair]
            if bf16_rope:
                y = T.Cast(ACC, T.Cast("bfloat16", y))
            T.sync_threads()
            v_s[x] = y
            T.sync_threads()
            if rotate:
                hadamard_128(v_s, x)
                y = v_s[x] * (D ** -0.5)
            else:
                y = v_s[x]
            a_s[x] = T.abs(y)
            T.sync_threads()
            for s in T.unroll(7):  # the row's amax, a tree
                if x < (64 >> s):
                    a_s[x] = T.max(a_s[x], a_s[x + (64 >> s)])
                T.sync_threads()
            scale = fp8_scale(a_s[0], pow2)
            Q8[t, h, x] = to_e4m3(y, scale)
            if x == 0:
                Wout[t, h] = T.Cast(ACC, Win[t, h]) * weight_scale * scale

    return indexer_q
