"""Launch the TileLang KV-write kernel."""

from __future__ import annotations

import torch

from ..._tilelang import compile_cached, tl_dtype
from .._common import FP8_E4M3, per_kv_head
from ...paged_layout import cache_rows
from .write_kv_kernel import build_write_kv


def write_kv_kernel(hkv: int, d: int, dv: int, in_dtype: str, cache_dtype: str, k_layout: tuple, v_layout: tuple,
                    target=None):
    """The compiled KV-write kernel (dtype names are TileLang's)."""
    key = ("write_kv", hkv, d, dv, in_dtype, cache_dtype, k_layout, v_layout)
    return compile_cached(key, lambda: build_write_kv(hkv, d, dv, in_dtype, cache_dtype, k_layout, v_layout),
                          target=target)


def write_kv_tilelang(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    k_rows, k_layout = cache_rows(k_cache, "k_cache", op="write_kv(impl='tilelang')")
    v_rows, v_layout = cache_rows(v_cache, "v_cache", op="write_kv(impl='tilelang')")
    _, hkv, d = k.shape
    kernel = write_kv_kernel(hkv, d, v.shape[2], tl_dtype(k.dtype), tl_dtype(k_cache.dtype), k_layout, v_layout)
    quant = k_cache.dtype == FP8_E4M3
    kernel(k.contiguous(), v.contiguous(), k_rows, v_rows, slot_mapping.to(torch.int64).contiguous(),
           per_kv_head(k_scale if quant else None, hkv, k.device),
           per_kv_head(v_scale if quant else None, hkv, k.device))
