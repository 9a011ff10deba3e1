"""SGLang 0.5.23 -> kernel metadata: everything that reads SGLang's batch structures.

The adapter (:mod:`musa_attn_backend.sglang.backend`) hands over what SGLang gives it (the ``ForwardBatch``, the
request-to-token table, the KV pool buffers) and gets back what the kernels take. This module never imports
SGLang: it reads the objects by attribute, so it is testable with stand-ins.

* :func:`paged_kv_meta`: SGLang's batch tensors -> :class:`PagedKVMeta` (``PagedKVMeta.from_sglang``).
* :func:`forward_batch_meta`: a ``ForwardBatch`` -> :class:`PagedKVMeta`, by forward mode (extend, decode,
  speculative verify), with the host-side bounds SGLang already holds.
* :func:`graph_buffers`: the fixed-capacity metadata a decode / verify CUDA graph reads.
* :func:`paged_cache`: a KV pool buffer ``[slots, H, D]`` as the kernels' ``[pages, page_size, H, D]``.
* :func:`attn_output_buffer`: the output buffer SGLang preallocates for some calls, as the kernels' ``out=``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .paged import PagedKVMeta, register_translation, check_1d, check_page_size, cumsum0, require

__all__ = ["paged_kv_meta", "forward_batch_meta", "chain_draft_tokens", "graph_buffers", "paged_cache",
           "attn_output_buffer"]


def paged_kv_meta(
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: Optional[torch.Tensor] = None,
    extend_seq_lens: Optional[torch.Tensor] = None,
    out_cache_loc: Optional[torch.Tensor] = None,
    page_size: int = 1,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    out: Optional[PagedKVMeta] = None,
) -> PagedKVMeta:
    """From SGLang's batch tensors.

    ``req_to_token`` ``[pool_size, max_context]`` maps (request slot, token position) to a KV slot; SGLang
    allocates whole pages, so the page of position ``p`` is ``req_to_token[r, p] // page_size`` and the first
    position of each page gives the page table. ``seq_lens`` are total lengths (prefix + new). For a decode
    batch leave ``extend_prefix_lens``/``extend_seq_lens`` out (one new token per request). ``out_cache_loc``
    (slots of the new tokens) defaults to ``req_to_token`` at the new positions, where SGLang has written it
    before the forward pass. ``out``: capacity buffers (:meth:`PagedKVMeta.allocate`) to write into.
    """
    check_page_size(page_size)
    require(isinstance(req_to_token, torch.Tensor) and req_to_token.dim() == 2,
            "req_to_token must be a 2-D tensor [pool_size, max_context_len]")
    check_1d("req_pool_indices", req_pool_indices)
    bs = req_pool_indices.numel()
    check_1d("seq_lens", seq_lens, bs)
    require((extend_prefix_lens is None) == (extend_seq_lens is None),
            "extend_prefix_lens and extend_seq_lens must be given together (or both omitted for decode)")
    device = req_to_token.device
    seqlens_k = seq_lens.to(device=device, dtype=torch.int32)
    if extend_seq_lens is None:
        q_lens = torch.ones(bs, dtype=torch.int32, device=device)
        prefix = seqlens_k - 1
        if max_seqlen_q is None:
            max_seqlen_q = 1
    else:
        check_1d("extend_seq_lens", extend_seq_lens, bs)
        check_1d("extend_prefix_lens", extend_prefix_lens, bs)
        q_lens = extend_seq_lens.to(device=device, dtype=torch.int32)
        prefix = extend_prefix_lens.to(device=device, dtype=torch.int32)

    max_pages = -(-req_to_token.shape[1] // page_size)
    rows = req_to_token.index_select(0, req_pool_indices.to(device=device, dtype=torch.long))
    first_pos = torch.arange(max_pages, device=device) * page_size
    pages = rows.index_select(1, first_pos).to(torch.int32)
    if page_size > 1:
        pages = torch.div(pages, page_size, rounding_mode="floor")

    if out_cache_loc is None:
        # The new tokens sit at positions prefix .. prefix + q_len - 1 of their request.
        cu = cumsum0(q_lens)
        tok_req = torch.repeat_interleave(torch.arange(bs, device=device), q_lens.long())
        tok_pos = prefix.long()[tok_req] + (torch.arange(tok_req.numel(), device=device) - cu.long()[tok_req])
        slots = rows[tok_req, tok_pos].long()
    else:
        check_1d("out_cache_loc", out_cache_loc)
        slots = out_cache_loc.to(device=device, dtype=torch.int64)
    return PagedKVMeta.from_lengths(query_lens=q_lens, seqlens_k=seqlens_k, prefix_lens=prefix, page_table=pages,
                                    slot_mapping=slots, page_size=page_size, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, out=out)


def chain_draft_tokens(spec_info) -> int:
    """Draft tokens per request of a speculative verify batch whose drafts form a chain (EAGLE / MTP with
    ``topk == 1``, DFlash). Tree-shaped drafts (``topk > 1``, n-gram) need their custom mask: refused."""
    n = getattr(spec_info, "draft_token_num", None)
    topk = getattr(spec_info, "topk", None)
    kind = type(spec_info).__name__
    if n is None or topk != 1 or "Ngram" in kind:
        raise NotImplementedError(
            f"tilelang_musa: speculative verify with {kind} (topk={topk}) uses a tree attention mask, which is "
            "not supported; use chain drafts (--speculative-eagle-topk 1) or another attention backend")
    return int(n)


def forward_batch_meta(fb, req_to_token: torch.Tensor, page_size: int,
                       out: Optional[PagedKVMeta] = None) -> PagedKVMeta:
    """The metadata of one ``ForwardBatch`` (once per batch, shared by every layer).

    Reads ``forward_mode``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc`` and, by mode, ``spec_info``
    (verify), ``extend_prefix_lens`` / ``extend_seq_lens`` (extend), and the host-side copies SGLang keeps
    (``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu``) for the bounds and the
    ``new_kv_only`` flag without a device sync. ``out``: the CUDA-graph buffers (:func:`graph_buffers`); the
    key bound then stays their capacity, so the split count recorded at capture stays valid at replay.
    """
    mode = fb.forward_mode
    if mode.is_draft_extend_v2() or mode.is_dllm_extend():
        # These batches carry their query layout in spec_info / block structure, not in extend_seq_lens:
        # refuse rather than attend with the wrong lengths.
        raise NotImplementedError(f"tilelang_musa: forward mode {mode.name} is not supported; the draft "
                                  "model of speculative decoding runs on SGLang's draft backend")
    common = dict(req_to_token=req_to_token, req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
                  out_cache_loc=fb.out_cache_loc, page_size=page_size, out=out)
    seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
    if out is None and seq_lens_cpu is not None and seq_lens_cpu.numel():
        common["max_seqlen_k"] = int(seq_lens_cpu.max())
    if mode.is_target_verify():
        # seq_lens count the accepted tokens; each request verifies n draft tokens after them, whose K/V go to
        # out_cache_loc. A chain of drafts attends causally (the verify mask is lower triangular), which is a
        # causal extend with prefix = seq_lens.
        n = chain_draft_tokens(fb.spec_info)
        prefix = fb.seq_lens
        common["seq_lens"] = prefix + n
        if "max_seqlen_k" in common:
            common["max_seqlen_k"] += n
        return paged_kv_meta(**common, extend_prefix_lens=prefix, extend_seq_lens=torch.full_like(prefix, n),
                             max_seqlen_q=n)
    if mode.is_decode_or_idle():
        return paged_kv_meta(**common)
    lens_cpu = getattr(fb, "extend_seq_lens_cpu", None)
    meta = paged_kv_meta(**common, extend_prefix_lens=fb.extend_prefix_lens, extend_seq_lens=fb.extend_seq_lens,
                         max_seqlen_q=int(max(lens_cpu)) if lens_cpu is not None and len(lens_cpu) else None)
    # no cached prefix anywhere (host list): each request's keys are its new tokens
    prefix_cpu = getattr(fb, "extend_prefix_lens_cpu", None)
    if out is None and prefix_cpu is not None and len(prefix_cpu) and not any(prefix_cpu):
        meta = dataclasses.replace(meta, new_kv_only=True)
    return meta


def graph_buffers(req_to_token: torch.Tensor, max_bs: int, max_num_tokens: int, page_size: int,
                  device) -> PagedKVMeta:
    """Capacity buffers for SGLang's ``init_cuda_graph_state(max_bs, max_num_tokens)``: up to ``max_bs``
    requests, at least one token each, and the page table of a whole ``req_to_token`` row."""
    return PagedKVMeta.allocate(max_batch=max_bs, max_tokens=max(max_num_tokens, max_bs),
                                max_pages=-(-req_to_token.shape[1] // page_size), page_size=page_size,
                                device=device)


def paged_cache(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang's ``[slots, H, D]`` pool buffer as ``[pages, page_size, H, D]`` (whole pages only; a view)."""
    slots = buf.shape[0] - buf.shape[0] % page_size
    return buf[:slots].view(slots // page_size, page_size, *buf.shape[1:])


def attn_output_buffer(fb, num_tokens: int, num_q_heads: int, v_head_dim: int,
                       dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``ForwardBatch._attn_output`` as ``[num_tokens, num_q_heads, v_head_dim]``, or None.

    SGLang sets that buffer (``[tokens, H * Dv]`` or q's shape, the model dtype) around a backend call whose
    output it keeps (piecewise prefill graphs, padded extend batches) and copies the returned tensor into it
    unless they are the same memory; writing it in place saves that copy. None where it is not set or does not
    fit (rows, size, dtype, not contiguous): the kernels then allocate, and SGLang copies as it would.
    """
    buf = getattr(fb, "_attn_output", None)
    if (not isinstance(buf, torch.Tensor) or buf.dtype != dtype or not buf.is_contiguous() or buf.dim() < 1
            or buf.shape[0] != num_tokens or buf.numel() != num_tokens * num_q_heads * v_head_dim):
        return None
    return buf.view(num_tokens, num_q_heads, v_head_dim)


register_translation("sglang", paged_kv_meta)
