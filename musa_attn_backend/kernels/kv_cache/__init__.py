"""KV-cache write: scatter the new tokens' K/V into the paged cache by slot mapping."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .._common import FP8_E4M3, check, check_same_device, check_scale, resolve_impl
from .reference import quantize_fp8, write_kv_reference

__all__ = ["write_kv", "write_kv_reference", "quantize_fp8", "check_write_kv_args"]

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_E4M3)


def check_write_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    op = "write_kv"
    for name, t in (("k", k), ("v", v)):
        check(isinstance(t, torch.Tensor) and t.dim() == 3,
              lambda: f"{op}: {name} must be a 3-D tensor [num_tokens, num_kv_heads, head_dim]")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(isinstance(c, torch.Tensor) and c.dim() == 4,
              lambda: f"{op}: {name} must be a 4-D tensor [num_pages, page_size, num_kv_heads, head_dim]")
        check(c.dtype in CACHE_DTYPES, lambda: f"{op}: {name} dtype must be float16, bfloat16, float32 or "
                                       f"float8_e4m3fn, got {c.dtype}")
    check(isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 and not slot_mapping.is_floating_point(),
          lambda: f"{op}: slot_mapping must be a 1-D integer tensor")
    check_same_device(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, hkv, d = k.shape
    check(v.shape[:2] == k.shape[:2],
          lambda: f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in tokens or heads")
    check(slot_mapping.numel() == num_tokens,
          lambda: f"{op}: slot_mapping has {slot_mapping.numel()} entries for {num_tokens} tokens")
    check(tuple(k_cache.shape[1:]) == (k_cache.shape[1], hkv, d),
          lambda: f"{op}: k_cache {tuple(k_cache.shape)} does not hold [*, *, {hkv}, {d}] rows of k")
    check(tuple(v_cache.shape[2:]) == (hkv, v.shape[2]),
          lambda: f"{op}: v_cache {tuple(v_cache.shape)} does not hold [*, *, {hkv}, {v.shape[2]}] rows of v")
    check(tuple(k_cache.shape[:2]) == tuple(v_cache.shape[:2]),
          lambda: f"{op}: k_cache and v_cache differ in pages or page size")
    check(k_cache.dtype == v_cache.dtype,
          lambda: f"{op}: k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ")
    check(k.dtype == v.dtype, lambda: f"{op}: k ({k.dtype}) and v ({v.dtype}) differ")
    if k_cache.dtype == FP8_E4M3:
        check(k.dtype != FP8_E4M3, lambda: f"{op}: k/v must be unquantised (float16/bfloat16/float32) for an FP8 cache")
    else:
        check(k.dtype == k_cache.dtype, lambda: f"{op}: k dtype {k.dtype} != cache dtype {k_cache.dtype} "
                                        "(only an FP8 cache converts on write)")
        check(k_scale is None and v_scale is None, lambda: f"{op}: k_scale/v_scale apply only to an FP8 cache")
    check_scale(op, "k_scale", k_scale, hkv)
    check_scale(op, "v_scale", v_scale, hkv)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: Optional[Union[float, torch.Tensor]] = None,
    v_scale: Optional[Union[float, torch.Tensor]] = None,
    impl: str = "auto",
) -> None:
    """Write ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into ``k_cache``/``v_cache``
    ``[num_pages, page_size, num_kv_heads, head_dim]`` in place.

    Token ``t`` goes to page ``slot_mapping[t] // page_size``, offset ``slot_mapping[t] % page_size``;
    negative slots are skipped. For a ``float8_e4m3fn`` cache the values are divided by ``k_scale``/``v_scale``
    (scalar or per KV head; default 1.0) and clamped to ±448 before the cast. The caches may be strided views
    as long as the head dim is contiguous.
    """
    check_write_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    which = resolve_impl(impl, k.device, "write_kv")
    if which == "reference" or k.shape[0] == 0:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    from .tilelang_impl import write_kv_tilelang

    write_kv_tilelang(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
