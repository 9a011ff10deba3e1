"""TileLang writers of DeepSeek-V4's caches: quantise rows and store them at their slots, the bytes of
:mod:`.layout` (the rule: :mod:`.reference`).

One block per ``block_T`` tokens. The cache arrives as views of its storage from its first byte, in 16-byte
units for the data (e4m3 and bf16), 8-byte units for the exponents, float32 words for the indexer scales, so the
stores of a row go out in 16-byte pieces; a token whose slot is negative or at or past the cache's slot count (``num_slots``) is skipped: no
input writes outside the cache.
"""

import functools

from ...._tilelang import tl_lang as T
from .. import layout as L

ACC = "float32"


def fp8_scale(amax, pow2: bool):
    """The FP8 scale of a row or tile with largest magnitude ``amax`` (a TIR expression):
    ``max(amax, 1e-4) / 448`` as an IEEE division (the code generator may otherwise multiply by a reciprocal,
    which changes the stored scale's last bit), rounded up to a power of two with ``pow2``; the rule of
    :func:`.reference.fp8_scale`."""
    exact = T.ieee_fdiv(T.max(amax, L.AMAX_FLOOR), L.FP8_MAX)
    return T.exp2(T.ceil(T.log2(exact))) if pow2 else exact


def to_e4m3(x, scale):
    """``x / scale`` (IEEE) clamped to +-448, as e4m3."""
    return T.Cast("float8_e4m3", T.max(T.min(T.ieee_fdiv(x, scale), L.FP8_MAX), -L.FP8_MAX))


