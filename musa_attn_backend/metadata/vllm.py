"""vLLM 0.33 -> kernel metadata: everything that reads vLLM's batch structures.

The adapter (:mod:`musa_attn_backend.vllm.backend`) hands over vLLM's ``CommonAttentionMetadata`` and KV cache
and gets back what the kernels take. This module never imports vLLM: it reads the objects by attribute.

* :func:`paged_kv_meta`: vLLM's batch tensors -> :class:`PagedKVMeta` (``PagedKVMeta.from_vllm``).
* :func:`common_metadata_meta`: a ``CommonAttentionMetadata`` -> :class:`PagedKVMeta`, with the leading-decode
  count and the ``new_kv_only`` flag read from its host-side copies.
* :func:`is_uniform_decode`, :func:`graph_buffers`, :func:`graph_buffers_fit`: which batches a full CUDA
  graph captures and the fixed-capacity metadata it reads.
* :func:`kv_cache_views`: vLLM's NHD cache as the kernels' K and V views.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .paged import PagedKVMeta, register_translation, check_1d, check_page_size, require

__all__ = ["paged_kv_meta", "common_metadata_meta", "leading_decodes", "new_kv_only", "is_uniform_decode",
           "graph_buffers", "graph_buffers_fit", "kv_cache_views"]


def paged_kv_meta(
    *,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    out: Optional[PagedKVMeta] = None,
) -> PagedKVMeta:
    """From vLLM's ``CommonAttentionMetadata`` tensors (``block_table_tensor``, ``query_start_loc``,
    ``seq_lens``, ``slot_mapping``; ``page_size`` = the kernel block size). ``out``: capacity buffers
    (:meth:`PagedKVMeta.allocate`) to write into."""
    check_page_size(page_size)
    require(isinstance(block_table, torch.Tensor) and block_table.dim() == 2,
            "block_table must be a 2-D tensor [num_reqs, max_blocks]")
    bs = seq_lens.numel()
    check_1d("seq_lens", seq_lens, bs)
    check_1d("query_start_loc", query_start_loc, bs + 1)
    check_1d("slot_mapping", slot_mapping)
    require(block_table.shape[0] >= bs, f"block_table has {block_table.shape[0]} rows for {bs} requests")
    device = block_table.device
    qsl = query_start_loc.to(device=device, dtype=torch.int32)
    q_lens = qsl[1:] - qsl[:-1]
    seqlens_k = seq_lens.to(device=device, dtype=torch.int32)
    return PagedKVMeta.from_lengths(query_lens=q_lens, seqlens_k=seqlens_k, prefix_lens=seqlens_k - q_lens,
                                    page_table=block_table[:bs].to(torch.int32),
                                    slot_mapping=slot_mapping.to(device=device, dtype=torch.int64),
                                    page_size=page_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                    out=out)


def leading_decodes(query_start_loc_cpu: torch.Tensor) -> int:
    """How many requests at the front of the batch have one query token (host tensor: no device sync)."""
    longer = ((query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]) != 1).nonzero()
    return int(longer[0, 0]) if longer.numel() else int(query_start_loc_cpu.numel() - 1)


def new_kv_only(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: Optional[torch.Tensor], first: int) -> bool:
    """Whether requests ``first``.. have no cached prefix (their keys are their new tokens): from host tensors
    (no device sync). ``seq_lens_cpu``: vLLM's ``seq_lens_cpu_upper_bound``, exact for prefill rows and never
    below a row's length, so equality with the query length is exact; None = not known."""
    if seq_lens_cpu is None:
        return False
    q_lens = query_start_loc_cpu[first + 1:] - query_start_loc_cpu[first:-1]
    return bool(q_lens.numel()) and bool((seq_lens_cpu[first:] == q_lens).all())


def is_uniform_decode(cm) -> bool:
    """One query token per request: the batches vLLM runs under full CUDA graphs with
    ``UNIFORM_SINGLE_TOKEN_DECODE``."""
    return cm.max_query_len == 1 and cm.num_actual_tokens == cm.num_reqs


def graph_buffers(cm, max_num_seqs: int, page_size: int, device) -> PagedKVMeta:
    """Capacity buffers for decode batches under full CUDA graphs: up to ``max_num_seqs`` requests (or this
    batch's, if more) and the runner's block-table width (blocks per request at ``max_model_len``)."""
    max_bs = max(int(max_num_seqs), cm.num_reqs)
    return PagedKVMeta.allocate(max_batch=max_bs, max_tokens=max_bs, max_pages=max(1, cm.block_table_tensor.shape[1]),
                                page_size=page_size, device=device)


def graph_buffers_fit(buffers: PagedKVMeta, cm) -> bool:
    """Whether a batch fits the capacity buffers (requests and block-table width)."""
    return cm.num_reqs <= buffers.batch_size and cm.block_table_tensor.shape[1] <= buffers.max_pages


def common_metadata_meta(cm, page_size: int, *, out: Optional[PagedKVMeta] = None,
                         split_decodes: bool = False) -> PagedKVMeta:
    """The metadata of one ``CommonAttentionMetadata`` (once per batch, shared by every layer).

    Only the first ``num_reqs`` requests and ``num_actual_tokens`` slots are read (vLLM pads both). ``out``: the
    full-graph capacity buffers; the key bound is then their capacity (so the split count fixed at capture
    holds at replay), else vLLM's ``max_seq_len``. For batches with a prefill, from the host copies
    (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``): ``num_decodes`` (with ``split_decodes``; vLLM puts
    single-token requests first when asked to) and ``new_kv_only``.
    """
    n, bs = cm.num_actual_tokens, cm.num_reqs
    meta = paged_kv_meta(block_table=cm.block_table_tensor[:bs], query_start_loc=cm.query_start_loc[:bs + 1],
                         seq_lens=cm.seq_lens[:bs], slot_mapping=cm.slot_mapping[:n], page_size=page_size,
                         max_seqlen_q=int(cm.max_query_len),
                         max_seqlen_k=None if out is not None else int(cm.max_seq_len), out=out)
    if out is None and cm.max_query_len > 1:
        qsl = cm.query_start_loc_cpu[:bs + 1]
        nd = leading_decodes(qsl) if split_decodes else 0
        bound = getattr(cm, "seq_lens_cpu_upper_bound", None)
        meta = dataclasses.replace(meta, num_decodes=nd,
                                   new_kv_only=new_kv_only(qsl, bound[:bs] if bound is not None else None, nd))
    return meta


def kv_cache_views(kv_cache: torch.Tensor, head_size: int, fp8: bool = False):
    """vLLM's cache, logically ``[blocks, H, block_size, 2D]`` over NHD storage, as K and V views
    ``[blocks, block_size, H, D]`` (in place; reinterpreted as ``float8_e4m3fn`` for an FP8 cache)."""
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    if fp8:
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    return k, v


register_translation("vllm", paged_kv_meta)
