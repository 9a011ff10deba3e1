"""Plain-PyTorch KV-cache write: the ground truth for the TileLang kernel and the CPU path."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .._common import FP8_E4M3, FP8_E4M3_MAX

Scale = Optional[Union[float, torch.Tensor]]


def quantize_fp8(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """``x / scale`` (per tensor or per head of ``x [tokens, heads, dim]``), clamped to ±448, as e4m3."""
    xf = x.float()
    if scale is not None:
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(-1)
        xf = xf / (s.view(1, -1, 1) if s.numel() > 1 else s)
    return xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    """See :func:`musa_attn_backend.kernels.write_kv`."""
    page_size = k_cache.shape[1]
    slots = slot_mapping.to(k.device).long()
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        src = src[keep]
        cache[page, off] = quantize_fp8(src, scale) if cache.dtype == FP8_E4M3 else src.to(cache.dtype)
