"""TileLang kernel: scatter new K/V rows into a paged cache by slot, with optional FP8 e4m3 quantisation.

One thread block per token. The caches are seen as token rows with constant strides (see
``attention.tilelang_impl.cache_rows``), so vLLM's K/V views of one shared buffer and SGLang's contiguous
pools both work without copies.
"""


import functools

from ..._tilelang import tl_lang as T

FP8_MAX = 448.0


@functools.lru_cache(maxsize=None)
def build_write_kv(num_kv_heads: int, head_dim: int, head_dim_v: int, in_dtype: str, cache_dtype: str,
                   k_layout: tuple, v_layout: tuple, threads: int = 128):
    """The ``@T.prim_func`` for one configuration (dtype names are TileLang's: bfloat16, float8_e4m3, ...).

    ``k_layout``/``v_layout`` = (width, row stride, head stride) of the caches seen as token rows
    ``[num_slots, width]`` (slot = page * page_size + offset): constant strides let the stores vectorise,
    and the page size does not matter to the kernel at all.
    """
    H, D, DV = num_kv_heads, head_dim, head_dim_v
    quant = cache_dtype.startswith("float8")
    NT = T.dynamic("num_tokens")
    KS = T.dynamic("k_slots")
    VS = T.dynamic("v_slots")

    @T.prim_func
    def write_kv_kernel(
        K: T.Tensor((NT, H, D), in_dtype),
        V: T.Tensor((NT, H, DV), in_dtype),
        KC: T.StridedTensor((KS, k_layout[0]), (k_layout[1], 1), cache_dtype),
        VC: T.StridedTensor((VS, v_layout[0]), (v_layout[1], 1), cache_dtype),
        slots: T.Tensor((NT,), "int64"),
        k_scale: T.Tensor((H,), "float32"),
        v_scale: T.Tensor((H,), "float32"),
    ):
        with T.Kernel(NT, threads=threads) as tok:
            slot = slots[tok]
            if slot >= 0:
                if quant:
                    # x / scale in float32, clamped, then one rounding to e4m3 (as the reference does)
                    for h, d in T.Parallel(H, D):
                        KC[slot, h * k_layout[2] + d] = T.Cast(cache_dtype, T.clamp(
                            T.Cast("float32", K[tok, h, d]) / k_scale[h], -FP8_MAX, FP8_MAX))
                    for h, d in T.Parallel(H, DV):
                        VC[slot, h * v_layout[2] + d] = T.Cast(cache_dtype, T.clamp(
                            T.Cast("float32", V[tok, h, d]) / v_scale[h], -FP8_MAX, FP8_MAX))
                else:
                    for h, d in T.Parallel(H, D):
                        KC[slot, h * k_layout[2] + d] = K[tok, h, d]
                    for h, d in T.Parallel(H, DV):
                        VC[slot, h * v_layout[2] + d] = V[tok, h, d]

    return write_kv_kernel
