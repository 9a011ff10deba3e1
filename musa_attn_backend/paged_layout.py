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
    if pages > 1 and s_page != page_size * s_tok:
        raise ValueError(
            f"{op}: {name} layout not supported: the page stride ({s_page}) must be page_size x token stride "
            f"({page_size} x {s_tok}), i.e. an NHD cache [pages, page_size, heads, dim]; strides {cache.stride()}")
    return token_rows(cache, pages * page_size, s_tok, s_head, s_dim, heads, dim, name, op=op)


def token_rows(x: torch.Tensor, num_rows: int, s_tok: int, s_head: int, s_dim: int, heads: int, dim: int,
               name: str, *, op: str = "kernel"):
    """The ``[num_rows, width]`` row view of ``x`` (rows ``s_tok`` elements apart, head ``h`` at column
    ``h * s_head``) and its layout, after the checks the kernels rely on: unit stride in the head dim, token
    and head strides multiples of 8 elements, data 16-byte aligned."""
    if s_dim != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its head dim, strides {x.stride()}")
    if s_tok % 8 or s_head % 8 or x.data_ptr() % 16:
        raise ValueError(
            f"{op}: {name} token and head strides must be multiples of 8 elements and its data 16-byte aligned "
            f"(strides {x.stride()})")
    width = (heads - 1) * s_head + dim
    return x.as_strided((num_rows, width), (s_tok, 1)), (width, s_tok, s_head)
