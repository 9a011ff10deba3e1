"""TileLang kernel: scatter new K/V rows into a paged cache by slot, with optional FP8 e4m3 quantisation.

One thread block per token. The caches are strided tensors (only the head dim must be unit-stride), so
vLLM's K/V views of one shared buffer and SGLang's contiguous pools both work without copies.
"""


import functools

from ..._tilelang import tl, tl_lang as T

FP8_MAX = 448.0


@functools.lru_cache(maxsize=None)
def build_write_kv(num_kv_heads: int, head_dim: int, head_dim_v: int, in_dtype: str, cache_dtype: str,
                   threads: int = 128):
    """The ``@T.prim_func`` for one configuration (dtype names are TileLang's: bfloat16, float8_e4m3, ...).

    The page size is a runtime value: one compiled kernel serves every page size."""
    H, D, DV = num_kv_heads, head_dim, head_dim_v
    P = T.dynamic("page_size")
    quant = cache_dtype.startswith("float8")
    NT = T.dynamic("num_tokens")
    NP = T.dynamic("num_pages")
    ks0, ks1, ks2 = (T.dynamic(f"k_stride_{i}", "int64") for i in range(3))
    vs0, vs1, vs2 = (T.dynamic(f"v_stride_{i}", "int64") for i in range(3))

    @T.prim_func
    def write_kv_kernel(
        K: T.Tensor((NT, H, D), in_dtype),
        V: T.Tensor((NT, H, DV), in_dtype),
        KC: T.StridedTensor((NP, P, H, D), (ks0, ks1, ks2, 1), cache_dtype),
        VC: T.StridedTensor((NP, P, H, DV), (vs0, vs1, vs2, 1), cache_dtype),
        slots: T.Tensor((NT,), "int64"),
        k_inv_scale: T.Tensor((H,), "float32"),
        v_inv_scale: T.Tensor((H,), "float32"),
    ):
        with T.Kernel(NT, threads=threads) as tok:
            slot = slots[tok]
            if slot >= 0:
                page = slot // P
                off = slot % P
                if quant:
                    for h, d in T.Parallel(H, D):
                        KC[page, off, h, d] = T.Cast(cache_dtype, T.clamp(
                            T.Cast("float32", K[tok, h, d]) * k_inv_scale[h], -FP8_MAX, FP8_MAX))
                    for h, d in T.Parallel(H, DV):
                        VC[page, off, h, d] = T.Cast(cache_dtype, T.clamp(
                            T.Cast("float32", V[tok, h, d]) * v_inv_scale[h], -FP8_MAX, FP8_MAX))
                else:
                    for h, d in T.Parallel(H, D):
                        KC[page, off, h, d] = K[tok, h, d]
                    for h, d in T.Parallel(H, DV):
                        VC[page, off, h, d] = V[tok, h, d]

    return write_kv_kernel
