"""PyTorch references of the DeepSeek-V4 attention ops (ground truth in tests, and the path on a CPU): the same
signatures as the checked ops in :mod:`musa_attn_backend.kernels.dsv4`, vectorised, math in float32.

Quantisation (both engines' writers): per 64-value tile of the 448 nope values, ``scale = 2 ** e`` with
``e = ceil(log2(max(amax, 1e-4) / 448))``, stored as the byte ``e + 127``; the values stored are
``e4m3(x / scale)`` (round to nearest even; ``|x / scale| <= 448`` by construction, clamped all the same). The 64
RoPE values are stored as bf16. Indexer keys: the same rule over all 128 values of a row, the scale stored as a
float32.

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

from . import layout as L

_NOPE_COLS = torch.arange(L.D_NOPE)
_DATA_COLS = torch.arange(L.DATA_BYTES)
_SCALE_COLS = torch.arange(L.SCALE_BYTES)


def fp8_scale(amax: torch.Tensor, rule: str = "exact") -> torch.Tensor:
    """``amax / 448`` in float32, rounded once (IEEE division, as the engines' CUDA writers and ours compute it),
    or (``rule="pow2"``) that rounded up to a power of two. Not ``amax / 448.0``: on CUDA, torch divides by a
    Python number as a multiplication by its rounded reciprocal, one bit off for some values."""
    scale = amax / torch.full_like(amax, L.FP8_MAX)
    return scale if rule == "exact" else torch.exp2(torch.ceil(torch.log2(scale)))


def quantize_kv_v4(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv [T, 512]`` -> (data ``[T, 576]`` uint8: e4m3 nope then bf16 RoPE bytes, scales ``[T, 8]`` uint8: 7
    exponents and a zero pad byte)."""
    x = kv.float()
    nope = x[:, :L.D_NOPE].reshape(-1, L.NUM_TILES, L.TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(L.AMAX_FLOOR)
    e = torch.ceil(torch.log2(fp8_scale(amax)))
    q = (nope / torch.exp2(e)[..., None]).clamp(-L.FP8_MAX, L.FP8_MAX).to(torch.float8_e4m3fn)
    rope = kv[:, L.D_NOPE:].to(torch.bfloat16).contiguous()
    data = torch.cat([q.reshape(-1, L.D_NOPE).view(torch.uint8), rope.view(torch.uint8)], dim=1)
    scales = torch.zeros(kv.shape[0], L.SCALE_BYTES, dtype=torch.uint8, device=kv.device)
    scales[:, :L.NUM_TILES] = (e + L.UE8M0_BIAS).to(torch.uint8)
    return data, scales


def dequantize_kv_v4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(data ``[N, 576]``, scales ``[N, 8]``) uint8 -> the rows ``[N, 512]`` in float32 (exact)."""
    nope = data[:, :L.D_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, L.NUM_TILES, L.TILE)
    scale = torch.exp2(scales[:, :L.NUM_TILES].float() - L.UE8M0_BIAS)
    rope = data[:, L.D_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).reshape(-1, L.D_NOPE), rope], dim=1)


def _byte_index(pages: L.Pages, slots: torch.Tensor, offsets: torch.Tensor, row_bytes: int, base: int):
    """(page, byte column) index tensors of ``len(offsets)`` bytes per slot at ``base + row * row_bytes``."""
    page, row = slots // pages.rows, slots % pages.rows
    cols = (base + row * row_bytes)[:, None] + offsets.to(slots.device)[None, :]
    return page[:, None].expand_as(cols), cols


def _store(pages: L.Pages, x: torch.Tensor, slots: torch.Tensor, quantize, data_bytes: int, scale_bytes: int):
    """Quantise the rows of ``x`` whose slot is in the cache and store their data bytes at ``row * data_bytes``
    and their scale bytes at ``rows * data_bytes + row * scale_bytes`` of their page."""
    keep = (slots >= 0) & (slots < pages.num_slots)
    s = slots[keep].long()
    if s.numel() == 0:
        return
    data, scales = quantize(x[keep])
    p, c = _byte_index(pages, s, torch.arange(data_bytes), data_bytes, 0)
    pages.pages[p, c] = data
    p, c = _byte_index(pages, s, torch.arange(scale_bytes), scale_bytes, pages.rows * data_bytes)
    pages.pages[p, c] = scales


def write_kv_v4_reference(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``kv [T, 512]`` and store row ``t`` at slot ``slots[t]`` of ``cache`` (negative or past the
    cache's slots: skipped)."""
    _store(L.kv_pages(cache, op="write_kv_v4"), kv, slots, quantize_kv_v4, L.DATA_BYTES, L.SCALE_BYTES)


def read_kv_v4_reference(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised rows ``[N, 512]`` (bf16, exact) at ``slots`` (each in ``[0, slots of the cache)``)."""
    return _gather_rows(L.kv_pages(cache, op="read_kv_v4"), slots.long()).to(torch.bfloat16)


def _gather_rows(pages: L.Pages, s: torch.Tensor) -> torch.Tensor:
    p, c = _byte_index(pages, s, _DATA_COLS, L.DATA_BYTES, 0)
    data = pages.pages[p, c]
    p, c = _byte_index(pages, s, _SCALE_COLS, L.SCALE_BYTES, pages.rows * L.DATA_BYTES)
    return dequantize_kv_v4(data, pages.pages[p, c])


def quantize_index_k(k: torch.Tensor, scale_rule: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """``k [T, 128]`` -> (FP8 bytes ``[T, 128]`` uint8, scales ``[T]`` float32: ``max(amax, 1e-4) / 448`` rounded
    up to a power of two (``"pow2"``: vLLM's writer) or as is (``"exact"``: SGLang's))."""
    x = k.float()
    amax = x.abs().amax(dim=-1).clamp_min(L.AMAX_FLOOR)
    scale = fp8_scale(amax, scale_rule)
    q = (x / scale[:, None]).clamp(-L.FP8_MAX, L.FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def write_index_k_reference(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                            scale_rule: str = "pow2") -> None:
    """Quantise indexer keys ``k [T, 128]`` into ``cache`` (132-byte rows) at ``slots`` (negative or past the
    cache's slots: skipped), the scale by ``scale_rule`` (:func:`quantize_index_k`)."""
    def quantize(x):
        data, scale = quantize_index_k(x, scale_rule)
        return data, scale.contiguous().view(torch.uint8).reshape(-1, 4)

    _store(L.index_pages(cache, op="write_index_k"), k, slots, quantize, L.INDEX_D, 4)


def read_index_k_reference(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised indexer keys ``[N, 128]`` float32 at ``slots``."""
    pages = L.index_pages(cache, op="read_index_k")
    s = slots.long()
    p, c = _byte_index(pages, s, torch.arange(L.INDEX_D), L.INDEX_D, 0)
    data = pages.pages[p, c].contiguous().view(torch.float8_e4m3fn).float()
    p, c = _byte_index(pages, s, torch.arange(4), 4, pages.rows * L.INDEX_D)
    scale = pages.pages[p, c].contiguous().view(torch.float32).reshape(-1)
    return data * scale[:, None]


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