@T.macro
def resolve(slots, t0, NT, num_slots, rows, stride16, base_s, scale_s, BT, data_bytes, scale_bytes):
    """Tokens ``t0 ..``'s rows: ``base_s`` their data's first 16-byte unit (-1: skip the token: no slot, or one
    outside the cache), ``scale_s`` their scale's index in units of ``scale_bytes`` (scales follow the page's
    ``rows x data_bytes`` data bytes)."""
    for i in T.Parallel(BT):
        s0 = T.if_then_else(t0 + i < NT, slots[T.min(t0 + i, NT - 1)], -1)
        s = T.if_then_else(s0 < num_slots, s0, -1)
        page = T.if_then_else(s >= 0, s // rows, 0)
        row = T.if_then_else(s >= 0, s % rows, 0)
        base_s[i] = T.if_then_else(s >= 0, page * stride16 + row * (data_bytes // 16), -1)
        scale_s[i] = page * stride16 * (16 // scale_bytes) + rows * (data_bytes // scale_bytes) + row


@functools.lru_cache(maxsize=None)
def build_write_kv_v4(in_dtype: str = "bfloat16", block_T: int = 4, threads: int = 128):
    """Quantise ``KV [T, 512]`` into 584-byte MODEL1 rows at ``slots``."""
    BT, G, TILE = block_T, L.NUM_TILES, L.TILE
    NT = T.dynamic("num_tokens")
    NU, NS = T.dynamic("cache_units16", "int64"), T.dynamic("cache_units8", "int64")

    @T.prim_func
    def write_kv_v4(
        KV: T.Tensor((NT, L.D), in_dtype),
        slots: T.Tensor((NT,), "int64"),
        C8: T.Tensor((NU, 16), "float8_e4m3"),
        CH: T.Tensor((NU, 8), "bfloat16"),
        CS: T.Tensor((NS, 8), "uint8"),
        rows: T.int32,
        stride16: T.int64,
        num_slots: T.int32,
    ):
        with T.Kernel(T.ceildiv(NT, BT), threads=threads) as bx:
            x = T.alloc_fragment([BT * G, TILE], ACC)
            amax = T.alloc_fragment([BT * G], ACC)
            expo = T.alloc_fragment([BT * G], ACC)
            q8 = T.alloc_fragment([BT * G, TILE], "float8_e4m3")
            base_s = T.alloc_shared([BT], "int64", scope="shared")  # a row's first 16-byte unit; -1: skip
            scale_at_s = T.alloc_shared([BT], "int64", scope="shared")  # its scales' 8-byte unit
            e_s = T.alloc_shared([BT, L.SCALE_BYTES], "uint8", scope="shared")  # its exponent bytes and pad
            t0 = bx * BT
            resolve(slots, t0, NT, num_slots, rows, stride16, base_s, scale_at_s, BT, L.DATA_BYTES, 8)
            for r, c in T.Parallel(BT * G, TILE):
                x[r, c] = T.if_then_else(t0 + r // G < NT,
                                         T.Cast(ACC, KV[T.min(t0 + r // G, NT - 1), (r % G) * TILE + c]), 0.0)
            T.reduce_absmax(x, amax, dim=1)
            for r in T.Parallel(BT * G):
                expo[r] = T.ceil(T.log2(T.ieee_fdiv(T.max(amax[r], L.AMAX_FLOOR), L.FP8_MAX)))
            # quantise for every row, then store under the row's guard: with the cast inside the guarded store,
            # TileLang 0.1.15 guards the cast but not the vectorised store for some tilings (32 x 256), and a
            # skipped row then wrote stale values at the cache's first units
            for r, c in T.Parallel(BT * G, TILE):
                q8[r, c] = T.Cast("float8_e4m3", T.max(T.min(x[r, c] * T.exp2(-expo[r]), L.FP8_MAX), -L.FP8_MAX))
            for r, c in T.Parallel(BT * G, TILE):
                if base_s[r // G] >= 0:
                    C8[base_s[r // G] + (r % G) * (TILE // 16) + c // 16, c % 16] = q8[r, c]
            for r in T.Parallel(BT * G):
                e_s[r // G, r % G] = T.Cast("uint8", expo[r] + L.UE8M0_BIAS)
            for i in T.Parallel(BT):
                e_s[i, G] = T.Cast("uint8", 0)
            for i, g in T.Parallel(BT, L.SCALE_BYTES):
                if base_s[i] >= 0:
                    CS[scale_at_s[i], g] = e_s[i, g]
            for i, d in T.Parallel(BT, L.D_ROPE):
                if base_s[i] >= 0:
                    CH[base_s[i] + L.D_NOPE // 16 + d // 8, d % 8] = T.Cast("bfloat16", KV[t0 + i, L.D_NOPE + d])

    return write_kv_v4


@functools.lru_cache(maxsize=None)
def build_write_index_k(in_dtype: str = "bfloat16", block_T: int = 8, threads: int = 128, exact: bool = False):
    """Quantise indexer keys ``K [T, 128]`` into 132-byte rows (128 e4m3 bytes; the page's float32 scales after
    its data) at ``slots``; the scale ``max(amax, 1e-4) / 448`` rounded up to a power of two, or as is
    (``exact``)."""
    BT, D = block_T, L.INDEX_D
    NT = T.dynamic("num_tokens")
    NU, NF = T.dynamic("cache_units16", "int64"), T.dynamic("cache_words", "int64")

    @T.prim_func
    def write_index_k(
        K: T.Tensor((NT, D), in_dtype),
        slots: T.Tensor((NT,), "int64"),
        C8: T.Tensor((NU, 16), "float8_e4m3"),
        CF: T.Tensor((NF,), "float32"),
        rows: T.int32,
        stride16: T.int64,
        num_slots: T.int32,
    ):
        with T.Kernel(T.ceildiv(NT, BT), threads=threads) as bx:
            x = T.alloc_fragment([BT, D], ACC)
            amax = T.alloc_fragment([BT], ACC)
            scale = T.alloc_fragment([BT], ACC)
            q8 = T.alloc_fragment([BT, D], "float8_e4m3")
            base_s = T.alloc_shared([BT], "int64", scope="shared")  # the row's first 16-byte unit; -1: skip
            word_s = T.alloc_shared([BT], "int64", scope="shared")  # its scale's float32 index
            t0 = bx * BT
            resolve(slots, t0, NT, num_slots, rows, stride16, base_s, word_s, BT, D, 4)
            for i, d in T.Parallel(BT, D):
                x[i, d] = T.if_then_else(t0 + i < NT, T.Cast(ACC, K[T.min(t0 + i, NT - 1), d]), 0.0)
            T.reduce_absmax(x, amax, dim=1)
            for i in T.Parallel(BT):
                scale[i] = fp8_scale(amax[i], pow2=not exact)
            for i, d in T.Parallel(BT, D):  # quantise, then store under the guard (as in build_write_kv_v4)
                q8[i, d] = to_e4m3(x[i, d], scale[i])
            for i, d in T.Parallel(BT, D):
                if base_s[i] >= 0:
                    C8[base_s[i] + d // 16, d % 16] = q8[i, d]
            for i in T.Parallel(BT):
                if base_s[i] >= 0:
                    CF[word_s[i]] = scale[i]

    return write_index_k
