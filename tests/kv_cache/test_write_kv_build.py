"""CI proves the KV write kernel builds: TileLang lowers it and nvcc compiles it for sm_90a, here, without a
GPU (``test_gpu_kv_cache.py`` runs it)."""

import re

import pytest

from musa_attn_backend.testing.toolchain import HOPPER, in_ci, nvcc_path

NVCC = nvcc_path()

pytestmark = pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")


@pytest.mark.parametrize(
    "heads,dim,dim_v,in_dtype,cache_dtype",
    [
        (8, 128, 128, "bfloat16", "bfloat16"),
        (1, 576, 512, "bfloat16", "float8_e4m3"),
        (4, 64, 64, "float16", "float16"),
    ],
)
def test_write_kv_kernel_compiles_for_sm90a(heads, dim, dim_v, in_dtype, cache_dtype):
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend._tilelang import compile_cached
    from musa_attn_backend.kernels.kv_cache.write_kv_kernel import build_write_kv

    key = ("test_write_kv", heads, dim, dim_v, in_dtype, cache_dtype)
    layout_k, layout_v = (heads * dim, heads * dim, dim), (heads * dim_v, heads * dim_v, dim_v)
    kernel = compile_cached(key, lambda: build_write_kv(heads, dim, dim_v, in_dtype, cache_dtype, layout_k, layout_v),
                            target=HOPPER)
    src = kernel.get_kernel_source()
    assert "__global__" in src and "write_kv_kernel" in src
    if cache_dtype.startswith("float8"):
        assert "fp8_e4" in src and "4.48" in src  # quantise and clamp to +-448
    # Negative slots are skipped and the page index comes from slot // page_size.
    assert re.search(r"\(int64_t\)0 <= (slot|page)\b", src), "no guard skipping negative slots"
