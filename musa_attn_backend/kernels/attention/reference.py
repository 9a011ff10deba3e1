"""Plain-PyTorch paged attention: the ground truth for every attention kernel, and the CPU path.

Float32 math throughout (scores, softmax, accumulation); the result is cast to ``q.dtype`` at the end.
It loops over requests, so it is meant for correctness, not speed.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ...metadata import PagedKVMeta

Scale = Optional[Union[float, torch.Tensor]]


def dequant_scale(scale: Scale, num_kv_heads: int, device) -> Optional[torch.Tensor]:
    """A float32 ``[num_kv_heads]`` tensor from a per-tensor (float / 0-d / 1-element) or per-head scale."""
    if scale is None:
        return None
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() == 1:
        return s.expand(num_kv_heads).contiguous()
    return s


def gather_kv(cache: torch.Tensor, page_table_row: torch.Tensor, seqlen: int, page_size: int,
              scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Keys (or values) ``0 .. seqlen-1`` of one request as float32 ``[seqlen, num_kv_heads, head_dim]``."""
    pos = torch.arange(seqlen, device=cache.device)
    pages = page_table_row.to(cache.device).long()[pos // page_size]
    x = cache[pages, pos % page_size].float()
    if scale is not None:
        x = x * scale.view(1, -1, 1)
    return x


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
):
    """See :func:`musa_attn_backend.kernels.paged_attention` for the contract."""
    num_tokens, hq, d = q.shape
    hkv = k_cache.shape[2]
    dv = v_cache.shape[3]
    group = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    ks = dequant_scale(k_scale, hkv, q.device)
    vs = dequant_scale(v_scale, hkv, q.device)
    out = torch.zeros(num_tokens, hq, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, hq), float("-inf"), dtype=torch.float32, device=q.device)

    cu = meta.cu_seqlens_q.tolist()
    seqlens = meta.seqlens_k.tolist()
    prefix = meta.prefix_lens.tolist()
    sink = sinks.float().to(q.device) if sinks is not None else None

    for b in range(meta.batch_size):
        q0, q1, sk = cu[b], cu[b + 1], seqlens[b]
        nq = q1 - q0
        if nq == 0:
            continue
        k = gather_kv(k_cache, meta.page_table[b], sk, meta.page_size, ks)  # [sk, hkv, d]
        v = gather_kv(v_cache, meta.page_table[b], sk, meta.page_size, vs)
        k = k.repeat_interleave(group, dim=1)  # [sk, hq, d]
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [nq, hq, d]
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [hq, nq, sk]
        if logit_softcap is not None and logit_softcap > 0:
            s = logit_softcap * torch.tanh(s / logit_softcap)
        qpos = prefix[b] + torch.arange(nq, device=q.device)
        kpos = torch.arange(sk, device=q.device)
        visible = torch.ones(nq, sk, dtype=torch.bool, device=q.device)
        if causal:
            visible &= kpos[None, :] <= qpos[:, None]
        if sliding_window is not None and sliding_window >= 0:
            visible &= kpos[None, :] >= qpos[:, None] - sliding_window
        s = s.masked_fill(~visible[None], float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.view(hq, 1, 1).expand(hq, nq, 1)], dim=-1)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        row_lse = (torch.log(denom) + m).squeeze(-1)  # [hq, nq]; -inf where nothing is visible
        if sink is not None:
            p = p[..., :-1]
        o = torch.einsum("hqk,khd->qhd", p / denom.clamp_min(1e-30), v)
        out[q0:q1] = o
        lse[q0:q1] = row_lse.transpose(0, 1)

    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
