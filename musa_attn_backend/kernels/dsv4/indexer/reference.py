"""PyTorch references of DeepSeek-V4's indexer ops (ground truth in tests, and the path on a CPU): the same
signatures as the checked ops in :mod:`musa_attn_backend.kernels.dsv4.indexer`, vectorised, math in float32.

Logits. For query row ``t`` with heads ``h`` (FP8 ``q[t, h]``, the per-row q scale folded into the weights
``w[t, h]``) and key ``s`` (FP8 ``k[s]`` with its float32 scale ``k_scale[s]``):
``logit[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) * k_scale[s]`` (the scale is positive, so it commutes with
the ReLU), the dot product over the 128 dims of the FP8 values, exact in float32.

Top-k. Row ``t`` takes the columns ``[start_t, start_t + length_t)`` of its logits; it returns the positions
``i - start_t`` of the ``k`` largest, or all of them in position order when ``length_t <= k``, then ``-1``
padding. Ties at the k-th value: any of the tied positions (tests compare sets). NaN ranks below every number.
With a page table, position ``i`` is returned as the slot ``page_table[t, i // page_rows] * page_rows +
i % page_rows`` (``-1`` where the page entry is negative).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import layout as L
from ..writers.reference import fp8_scale

_MAX_ELEMS = 1 << 25  # float32 elements of one chunk of q . k products (128 MB)


def _logits_rows(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``[T, S]`` logits of FP8 ``q [T, H, 128]`` against dequantisation-free FP8 ``k [S, 128]``."""
    T, H, _ = q.shape
    out = torch.empty(T, k.shape[0], dtype=torch.float32, device=q.device)
    kf = k.float()
    step = max(1, _MAX_ELEMS // max(1, H * k.shape[0]))
    for t0 in range(0, T, step):
        s = torch.einsum("thd,sd->ths", q[t0:t0 + step].float(), kf)
        out[t0:t0 + step] = (s.relu_() * w[t0:t0 + step, :, None].float()).sum(dim=1) * k_scale.float()[None, :]
    return out


def indexer_logits_reference(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                             starts: torch.Tensor, ends: torch.Tensor, *, clean: bool = True) -> torch.Tensor:
    """``[T, S]`` float32 logits of every query row against every key; columns outside ``[starts[t], ends[t])``
    hold ``-inf`` (``clean``) or are left as computed."""
    out = _logits_rows(q, w, k, k_scale)
    if clean:
        col = torch.arange(k.shape[0], device=q.device)[None, :]
        inside = (col >= starts.to(q.device)[:, None].long()) & (col < ends.to(q.device)[:, None].long())
        out.masked_fill_(~inside, float("-inf"))
    return out


def paged_indexer_logits_reference(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                                   context_lens: torch.Tensor, block_table: torch.Tensor, max_len: int, *,
                                   clean: bool = True) -> torch.Tensor:
    """``[B * next_n, max_len]`` float32 logits of ``q [B, next_n, H, 128]`` against the keys of each request's
    pages (``block_table[b, i]`` holds keys ``64 i .. 64 i + 63``). Row ``(b, j)`` sees its first ``length``
    keys (``context_lens``); the other columns, and keys whose page entry is outside the cache, hold ``-inf``
    (``clean``) or are unspecified."""
    pages = L.index_pages(cache, op="paged_indexer_logits")
    B, next_n, H, D = q.shape
    lens = context_lens.to(q.device).long().reshape(B, next_n)  # [B] when next_n == 1, else [B, next_n]
    out = torch.full((B * next_n, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    R = pages.rows
    for b in range(B):
        n = int(lens[b].clamp(min=0, max=max_len).max()) if next_n else 0
        if n == 0 or pages.num_pages == 0:  # no key, or none that is real: -inf
            continue
        entries = block_table[b, :(n + R - 1) // R].long().to(q.device)
        ok = (entries >= 0) & (entries < pages.num_pages)
        rows = pages.pages[entries.clamp(0, max(pages.num_pages - 1, 0))]  # [P, extent]
        keys = rows[:, :R * D].reshape(-1, D).contiguous().view(torch.float8_e4m3fn)[:n]
        scales = rows[:, R * D:R * (D + 4)].contiguous().view(torch.float32).reshape(-1)[:n]
        logits = _logits_rows(q[b], w[b * next_n:(b + 1) * next_n], keys, scales)  # [next_n, n]
        valid = ok.repeat_interleave(R)[:n][None, :] & (torch.arange(n, device=q.device)[None, :] < lens[b][:, None])
        out[b * next_n:(b + 1) * next_n, :n] = logits.masked_fill(~valid, float("-inf"))
    return out


def indexer_topk_reference(logits: torch.Tensor, lengths: torch.Tensor, k: int, *,
                           starts: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None,
                           page_rows: int = 64) -> torch.Tensor:
    """``int32 [T, k]``: each row's top-k positions (module docstring); columns at or past ``logits.shape[1]``
    are never read (a row's range is cut there)."""
    T, N = logits.shape
    dev = logits.device
    s0 = torch.zeros(T, dtype=torch.long, device=dev) if starts is None else starts.to(dev).long().clamp(0, N)
    n = torch.minimum(lengths.to(dev).long().clamp(min=0), N - s0)
    span = int(n.max()) if T else 0
    out = torch.full((T, k), -1, dtype=torch.int64, device=dev)
    if span > 0:
        col = torch.arange(span, device=dev)[None, :]
        inside = col < n[:, None]
        vals = logits.float().gather(1, (s0[:, None] + col).clamp(max=N - 1)).double()
        # ranks in float64: every float32 value (-inf as -1e308) above NaN (-1.5e308), above absent columns
        vals = torch.where(torch.isneginf(vals), torch.full_like(vals, -1e308), vals)
        vals = torch.where(torch.isnan(vals), torch.full_like(vals, -1.5e308), vals)
        vals = torch.where(inside, vals, torch.full_like(vals, float("-inf")))
        kk = min(k, span)
        top = vals.topk(kk, dim=1).indices
        short = n <= k
        top_pos = torch.where(top < n[:, None], top, torch.full_like(top, -1))
        in_order = torch.where(col[:, :kk] < n[:, None], col[:, :kk].expand(T, kk), torch.full_like(top, -1))
        out[:, :kk] = torch.where(short[:, None], in_order, top_pos)
    if page_table is not None:
        pt = page_table.to(dev).long()
        pos = out.clamp(min=0)
        page = pos // page_rows
        entry = pt.gather(1, page.clamp(max=pt.shape[1] - 1))
        slot = entry * page_rows + pos % page_rows
        out = torch.where((out >= 0) & (page < pt.shape[1]) & (entry >= 0), slot, torch.full_like(out, -1))
    return out.to(torch.int32)


def indexer_q_reference(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, *, weight_scale: float, rotate: bool = True, scale: str = "exact",
                        bf16_rope: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's query rows: GPT-J RoPE of dims 64..127 of ``q [T, H, 128]`` at ``positions`` (float32;
    ``bf16_rope``: the result rounded to bf16, as vLLM does), the Hadamard rotation (``rotate``), then per
    (token, head) FP8 with ``scale = max(amax, 1e-4) / 448`` (``"exact"``: SGLang) or its power of two ceiling
    (``"pow2"``: vLLM). Returns ``(q e4m3 [T, H, 128], w [T, H] float32 = weights * weight_scale * scale)``."""
    from ..compressor.reference import hadamard, rope_gptj

    x = q.float()
    at = positions.to(q.device).long()
    rot = rope_gptj(x[..., 64:], cos[at].float()[:, None, :], sin[at].float()[:, None, :])
    x = torch.cat([x[..., :64], rot], dim=-1)
    if bf16_rope:
        x = x.to(torch.bfloat16).float()
    if rotate:
        x = hadamard(x)
    s = fp8_scale(x.abs().amax(dim=-1).clamp_min(L.AMAX_FLOOR), scale)
    q8 = (x / s[..., None]).clamp(-L.FP8_MAX, L.FP8_MAX).to(torch.float8_e4m3fn)
    return q8, weights.float() * weight_scale * s
