"""Plain-PyTorch paged attention: the ground truth for every attention kernel, and the CPU path.

For query row ``i`` of request ``b`` (absolute position ``p = prefix_lens[b] + i``), query head ``h`` and its KV
head ``h // group``, over the request's keys ``j = 0 .. seqlens_k[b] - 1`` (read through the page table)::

    s_j   = sm_scale * (q_i . k_j)
    s_j   = cap * tanh(s_j / cap)                   if logit_softcap
    s_j   = -inf  unless  j <= p (causal)  and  j >= p - W (sliding window W)
    m     = max(max_j s_j, sink_h), taken as 0 where it is -inf
    denom = sum_j exp(s_j - m) + exp(sink_h - m)    (the sink term only with sinks)
    out_i = sum_j exp(s_j - m) * v_j / denom        (0 for a row that sees no key)
    lse_i = m + log(denom)                          (-inf for a row that sees nothing, sink included)

K and V are dequantised as ``cache * scale`` (per tensor or per KV head) for an FP8 cache. Float32 math
throughout; the result is cast to ``q.dtype`` at the end.

The computation is vectorised so that it also serves as the CPU path of the engines: GQA is a batched matmul
of ``[hkv, rows * group, d]`` queries (the query heads of one KV head side by side) with ``[hkv, d, keys]``
keys, so K/V are never repeated per query head, and each request's keys are gathered once. A batch whose
requests are alike in length (decode steps above all) runs as one padded problem: queries padded to the
longest query, keys to the longest sequence, the padding masked out. Where padding would cost more than it
saves, requests run one by one through the same code.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ...metadata import PagedKVMeta

Scale = Optional[Union[float, torch.Tensor]]

# A batch runs as one padded problem (scores counted over all query heads) when the padded scores are at
# most PAD_WORK_RATIO times the real ones, or at most PAD_SCORES_PER_REQUEST per request: padding that small
# costs less than the per-request loop's own overhead (Python and one round of op dispatch per request) ...
PAD_WORK_RATIO = 2
PAD_SCORES_PER_REQUEST = 1 << 16
# ... and never above PAD_MAX_SCORES float32 scores (bounds the memory of a padded prefill).
PAD_MAX_SCORES = 1 << 24


def dequant_scale(scale: Scale, num_kv_heads: int, device) -> Optional[torch.Tensor]:
    """A float32 ``[num_kv_heads]`` tensor from a per-tensor (float / 0-d / 1-element) or per-head scale."""
    if scale is None:
        return None
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() == 1:
        return s.expand(num_kv_heads).contiguous()
    return s


def paged_attention_reference(
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
    k_scale: Scale = None,
    v_scale: Scale = None,
    return_lse: bool = False,
    pad_requests: Optional[bool] = None,
):
    """See :func:`musa_attn_backend.kernels.paged_attention` for the contract and the module docstring for the
    formula. ``pad_requests`` chooses between the whole batch as one padded problem (True) and request by
    request (False); None picks by the padding cost. Both give the same result (tests compare them)."""
    num_tokens, hq, d = q.shape
    hkv = k_cache.shape[2]
    dv = v_cache.shape[3]
    device = q.device
    opts = dict(
        scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(d),
        causal=causal,
        window=sliding_window if sliding_window is not None and sliding_window >= 0 else None,
        cap=logit_softcap if logit_softcap else None,
        # [hkv, group] so that it lines up with the grouped scores
        sink=sinks.float().to(device).view(hkv, hq // hkv) if sinks is not None else None,
        k_scale=dequant_scale(k_scale, hkv, device),
        v_scale=dequant_scale(v_scale, hkv, device),
    )
    # Host copies of the lengths: on a CPU these are plain reads, on a GPU (tests) one small copy each.
    cu = meta.cu_seqlens_q.tolist()
    seqlens = meta.seqlens_k.tolist()
    bs = len(seqlens)
    q_lens = [cu[b + 1] - cu[b] for b in range(bs)]
    max_q, max_k = max(q_lens, default=0), max(seqlens, default=0)

    if bs and max_q:
        if pad_requests is None:
            real = hq * sum(n * s for n, s in zip(q_lens, seqlens))
            padded = hq * bs * max_q * max_k
            pad_requests = padded <= min(PAD_MAX_SCORES, max(PAD_WORK_RATIO * real, bs * PAD_SCORES_PER_REQUEST))
        if pad_requests or bs == 1:
            out, lse = _attend_requests(q, k_cache, v_cache, meta, 0, bs, cu, q_lens, seqlens, max_q, max_k,
                                        **opts)
        else:
            pieces = [_attend_requests(q, k_cache, v_cache, meta, b, b + 1, cu, q_lens, seqlens, q_lens[b],
                                       seqlens[b], **opts) for b in range(bs) if q_lens[b]]
            out, lse = torch.cat([o for o, _ in pieces]), torch.cat([s for _, s in pieces])
    else:
        out = torch.zeros(num_tokens, hq, dv, dtype=torch.float32, device=device)
        lse = torch.full((num_tokens, hq), float("-inf"), dtype=torch.float32, device=device)

    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _attend_requests(q, k_cache, v_cache, meta: PagedKVMeta, b0: int, b1: int, cu: list, q_lens: list,
                     seqlens: list, max_q: int, max_k: int, *, scale, causal, window, cap, sink, k_scale, v_scale):
    """Requests ``b0:b1`` as one problem padded to ``max_q`` queries and ``max_k`` keys each.

    Returns float32 ``out [rows, hq, dv]`` and ``lse [rows, hq]`` for their packed query rows
    ``cu[b0]:cu[b1]``. Padded keys may read slots no request owns (any value, NaN included): their scores are
    masked and their values zeroed, so they never reach a real row.
    """
    device = q.device
    nb = b1 - b0
    _, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[3]
    group = hq // hkv
    rows = cu[b1] - cu[b0]
    prefix = meta.prefix_lens[b0:b1].long()

    # Queries as [nb, max_q, hq, d]: a plain view when every request has max_q rows (decode, one request).
    uniform = rows == nb * max_q
    if uniform:
        qb = q[cu[b0]:cu[b1]].float().reshape(nb, max_q, hq, d)
    else:
        lens = torch.tensor(q_lens[b0:b1], device=device)
        tok_req = torch.repeat_interleave(torch.arange(nb, device=device), lens)
        tok_row = torch.arange(rows, device=device) - (meta.cu_seqlens_q[b0:b1].long() - cu[b0])[tok_req]
        qb = q.new_zeros((nb, max_q, hq, d), dtype=torch.float32)
        qb[tok_req, tok_row] = q[cu[b0]:cu[b1]].float()

    # One gather of every request's keys 0 .. max_k - 1 through its page table row.
    kpos = torch.arange(max_k, device=device)
    pages = meta.page_table[b0:b1].long()[:, kpos // page_size]  # [nb, max_k]
    offsets = kpos % page_size
    k = _gather(k_cache, pages, offsets).float()  # [nb, max_k, hkv, d]
    v = _gather(v_cache, pages, offsets).float()
    if k_scale is not None:
        k = k * k_scale.view(hkv, 1)
    if v_scale is not None:
        v = v * v_scale.view(hkv, 1)
    padded_keys = any(n < max_k for n in seqlens[b0:b1])
    if padded_keys:
        key_valid = kpos < meta.seqlens_k[b0:b1, None]  # [nb, max_k]
        v = v.masked_fill(~key_valid[:, :, None, None], 0.0)  # 0 * NaN would poison the output

    # Scores [nb, hkv, max_q, group, max_k]: for each KV head its group's query heads share one matmul.
    qg = qb.view(nb, max_q, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(nb, hkv, max_q * group, d)
    s = torch.matmul(qg, k.permute(0, 2, 3, 1)).view(nb, hkv, max_q, group, max_k)
    s.mul_(scale)
    if cap is not None:
        s = cap * torch.tanh(s / cap)

    visible = key_valid[:, None, :] if padded_keys else None  # [nb, 1 | max_q, max_k]
    qpos = prefix[:, None] + torch.arange(max_q, device=device)  # [nb, max_q]
    if causal:
        c = kpos <= qpos[:, :, None]
        visible = c if visible is None else visible & c
    if window is not None:
        w = kpos >= qpos[:, :, None] - window
        visible = w if visible is None else visible & w
    if visible is not None:
        s = s.masked_fill(~visible[:, None, :, None, :], float("-inf"))

    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        sink = sink.view(1, hkv, 1, group, 1)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), device=device))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    lse = (torch.log(denom) + m).view(nb, hkv, max_q, group)  # -inf where nothing is visible
    p = (p / denom.clamp_min(1e-30)).view(nb, hkv, max_q * group, max_k)
    o = torch.matmul(p, v.permute(0, 2, 1, 3))  # [nb, hkv, max_q * group, dv]

    out = o.view(nb, hkv, max_q, group, dv).permute(0, 2, 1, 3, 4).reshape(nb, max_q, hq, dv)
    lse = lse.permute(0, 2, 1, 3).reshape(nb, max_q, hq)
    if uniform:
        return out.reshape(rows, hq, dv), lse.reshape(rows, hq)
    return out[tok_req, tok_row], lse[tok_req, tok_row]


def _gather(cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``cache[pages, offsets]`` (``[nb, n, H, D]``): one ``index_select`` of slots where pages and offsets form
    one flat slot axis (SGLang's pool), else advanced indexing (strided views such as vLLM's K and V)."""
    num_pages, page_size = cache.shape[:2]
    if cache.stride(0) == page_size * cache.stride(1):
        slots = (pages * page_size + offsets).view(-1)
        flat = cache.as_strided((num_pages * page_size, *cache.shape[2:]), cache.stride()[1:],
                                cache.storage_offset())
        return flat.index_select(0, slots).view(*pages.shape, *cache.shape[2:])
    return cache[pages, offsets]
