"""Paged attention (prefill / extend / decode) over a paged KV cache.

Torch-facing wrapper: checks every argument before anything launches, then runs the TileLang kernels on a
GPU or the PyTorch reference (:mod:`.reference`) where asked or where no GPU holds the tensors.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ...metadata import PagedKVMeta
from .._common import FP8_E4M3, check, check_same_device, check_scale, resolve_impl
from .reference import paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference", "check_paged_attention_args"]

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_paged_attention_args(q, k_cache, v_cache, meta, *, sm_scale=None, sliding_window=None,
                               logit_softcap=None, sinks=None, k_scale=None, v_scale=None, new_kv=None,
                               out=None) -> None:
    """Shape, dtype and option checks common to every implementation (raises ``ValueError``)."""
    op = "paged_attention"
    check(isinstance(q, torch.Tensor) and q.dim() == 3,
          lambda: f"{op}: q must be a 3-D tensor [num_tokens, num_q_heads, head_dim], got "
          f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    check(q.dtype in Q_DTYPES, lambda: f"{op}: q dtype must be one of float16, bfloat16, float32; got {q.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(isinstance(c, torch.Tensor) and c.dim() == 4,
              lambda: f"{op}: {name} must be a 4-D tensor [num_pages, page_size, num_kv_heads, head_dim]")
    check(isinstance(meta, PagedKVMeta), lambda: f"{op}: meta must be a PagedKVMeta, got {type(meta).__name__}")
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, page_table=meta.page_table)
    num_tokens, hq, d = q.shape
    pages, page_size, hkv, dk = k_cache.shape
    check(tuple(v_cache.shape[:3]) == (pages, page_size, hkv),
          lambda: f"{op}: v_cache shape {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} "
          "in pages, page size or KV heads")
    check(dk == d, lambda: f"{op}: head_dim of q ({d}) and k_cache ({dk}) differ")
    check(page_size == meta.page_size,
          lambda: f"{op}: k_cache page size {page_size} != meta.page_size {meta.page_size}")
    check(hkv >= 1 and hq % hkv == 0,
          lambda: f"{op}: num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv}) (MHA, GQA or MQA)")
    check(num_tokens == meta.num_tokens, lambda: f"{op}: q has {num_tokens} tokens, meta describes {meta.num_tokens}")
    check(k_cache.dtype == v_cache.dtype,
          lambda: f"{op}: k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ")
    check(k_cache.dtype in (q.dtype, FP8_E4M3),
          lambda: f"{op}: KV cache dtype must be q's dtype ({q.dtype}) or float8_e4m3fn, got {k_cache.dtype}")
    if k_cache.dtype != FP8_E4M3:
        check(k_scale is None and v_scale is None,
              lambda: f"{op}: k_scale/v_scale apply only to an FP8 (float8_e4m3fn) KV cache, "
              f"the cache is {k_cache.dtype}")
    check_scale(op, "k_scale", k_scale, hkv)
    check_scale(op, "v_scale", v_scale, hkv)
    check(sm_scale is None or (isinstance(sm_scale, (int, float)) and sm_scale > 0),
          lambda: f"{op}: sm_scale must be a positive number or None, got {sm_scale!r}")
    check(sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool)),
          lambda: f"{op}: sliding_window must be an int (keys to the left of the query; < 0 = off) or None, "
          f"got {sliding_window!r}")
    check(logit_softcap is None or (isinstance(logit_softcap, (int, float)) and logit_softcap >= 0),
          lambda: f"{op}: logit_softcap must be a non-negative number or None (0 = off), got {logit_softcap!r}")
    if sinks is not None:
        check(isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.numel() == hq,
              lambda: f"{op}: sinks must be a 1-D tensor with one logit per query head ({hq}), got "
              f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        check(sinks.device == q.device, lambda: f"{op}: sinks are on {sinks.device}, q on {q.device}")
    if new_kv is not None:
        check(isinstance(new_kv, (tuple, list)) and len(new_kv) == 2
              and all(isinstance(x, torch.Tensor) for x in new_kv),
              lambda: f"{op}: new_kv must be a (k, v) pair of tensors, got {type(new_kv).__name__}")
        for name, x in zip(("new_kv[0] (k)", "new_kv[1] (v)"), new_kv):
            check(x.dim() in (2, 3) and x.shape[0] >= num_tokens,
                  lambda: f"{op}: {name} must be [num_tokens, num_kv_heads, head_dim] or [num_tokens, num_kv_heads * "
                  f"head_dim] with at least {num_tokens} rows, got {tuple(x.shape)}")
            check(x.device == q.device, lambda: f"{op}: {name} is on {x.device}, q on {q.device}")
    if out is not None:
        want = (num_tokens, hq, v_cache.shape[3])
        check(isinstance(out, torch.Tensor), lambda: f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
        check(tuple(out.shape) == want, lambda: f"{op}: out must have shape [num_tokens, num_q_heads, v_head_dim] = "
                                        f"{list(want)}, got {list(out.shape)}")
        check(out.dtype == q.dtype, lambda: f"{op}: out dtype must be q's ({q.dtype}), got {out.dtype}")
        check(out.device == q.device, lambda: f"{op}: out is on {out.device}, q on {q.device}")
        # The kernels store rows of [num_tokens, num_q_heads, v_head_dim] at row-major offsets; a strided view
        # would need a copy afterwards, which out= exists to avoid.
        check(out.is_contiguous(), lambda: f"{op}: out must be contiguous (row-major [num_tokens, num_q_heads, "
                                   f"v_head_dim]), got strides {out.stride()}")
        # the kernels read q while they write out: the two must not share memory
        q_end, o_end = q.data_ptr() + _span(q), out.data_ptr() + _span(out)
        check(out.numel() == 0 or q.numel() == 0 or o_end <= q.data_ptr() or q_end <= out.data_ptr(),
              lambda: f"{op}: out overlaps q's memory; pass a separate output tensor")


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (strides >= 0)."""
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedKVMeta,
    *,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    logit_softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[Union[float, torch.Tensor]] = None,
    v_scale: Optional[Union[float, torch.Tensor]] = None,
    return_lse: bool = False,
    new_kv: Optional[tuple] = None,
    out: Optional[torch.Tensor] = None,
    impl: str = "auto",
):
    """Attention of packed queries over a paged KV cache (prefill, extend with a cached prefix, or decode).

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, the new tokens of all requests packed in order
            (request ``b`` owns rows ``meta.cu_seqlens_q[b]:meta.cu_seqlens_q[b+1]``).
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, already holding the new tokens'
            K/V (see :func:`write_kv`); dtype = ``q.dtype`` or ``float8_e4m3fn`` (then dequantised with
            ``k_scale``/``v_scale``: a scalar or one value per KV head; default 1.0).
        meta: the batch (:class:`~musa_attn_backend.metadata.PagedKVMeta`).
        causal: query at absolute position ``p`` (``prefix_len + i``) sees keys ``0..p``; else all keys.
        sm_scale: softmax scale, default ``head_dim ** -0.5``.
        sliding_window: left window ``W``: the query at ``p`` sees keys ``p-W .. p`` (``W+1`` keys); ``None``
            or < 0 = no window. (vLLM's ``sliding_window`` ``n`` is ``W = n - 1``; SGLang's
            ``sliding_window_size`` is ``W``.)
        logit_softcap: ``s = cap * tanh(s / cap)`` on the scaled logits (0 or None = off).
        sinks: float ``[num_q_heads]`` per-head sink logits: an extra softmax column with no value.
        return_lse: also return the natural-log sum-exp of the logits, float32 ``[num_tokens, num_q_heads]``
            (the sink term included; ``-inf`` for a row that sees nothing).
        new_kv: optional ``(k, v)``, the batch's new K/V ``[num_tokens, num_kv_heads, head_dim]`` (or
            ``[num_tokens, num_kv_heads * head_dim]``, any row stride) packed like ``q``, exactly as written into
            the cache. Where ``meta.new_kv_only`` says that no request (after the leading decodes) has a cached
            prefix, the GPU prefill may read them instead of the cache: the same values, in whole contiguous
            tiles whatever the page size (default; ``MUSA_ATTN_NEW_KV_PREFILL=0``: off). Ignored by the reference,
            for FP8 caches and where their dtype differs from the cache's.
        out: optional ``[num_tokens, num_q_heads, v_head_dim]`` tensor of ``q``'s dtype on ``q``'s device,
            contiguous, to write the result into (an engine's preallocated output); it is the returned tensor.
            Checked with the other arguments, before anything launches. The TileLang kernels write it
            directly; the reference computes in float32 and copies the result in.
        impl: ``auto`` (TileLang on a GPU, reference on a CPU), ``tilelang`` or ``reference``.

    Returns:
        ``out`` ``[num_tokens, num_q_heads, v_head_dim]`` in ``q.dtype`` (the given ``out`` if any), or
        ``(out, lse)``.
    """
    check_paged_attention_args(q, k_cache, v_cache, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                               logit_softcap=logit_softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                               new_kv=new_kv, out=out)
    if sliding_window is not None and sliding_window < 0:
        sliding_window = None
    if logit_softcap == 0:
        logit_softcap = None
    kwargs = dict(causal=causal, sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                  sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)
    which = resolve_impl(impl, q.device, "paged_attention")
    if which == "reference":
        res = paged_attention_reference(q, k_cache, v_cache, meta, **kwargs)
        if out is None:
            return res
        out.copy_(res[0] if return_lse else res)
        return (out, res[1]) if return_lse else out
    from . import tilelang_impl

    return tilelang_impl.paged_attention_tilelang(q, k_cache, v_cache, meta, new_kv=new_kv, out=out, **kwargs)
