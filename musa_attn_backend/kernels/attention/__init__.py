"""Paged attention (prefill / extend / decode) over a paged KV cache.

Torch-facing wrapper: checks every argument before anything launches, then runs the TileLang kernels on a
GPU or the PyTorch reference (:mod:`.reference`) where asked or where no GPU holds the tensors.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from ...metadata import PagedKVMeta
from .._common import FP8_E4M3, check, check_same_device, check_scale, resolve_impl
from .reference import paged_attention_reference

SPLIT_MIXED_ENV = "MUSA_ATTN_SPLIT_MIXED"
PINGPONG_GATHER_ENV = "MUSA_ATTN_PINGPONG_GATHER"
PDL_ENV = "MUSA_ATTN_PDL"
TMA_CHUNKS_ENV = "MUSA_ATTN_TMA_CHUNKS"
CHUNKED_COMBINE_ENV = "MUSA_ATTN_CHUNKED_COMBINE"
NEW_KV_PREFILL_ENV = "MUSA_ATTN_NEW_KV_PREFILL"


def _enabled(env: str) -> bool:
    return os.environ.get(env, "1") != "0"


def split_mixed_batches() -> bool:
    """Whether a mixed batch whose metadata counts its leading decodes (``PagedKVMeta.num_decodes``) runs them
    with the decode kernel and the rest with the prefill kernel on the GPU (default; ``MUSA_ATTN_SPLIT_MIXED=0``
    turns it off, and the whole batch takes the prefill kernel). Measured on the H200 through vLLM's builder and
    impl: a batch of 16 decodes at 4k + 2 x 512 new tokens went from 0.87x to 2.38x ``TRITON_ATTN``
    (vllm-backend-20261129T193053Z -> -205215Z)."""
    return _enabled(SPLIT_MIXED_ENV)


def pingpong_gather_enabled() -> bool:
    """Whether the ping-pong prefill kernel with a gathering (``cp.async``) producer, for pages of any size, is a
    prefill candidate, ahead of the row-gather kernel (default; ``MUSA_ATTN_PINGPONG_GATHER=0`` removes it).
    Measured on the H200 at page 1, causal 4k / 8k / 16k: 334 / 401 / 429 TFLOP/s against 238 / 291 / 330 for
    the row-gather kernel (tune-prefill-20261129T205442Z)."""
    return _enabled(PINGPONG_GATHER_ENV)


def dependent_launch_enabled() -> bool:
    """Whether the split-KV combine kernel is launched as a programmatic dependent of the decode kernel where the
    target has it (CUDA sm_90+), so its launch overlaps the decode's last wave (default; ``MUSA_ATTN_PDL=0``
    turns it off). Measured on the H200, batch 1 at 4k / 16k keys: 16.8 / 31.5 us instead of 18.9 / 32.6 us;
    larger batches unchanged within 1% (tune-decode-20261129T224737Z vs -224817Z)."""
    return _enabled(PDL_ENV)


def tma_chunks_enabled() -> bool:
    """Whether the ping-pong prefill with TMA copies of page chunks (16/32/64 rows, each through the page table)
    is a candidate for pages of a multiple of 16 tokens that hold no whole key tile (default; the default
    kernel for pages of 64, a tuning candidate for 16 and 32; ``MUSA_ATTN_TMA_CHUNKS=0`` removes it)."""
    return _enabled(TMA_CHUNKS_ENV)


def chunked_combine_enabled() -> bool:
    """Whether the split-KV combine reads the partial LSEs at once and the partial outputs 8 splits at a time
    (their loads in flight together) rather than one split after another, each a dependent L2 round trip
    (default; ``MUSA_ATTN_CHUNKED_COMBINE=0`` turns it off). Measured on the H200 (hd 128, 32/8 heads, page 1):
    batch 1 at 4k / 32k keys 15.2 -> 14.4 us and 54.9 -> 52.7 us, batch 8 at 4k 51.2 -> 48.3 us, batch 32
    within 0.2% (tune-decode-20261130T005144Z vs -005211Z)."""
    return _enabled(CHUNKED_COMBINE_ENV)


def new_kv_prefill_enabled() -> bool:
    """Whether a prefill whose requests have no cached prefix reads the batch's new K/V (``new_kv`` of
    :func:`paged_attention`, contiguous per request) with whole-tile TMA copies instead of the paged cache,
    whatever the page size (SGLang's page 1, vLLM's 16 would otherwise take the gathering producer). Default;
    ``MUSA_ATTN_NEW_KV_PREFILL=0`` turns it off. Measured on the H200 (hd 128, 32/8 heads, one request, bf16),
    causal 4k / 8k / 16k: 503 / 618 / 608 TFLOP/s against 372 / 440 / 461 from the page-1 cache (the gathering
    producer) and 477 / 588 / 582 from pages of 128; 1.01-1.05x cuDNN at 8k-16k (attention-20261130T020748Z)."""
    return _enabled(NEW_KV_PREFILL_ENV)


__all__ = ["paged_attention", "paged_attention_reference", "check_paged_attention_args"]

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_paged_attention_args(q, k_cache, v_cache, meta, *, sm_scale=None, sliding_window=None,
                               logit_softcap=None, sinks=None, k_scale=None, v_scale=None, new_kv=None,
                               out=None) -> None:
    """Shape, dtype and option checks common to every implementation (raises ``ValueError``)."""
    op = "paged_attention"
    check(isinstance(q, torch.Tensor) and q.dim() == 3,
          f"{op}: q must be a 3-D tensor [num_tokens, num_q_heads, head_dim], got "
          f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    check(q.dtype in Q_DTYPES, f"{op}: q dtype must be one of float16, bfloat16, float32; got {q.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(isinstance(c, torch.Tensor) and c.dim() == 4,
              f"{op}: {name} must be a 4-D tensor [num_pages, page_size, num_kv_heads, head_dim]")
    check(isinstance(meta, PagedKVMeta), f"{op}: meta must be a PagedKVMeta, got {type(meta).__name__}")
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, page_table=meta.page_table)
    num_tokens, hq, d = q.shape
    pages, page_size, hkv, dk = k_cache.shape
    check(tuple(v_cache.shape[:3]) == (pages, page_size, hkv),
          f"{op}: v_cache shape {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} "
          "in pages, page size or KV heads")
    check(dk == d, f"{op}: head_dim of q ({d}) and k_cache ({dk}) differ")
    check(page_size == meta.page_size, f"{op}: k_cache page size {page_size} != meta.page_size {meta.page_size}")
    check(hkv >= 1 and hq % hkv == 0,
          f"{op}: num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv}) (MHA, GQA or MQA)")
    check(num_tokens == meta.num_tokens, f"{op}: q has {num_tokens} tokens, meta describes {meta.num_tokens}")
    check(k_cache.dtype == v_cache.dtype, f"{op}: k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ")
    check(k_cache.dtype in (q.dtype, FP8_E4M3),
          f"{op}: KV cache dtype must be q's dtype ({q.dtype}) or float8_e4m3fn, got {k_cache.dtype}")
    if k_cache.dtype != FP8_E4M3:
        check(k_scale is None and v_scale is None,
              f"{op}: k_scale/v_scale apply only to an FP8 (float8_e4m3fn) KV cache, the cache is {k_cache.dtype}")
    check_scale(op, "k_scale", k_scale, hkv)
    check_scale(op, "v_scale", v_scale, hkv)
    check(sm_scale is None or (isinstance(sm_scale, (int, float)) and sm_scale > 0),
          f"{op}: sm_scale must be a positive number or None, got {sm_scale!r}")
    check(sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool)),
          f"{op}: sliding_window must be an int (keys to the left of the query; < 0 = off) or None, "
          f"got {sliding_window!r}")
    check(logit_softcap is None or (isinstance(logit_softcap, (int, float)) and logit_softcap >= 0),
          f"{op}: logit_softcap must be a non-negative number or None (0 = off), got {logit_softcap!r}")
    if sinks is not None:
        check(isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.numel() == hq,
              f"{op}: sinks must be a 1-D tensor with one logit per query head ({hq}), got "
              f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        check(sinks.device == q.device, f"{op}: sinks are on {sinks.device}, q on {q.device}")
    if new_kv is not None:
        check(isinstance(new_kv, (tuple, list)) and len(new_kv) == 2
              and all(isinstance(x, torch.Tensor) for x in new_kv),
              f"{op}: new_kv must be a (k, v) pair of tensors, got {type(new_kv).__name__}")
        for name, x in zip(("new_kv[0] (k)", "new_kv[1] (v)"), new_kv):
            check(x.dim() in (2, 3) and x.shape[0] >= num_tokens,
                  f"{op}: {name} must be [num_tokens, num_kv_heads, head_dim] or [num_tokens, num_kv_heads * "
                  f"head_dim] with at least {num_tokens} rows, got {tuple(x.shape)}")
            check(x.device == q.device, f"{op}: {name} is on {x.device}, q on {q.device}")
    if out is not None:
        want = (num_tokens, hq, v_cache.shape[3])
        check(isinstance(out, torch.Tensor), f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
        check(tuple(out.shape) == want, f"{op}: out must have shape [num_tokens, num_q_heads, v_head_dim] = "
                                        f"{list(want)}, got {list(out.shape)}")
        check(out.dtype == q.dtype, f"{op}: out dtype must be q's ({q.dtype}), got {out.dtype}")
        check(out.device == q.device, f"{op}: out is on {out.device}, q on {q.device}")
        # The kernels store rows of [num_tokens, num_q_heads, v_head_dim] at row-major offsets; a strided view
        # would need a copy afterwards, which out= exists to avoid.
        check(out.is_contiguous(), f"{op}: out must be contiguous (row-major [num_tokens, num_q_heads, "
                                   f"v_head_dim]), got strides {out.stride()}")
        # the kernels read q while they write out: the two must not share memory
        q_end, o_end = q.data_ptr() + _span(q), out.data_ptr() + _span(out)
        check(out.numel() == 0 or q.numel() == 0 or o_end <= q.data_ptr() or q_end <= out.data_ptr(),
              f"{op}: out overlaps q's memory; pass a separate output tensor")


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
            tiles whatever the page size (default, :func:`new_kv_prefill_enabled`). Ignored by the reference,
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
