"""The PyTorch reference of DeepSeek-V4's sparse MQA (ground truth in tests, and the path on a CPU): the same
signature as the checked op in :mod:`musa_attn_backend.kernels.dsv4.sparse`, vectorised, math in float32; the rows
dequantised by the writers' reader (:mod:`..writers.reference`).

Sparse MQA: for query token ``t`` and head ``h``, over the valid entries ``j`` of both index sets (entry ``j``
of token ``t`` counts if ``j < length[t]`` and ``0 <= index < slots`` of its cache),
``s_j = sm_scale * q[t, h] . k_j`` with ``k_j = v_j`` the dequantised 512-d row, and
``o[t, h] = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink[h]})``;
``lse[t, h] = log(sum_j e^{s_j})`` (natural log, the sink excluded, as FlashMLA returns it; ``-inf`` and
``o = 0`` for a token with no valid entry).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import layout as L
from ..writers.reference import _gather_rows

def valid_entries(indices: torch.Tensor, lengths: Optional[torch.Tensor], num_slots: int) -> torch.Tensor:
    """``[T, K]`` bool: entry ``j`` of token ``t`` is attended (``j < lengths[t]``, ``0 <= index < num_slots``)."""
    ok = (indices >= 0) & (indices < num_slots)
    if lengths is not None:
        ok &= torch.arange(indices.shape[1], device=indices.device)[None, :] < lengths.to(indices.device)[:, None]
    return ok


def sparse_mqa_reference(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                         lengths: Optional[torch.Tensor] = None, *, extra_cache: Optional[torch.Tensor] = None,
                         extra_indices: Optional[torch.Tensor] = None, extra_lengths: Optional[torch.Tensor] = None,
                         sink: Optional[torch.Tensor] = None, sm_scale: float = L.D ** -0.5,
                         out: Optional[torch.Tensor] = None, return_lse: bool = False, token_chunk: int = 256):
    """Sparse MQA over one or two FP8 caches (module docstring). ``token_chunk`` tokens at a time, so the gathered
    rows (``chunk x K x 512`` float32) stay small."""
    T, H, _ = q.shape
    sets = [(L.kv_pages(cache, op="sparse_mqa"), indices, lengths)]
    if extra_cache is not None and extra_indices is not None and extra_indices.shape[1] > 0:
        sets.append((L.kv_pages(extra_cache, "extra_cache", op="sparse_mqa"), extra_indices, extra_lengths))
    o = torch.empty(T, H, L.D, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, token_chunk):
        t1 = min(T, t0 + token_chunk)
        rows, masks = [], []
        for pages, idx, lens in sets:
            idx = idx[t0:t1]
            ok = valid_entries(idx, None if lens is None else lens[t0:t1], pages.num_slots)
            safe = torch.where(ok, idx, torch.zeros_like(idx)).long()
            kv = torch.zeros(*idx.shape, L.D, dtype=torch.float32, device=q.device)
            if ok.any():
                # each distinct row dequantised once (a prefill's tokens share most of their window and compressed
                # rows), then copied to every entry that names it: the same values as dequantising per entry
                rows_of, which = torch.unique(safe[ok], return_inverse=True)
                kv[ok] = _gather_rows(pages, rows_of)[which]
            rows.append(kv)
            masks.append(ok)
        kv, ok = torch.cat(rows, dim=1), torch.cat(masks, dim=1)  # [t, K, 512], [t, K]
        s = torch.einsum("thd,tkd->thk", q[t0:t1].float(), kv) * sm_scale
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        lse_t = torch.logsumexp(s, dim=-1)  # -inf where no entry is valid
        m = s.amax(dim=-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink.float().view(1, H, 1))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(dim=-1)
        if sink is not None:
            denom = denom + torch.exp(sink.float().view(1, H) - m[..., 0])
        num = torch.einsum("thk,tkd->thd", p, kv)
        o[t0:t1] = torch.where(denom[..., None] > 0, num / denom.clamp_min(1e-30)[..., None], torch.zeros_like(num))
        lse[t0:t1] = lse_t
    if out is not None:
        out.copy_(o.to(out.dtype))
        o = out
    else:
        o = o.to(q.dtype)
    return (o, lse) if return_lse else o
