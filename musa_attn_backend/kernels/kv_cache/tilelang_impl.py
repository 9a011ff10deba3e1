"""Launch the TileLang KV-write kernel."""

from __future__ import annotations

import torch

from ..._tilelang import compile_cached, tl_dtype
from .._common import FP8_E4M3
from .tilelang_kernel import build_write_kv


def _inv_scale(scale, num_kv_heads: int, device) -> torch.Tensor:
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    return (1.0 / s).expand(num_kv_heads).contiguous()


def write_kv_tilelang(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1:
            raise ValueError(f"write_kv: {name} must be contiguous in its head dim (stride(-1) == 1), "
                             f"got strides {c.stride()}")
    _, hkv, d = k.shape
    dv = v.shape[2]
    key = ("write_kv", hkv, d, dv, k.dtype, k_cache.dtype)
    kernel = compile_cached(key, lambda: build_write_kv(hkv, d, dv, tl_dtype(k.dtype), tl_dtype(k_cache.dtype)))
    quant = k_cache.dtype == FP8_E4M3
    kernel(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping.to(torch.int64).contiguous(),
           _inv_scale(k_scale if quant else None, hkv, k.device),
           _inv_scale(v_scale if quant else None, hkv, k.device))
