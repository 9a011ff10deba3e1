"""PyTorch references of the DeepSeek-V4 cache writers and readers (ground truth in tests, and the path on a
CPU): the same signatures as the checked ops in :mod:`musa_attn_backend.kernels.dsv4.writers`, vectorised.

Quantisation (both engines' writers): per 64-value tile of the 448 nope values, ``scale = 2 ** e`` with
``e = ceil(log2(max(amax, 1e-4) / 448))``, stored as the byte ``e + 127``; the values stored are
``e4m3(x / scale)`` (round to nearest even; ``|x / scale| <= 448`` by construction, clamped all the same). The 64
RoPE values are stored as bf16. Indexer keys: the same rule over all 128 values of a row, the scale stored as a
float32.
"""

from __future__ import annotations

import torch

from .. import layout as L


def fp8_scale(amax: torch.Tensor, rule: str = "exact") -> torch.Tensor:
    """``amax / 448`` in float32, rounded once (IEEE division, as the engines' CUDA writers and ours compute it),
    or (``rule="pow2"``) that rounded up to a power of two. Not ``amax / 448.0``: on CUDA, torch divides by a
    Python number as a multiplication by its rounded reciprocal, one bit off for some values."""
    scale = amax / torch.full_like(amax, L.FP8_MAX)
    return scale if rule == "exact" else torch.exp2(torch.ceil(torch.log2(scale)))


def quantize_kv_v4(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv [T, 512]`` -> (data ``[T, 576]`` uint8: e4m3 nope then bf16 RoPE bytes, scales ``[T, 8]`` uint8: 7
    exponents and a zero pad byte)."""
    x = kv.float()
    nope = x[:, :L.D_NOPE].reshape(-1, L.NUM_TILES, L.TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(L.AMAX_FLOOR)
    e = torch.ceil(torch.log2(fp8_scale(amax)))
    q = (nope / torch.exp2(e)[..., None]).clamp(-L.FP8_MAX, L.FP8_MAX).to(torch.float8_e4m3fn)
    rope = kv[:, L.D_NOPE:].to(torch.bfloat16).contiguous()
    data = torch.cat([q.reshape(-1, L.D_NOPE).view(torch.uint8), rope.view(torch.uint8)], dim=1)
    scales = torch.zeros(kv.shape[0], L.SCALE_BYTES, dtype=torch.uint8, device=kv.device)
    scales[:, :L.NUM_TILES] = (e + L.UE8M0_BIAS).to(torch.uint8)
    return data, scales


def dequantize_kv_v4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(data ``[N, 576]``, scales ``[N, 8]``) uint8 -> the rows ``[N, 512]`` in float32 (exact)."""
    nope = data[:, :L.D_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, L.NUM_TILES, L.TILE)
    scale = torch.exp2(scales[:, :L.NUM_TILES].float() - L.UE8M0_BIAS)
    rope = data[:, L.D_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).reshape(-1, L.D_NOPE), rope], dim=1)


def _byte_index(pages: L.Pages, slots: torch.Tensor, offsets: torch.Tensor, row_bytes: int, base: int):
    """(page, byte column) index tensors of ``len(offsets)`` bytes per slot at ``base + row * row_bytes``."""
    page, row = slots // pages.rows, slots % pages.rows
    cols = (base + row * row_bytes)[:, None] + offsets.to(slots.device)[None, :]
    return page[:, None].expand_as(cols), cols


def _store(pages: L.Pages, x: torch.Tensor, slots: torch.Tensor, quantize, data_bytes: int, scale_bytes: int):
    """Quantise the rows of ``x`` whose slot is in the cache and store their data bytes at ``row * data_bytes``
    and their scale bytes at ``rows * data_bytes + row * scale_bytes`` of their page."""
    keep = (slots >= 0) & (slots < pages.num_slots)
    s = slots[keep].long()
    if s.numel() == 0:
        return
    data, scales = quantize(x[keep])
    p, c = _byte_index(pages, s, torch.arange(data_bytes), data_bytes, 0)
    pages.pages[p, c] = data
    p, c = _byte_index(pages, s, torch.arange(scale_bytes), scale_bytes, pages.rows * data_bytes)
    pages.pages[p, c] = scales


def write_kv_v4_reference(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``kv [T, 512]`` and store row ``t`` at slot ``slots[t]`` of ``cache`` (negative or past the
    cache's slots: skipped)."""
    _store(L.kv_pages(cache, op="write_kv_v4"), kv, slots, quantize_kv_v4, L.DATA_BYTES, L.SCALE_BYTES)


def read_kv_v4_reference(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised rows ``[N, 512]`` (bf16, exact) at ``slots`` (each in ``[0, slots of the cache)``)."""
    return _gather_rows(L.kv_pages(cache, op="read_kv_v4"), slots.long()).to(torch.bfloat16)


def _rows_view(pages: L.Pages, row_bytes: int, base: int) -> torch.Tensor:
    """``[pages, rows, row_bytes]``: every page's rows of ``row_bytes`` bytes from byte ``base`` (a view)."""
    return pages.pages[:, base:base + pages.rows * row_bytes].unflatten(1, (pages.rows, row_bytes))


def _gather_rows(pages: L.Pages, s: torch.Tensor) -> torch.Tensor:
    """The float32 rows at slots ``s``: each row's data and scale bytes gathered whole (one index a row, not a
    byte: a prefill's workspace reads tens of thousands of rows)."""
    page, row = s // pages.rows, s % pages.rows
    data = _rows_view(pages, L.DATA_BYTES, 0)[page, row]
    scales = _rows_view(pages, L.SCALE_BYTES, pages.rows * L.DATA_BYTES)[page, row]
    return dequantize_kv_v4(data, scales)


def quantize_index_k(k: torch.Tensor, scale_rule: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """``k [T, 128]`` -> (FP8 bytes ``[T, 128]`` uint8, scales ``[T]`` float32: ``max(amax, 1e-4) / 448`` rounded
    up to a power of two (``"pow2"``: vLLM's writer) or as is (``"exact"``: SGLang's))."""
    x = k.float()
    amax = x.abs().amax(dim=-1).clamp_min(L.AMAX_FLOOR)
    scale = fp8_scale(amax, scale_rule)
    q = (x / scale[:, None]).clamp(-L.FP8_MAX, L.FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def write_index_k_reference(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                            scale_rule: str = "pow2") -> None:
    """Quantise indexer keys ``k [T, 128]`` into ``cache`` (132-byte rows) at ``slots`` (negative or past the
    cache's slots: skipped), the scale by ``scale_rule`` (:func:`quantize_index_k`)."""
    def quantize(x):
        data, scale = quantize_index_k(x, scale_rule)
        return data, scale.contiguous().view(torch.uint8).reshape(-1, 4)

    _store(L.index_pages(cache, op="write_index_k"), k, slots, quantize, L.INDEX_D, 4)


def read_index_k_reference(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised indexer keys ``[N, 128]`` float32 at ``slots``."""
    pages = L.index_pages(cache, op="read_index_k")
    s = slots.long()
    p, c = _byte_index(pages, s, torch.arange(L.INDEX_D), L.INDEX_D, 0)
    data = pages.pages[p, c].contiguous().view(torch.float8_e4m3fn).float()
    p, c = _byte_index(pages, s, torch.arange(4), 4, pages.rows * L.INDEX_D)
    scale = pages.pages[p, c].contiguous().view(torch.float32).reshape(-1)
    return data * scale[:, None]
