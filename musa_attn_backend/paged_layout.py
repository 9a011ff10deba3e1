"""How kernels see a paged KV cache: token rows with constant strides.

A cache ``[num_pages, page_size, num_kv_heads, head_dim]`` whose pages lie back to back in slot order (page
stride = page_size x token stride) is a 2-D table of token rows ``[num_slots, width]``, slot = page *
page_size + offset, head ``h`` at column ``h * head_stride``. SGLang's pools (token stride H*D) and vLLM's NHD
layout (one ``[blocks, block_size, H, 2D]`` buffer; K and V are views D elements apart, token stride H*2D)
both have this form, so kernels read and write them in place. Known strides (compile-time constants in the
kernels) let the compiler prove 16-byte alignment and vectorise every row access.
"""

from __future__ import annotations

import torch


def cache_rows(cache: torch.Tensor, name: str = "cache", *, op: str = "kernel"):
    """Return ``(rows, (width, row_stride, head_stride))`` for a 4-D paged cache, or raise ``ValueError``."""
    pages, page_size, heads, dim = cache.shape
    s_page, s_tok, s_head, s_dim = cache.stride()
    if s_dim != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its head dim, strides {cache.stride()}")
    if pages > 1 and s_page != page_size * s_tok:
        raise ValueError(
            f"{op}: {name} layout not supported: the page stride ({s_page}) must be page_size x token stride "
            f"({page_size} x {s_tok}), i.e. an NHD cache [pages, page_size, heads, dim]; strides {cache.stride()}")
    if s_tok % 8 or s_head % 8 or cache.data_ptr() % 16:
        raise ValueError(
            f"{op}: {name} token and head strides must be multiples of 8 elements and its data 16-byte aligned "
            f"(strides {cache.stride()})")
    width = (heads - 1) * s_head + dim
    rows = cache.as_strided((pages * page_size, width), (s_tok, 1))
    return rows, (width, s_tok, s_head)
