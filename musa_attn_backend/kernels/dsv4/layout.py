"""DeepSeek-V4's cache byte formats, in one place: the 584-byte "MODEL1" FP8 KV rows (FlashMLA's
``MODEL1_FP8Sparse``, the same in SGLang's ``KVLayout.V4`` and vLLM's ``fp8_ds_mla``) and the 132-byte indexer-key
rows.

A KV page of ``R`` rows (tokens):

* bytes ``[i * 576, i * 576 + 448)``: row ``i``'s 448 "nope" values, FP8 e4m3;
* bytes ``[i * 576 + 448, i * 576 + 576)``: its 64 RoPE values, bf16 (little-endian);
* bytes ``[R * 576 + i * 8, R * 576 + i * 8 + 8)``: its 7 UE8M0 scale exponents, one per 64 nope values (value
  ``2 ** (byte - 127)``), then one pad byte;
* then padding up to a multiple of 576 bytes (``page_bytes(R)``).

An indexer-key page of ``R`` (64) rows: bytes ``[i * 128, i * 128 + 128)`` row ``i``'s 128 FP8 e4m3 values, then at
``R * 128 + i * 4`` its float32 scale (a power of two).

Page ``p`` starts at byte ``p * stride(0)`` of the cache tensor: vLLM packs the pages of several layers (and
cache kinds) into one physical block, so the page stride is the block's and is read from the tensor, never derived
from ``R``. The caches are uint8 views ``[pages, R, 584]`` (vLLM's bound cache), ``[pages, R, 1, 584]``
(FlashMLA's), or built from SGLang's ``[pages, page_bytes]`` pool buffers by :func:`paged_view`. A slot is
``page * R + row``; a cache holds ``pages * R`` slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._common import check

D = 512  # latent width: K = V
D_NOPE = 448  # FP8 part
D_ROPE = 64  # bf16 part
TILE = 64  # nope values per scale
NUM_TILES = D_NOPE // TILE  # 7
DATA_BYTES = D_NOPE + 2 * D_ROPE  # 576
SCALE_BYTES = NUM_TILES + 1  # 8 (7 exponents + 1 pad)
ROW_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = 576
UE8M0_BIAS = 127
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # the writers' lower bound on a tile's amax (keeps the scale finite for all-zero tiles)

INDEX_D = 128  # indexer key width
INDEX_ROW_BYTES = INDEX_D + 4  # 128 FP8 bytes + one float32 scale


def page_bytes(rows: int) -> int:
    """Bytes a KV page of ``rows`` rows occupies, padded to a multiple of 576 (256 rows: 149,760)."""
    return math.ceil(rows * ROW_BYTES / PAGE_ALIGN) * PAGE_ALIGN


def index_page_bytes(rows: int) -> int:
    """Bytes the data and scales of an indexer-key page of ``rows`` rows occupy (64 rows: 8,448)."""
    return rows * INDEX_ROW_BYTES


@dataclass(frozen=True)
class Pages:
    """A cache seen as pages of bytes: ``pages[p]`` is the ``extent`` bytes from page ``p``'s first byte (what its
    rows and scales occupy), ``rows`` rows a page."""

    pages: torch.Tensor  # uint8 [num_pages, extent], strides (page stride, 1)
    rows: int

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def num_slots(self) -> int:
        return self.pages.shape[0] * self.rows


# geometries (shape, strides, row bytes) already checked -> (pages, extent, page stride, rows): the checks run once
# per geometry, not on every layer's call (an engine's caches have a few geometries)
_CHECKED: dict = {}
_CHECKED_KEPT = 1024


def _geometry(cache: torch.Tensor, row_bytes: int, name: str, op: str) -> tuple:
    """The checked ``(pages, extent, page stride, rows)`` of a cache view (the checks run once per geometry)."""
    check(isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8,
          lambda: f"{op}: {name} must be a uint8 tensor of {row_bytes}-byte rows, got "
                  f"{getattr(cache, 'dtype', type(cache).__name__)}")
    key = (cache.shape, cache.stride(), row_bytes)
    geo = _CHECKED.get(key)
    if geo is None:
        geo = _check_pages(cache, row_bytes, name, op)
        if len(_CHECKED) >= _CHECKED_KEPT:
            _CHECKED.clear()
        _CHECKED[key] = geo
    return geo


def _as_pages(cache: torch.Tensor, row_bytes: int, name: str, op: str) -> Pages:
    geo = _geometry(cache, row_bytes, name, op)
    return Pages(cache.as_strided((geo[0], geo[1]), (geo[2], 1)), geo[3])


def _check_pages(cache: torch.Tensor, row_bytes: int, name: str, op: str) -> tuple:
    """``(pages, extent, page stride, rows)`` of a cache view, every rule of its layout checked."""
    shape, strides = tuple(cache.shape), tuple(cache.stride())
    if cache.dim() == 4:  # FlashMLA's [pages, R, 1, bytes]
        check(shape[2] == 1, lambda: f"{op}: {name} [pages, rows, 1, {row_bytes}] must have 1 head, got {shape}")
        shape, strides = shape[:2] + shape[3:], strides[:2] + strides[3:]
    check(len(shape) == 3 and shape[2] == row_bytes,
          lambda: f"{op}: {name} must be [pages, rows, {row_bytes}] or [pages, rows, 1, {row_bytes}] uint8 "
                  f"(see musa_attn_backend.kernels.dsv4.paged_view for [pages, page_bytes] buffers), got "
                  f"{tuple(cache.shape)}")
    rows = shape[1]
    check(rows >= 1 and strides[2] == 1 and (rows == 1 or strides[1] == row_bytes),
          lambda: f"{op}: {name}'s rows must be dense {row_bytes}-byte rows within a page (strides {strides})")
    extent = rows * row_bytes
    check(shape[0] <= 1 or strides[0] >= extent,
          lambda: f"{op}: {name}'s page stride {strides[0]} is smaller than a page's {extent} bytes")
    return shape[0], extent, strides[0], rows


def kv_pages(cache: torch.Tensor, name: str = "cache", op: str = "dsv4") -> Pages:
    """The pages of a 584-byte-row KV cache view (see the module docstring), checked."""
    return _as_pages(cache, ROW_BYTES, name, op)


def check_kv_cache(cache: torch.Tensor, name: str = "cache", op: str = "dsv4") -> None:
    """:func:`kv_pages`' checks without making the pages' view."""
    _geometry(cache, ROW_BYTES, name, op)


def index_pages(cache: torch.Tensor, name: str = "cache", op: str = "dsv4") -> Pages:
    """The pages of a 132-byte-row indexer-key cache view, checked."""
    return _as_pages(cache, INDEX_ROW_BYTES, name, op)


def paged_view(buffer: torch.Tensor, rows: int, row_bytes: int = ROW_BYTES) -> torch.Tensor:
    """``[pages, rows, row_bytes]`` view of a ``[pages, page_bytes]`` uint8 pool buffer (SGLang's), its page stride
    kept; ``row_bytes`` 584 (KV) or 132 (indexer keys)."""
    check(isinstance(buffer, torch.Tensor) and buffer.dtype == torch.uint8 and buffer.dim() == 2,
          "paged_view: buffer must be a 2-D uint8 tensor [pages, page_bytes]")
    check(buffer.stride(1) == 1 and buffer.shape[1] >= rows * row_bytes,
          lambda: f"paged_view: a page of {buffer.shape[1]} bytes cannot hold {rows} rows of {row_bytes} bytes")
    return buffer.as_strided((buffer.shape[0], rows, row_bytes), (buffer.stride(0), row_bytes, 1))


def new_kv_cache(num_pages: int, rows: int, device="cpu", *, page_stride: int = 0) -> torch.Tensor:
    """A zeroed ``[num_pages, rows, 584]`` KV cache view with pages ``page_stride`` bytes apart (0: the padded page
    size; larger: pages packed with others in a physical block, as vLLM does)."""
    stride = page_stride or page_bytes(rows)
    check(stride >= page_bytes(rows) or stride >= rows * ROW_BYTES,
          lambda: f"new_kv_cache: page stride {stride} is smaller than a page")
    buf = torch.zeros(num_pages * stride, dtype=torch.uint8, device=device)
    return buf.as_strided((num_pages, rows, ROW_BYTES), (stride, ROW_BYTES, 1))
