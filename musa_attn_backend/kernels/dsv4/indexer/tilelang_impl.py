"""Launch the TileLang indexer kernels (:mod:`.logits_kernel`, :mod:`.topk_kernel`): the cache's byte
views, the split count of paged decode, the output buffers. Arguments arrive checked by :mod:`.indexer`."""

from __future__ import annotations

import math

import torch

from ...._tilelang import compile_cached, tl, tl_dtype
from ....platform import get_platform
from ..._common import check
from .. import layout as L
from .logits_kernel import build_indexer_logits, build_paged_indexer_logits
from .q_kernel import build_indexer_q
from .topk_kernel import build_indexer_topk
from .._glue import _flat_views, _no_race_check, check_fp8

PAGE = 64  # keys a page of the indexer-key cache holds
MAX_SPLITS = 1024  # a bound only: the splits stop at about four blocks an SM first


def _check_fp8(op: str) -> None:
    check_fp8(op, "the TileLang indexer kernels run FP8 GEMMs", "; use impl='reference' there")


def indexer_logits_kernel(H: int, clean: bool, target=None):
    return compile_cached(("dsv4_indexer_logits", H, clean), lambda: build_indexer_logits(H, clean), target=target,
                          pass_configs=_no_race_check())


def paged_indexer_logits_kernel(H: int, next_n: int, clean: bool, target=None):
    return compile_cached(("dsv4_paged_indexer_logits", H, next_n, clean),
                          lambda: build_paged_indexer_logits(H, next_n, clean), target=target,
                          pass_configs=_no_race_check())


def indexer_logits_tilelang(q, w, k, k_scale, starts, ends, clean: bool) -> torch.Tensor:
    op = "indexer_logits(impl='tilelang')"
    _check_fp8(op)
    T_, H, D = q.shape
    S = k.shape[0]
    check(T_ * S < 2 ** 31 and T_ * H < 2 ** 31, lambda: f"{op}: [T, S] = [{T_}, {S}] has more than 2^31 elements")
    # the program's grid holds the token blocks (2 tokens each) on y, at most 65,535 of them
    check(T_ <= 2 * 65535, lambda: f"{op}: {T_} query tokens in one call; at most {2 * 65535} are supported")
    out = torch.empty(T_, S, dtype=torch.float32, device=q.device)
    indexer_logits_kernel(H, clean)(q.reshape(T_ * H, D).contiguous(), w.contiguous(), k.contiguous(),
                                    k_scale.contiguous(), starts.to(torch.int32).contiguous(),
                                    ends.to(torch.int32).contiguous(), out)
    return out


def paged_splits(batch: int, max_len: int, sm_count: int) -> int:
    """How many blocks share a request's pages: enough for about four blocks per SM (a block's page loop runs
    one page at a time, so small batches need many blocks to keep loads in flight), at most one per page. The
    splits need no combine: each block writes the logits of its own pages."""
    pages = max(1, math.ceil(max_len / PAGE))
    return max(1, min(MAX_SPLITS, pages, math.ceil(4 * max(sm_count, 1) / max(batch, 1))))


def paged_indexer_logits_tilelang(q, w, cache, context_lens, block_table, max_len: int, clean: bool) -> torch.Tensor:
    op = "paged_indexer_logits(impl='tilelang')"
    _check_fp8(op)
    B, next_n, H, D = q.shape
    pages = L.index_pages(cache, op=op)
    views, (rows, stride16, _) = _flat_views(pages, q.device, op, "cache", (torch.float8_e4m3fn, torch.float32))
    data = views[0][:views[0].numel() // 16 * 16].view(-1, 16)
    out = torch.empty(B * next_n, max_len, dtype=torch.float32, device=q.device)
    splits = paged_splits(B, max_len, get_platform().sm_count)
    paged_indexer_logits_kernel(H, next_n, clean)(
        q.reshape(B * next_n * H, D).contiguous(), w.contiguous(), data, views[1],
        context_lens.reshape(-1).to(torch.int32).contiguous(), block_table.to(torch.int32).contiguous(),
        stride16, pages.num_pages, splits, out)
    return out


def _topk_pass_configs() -> dict:
    """The top-k and q programs place their barriers themselves (outside every branch the block does not share;
    see :mod:`.topk_kernel`, :mod:`.q_kernel`)."""
    return {tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def indexer_topk_kernel(k: int, page_rows: int, target=None):
    return compile_cached(("dsv4_indexer_topk", k, page_rows), lambda: build_indexer_topk(k, page_rows),
                          target=target, pass_configs=_topk_pass_configs())


def indexer_topk_tilelang(logits, lengths, k: int, starts, page_table, page_rows: int, out) -> torch.Tensor:
    op = "indexer_topk(impl='tilelang')"
    T_, N = logits.shape
    check(T_ == 1 or logits.stride(0) >= N, lambda: f"{op}: logits rows overlap (row stride {logits.stride(0)} < {N})")
    span = (T_ - 1) * logits.stride(0) + N
    check(span < 2 ** 31, lambda: f"{op}: logits spans {span} elements; at most 2^31 are addressed")
    flat = logits.as_strided((span,), (1,))
    dev = logits.device
    starts = torch.zeros(T_, dtype=torch.int32, device=dev) if starts is None else starts.to(torch.int32).contiguous()
    if page_table is None:
        table, page_rows = torch.zeros(T_, 1, dtype=torch.int32, device=dev), 0
    else:
        table = page_table.to(torch.int32).contiguous()
    out = torch.empty(T_, k, dtype=torch.int32, device=dev) if out is None else out
    indexer_topk_kernel(k, page_rows)(flat, lengths.to(torch.int32).contiguous(), starts, table,
                                      logits.stride(0) if T_ > 1 else N, N, out)
    return out


def indexer_q_kernel(H: int, in_dtype: str, rotate: bool, pow2: bool, bf16_rope: bool, target=None):
    return compile_cached(("dsv4_indexer_q", H, in_dtype, rotate, pow2, bf16_rope),
                          lambda: build_indexer_q(H, in_dtype, rotate, pow2, bf16_rope), target=target,
                          pass_configs=_topk_pass_configs())


def indexer_q_tilelang(q, weights, positions, cos, sin, weight_scale: float, rotate: bool, scale: str,
                       bf16_rope: bool):
    op = "indexer_q(impl='tilelang')"
    _check_fp8(op)
    T_, H, D = q.shape
    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    q8 = torch.empty(T_, H, D, dtype=torch.float8_e4m3fn, device=q.device)
    w = torch.empty(T_, H, dtype=torch.float32, device=q.device)
    if T_:
        indexer_q_kernel(H, tl_dtype(dtype), rotate, scale == "pow2", bf16_rope)(
            q.to(dtype).contiguous(), weights.to(dtype).contiguous(), positions.to(torch.int64).contiguous(),
            cos.float().contiguous(), sin.float().contiguous(), float(weight_scale), q8, w)
    return q8, w
