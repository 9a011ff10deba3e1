"""Random paged batches, built the way each engine lays them out (used by tests, the demo and benchmarks).

A :class:`PagedBatch` is one logical batch: per request a cached prefix and a number of new tokens, pages
scattered at random through a shared pool. :meth:`PagedBatch.sglang_view` and :meth:`PagedBatch.vllm_view`
give the arguments each engine would hand us (with junk past every request's pages, as real engines leave
it), and :meth:`PagedBatch.make_kv` fills a cache whose rows are known per request for dense comparisons.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..metadata import PagedKVMeta


@dataclass
class PagedBatch:
    prefix_lens: list[int]
    query_lens: list[int]
    page_size: int
    max_pages: int  # page-table width (same for both engine views)
    num_pages: int  # physical pages in the pool
    pages: list[list[int]]  # physical page ids of each request, in order
    device: torch.device
    seed: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + q for p, q in zip(self.prefix_lens, self.query_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def slot(self, b: int, pos: int) -> int:
        return self.pages[b][pos // self.page_size] * self.page_size + pos % self.page_size

    def new_token_slots(self) -> torch.Tensor:
        slots = [self.slot(b, p + i) for b, (p, q) in enumerate(zip(self.prefix_lens, self.query_lens))
                 for i in range(q)]
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ engine views
    def sglang_view(self, *, decode_form: Optional[bool] = None, with_out_cache_loc: bool = True) -> dict:
        """Keyword arguments for :meth:`PagedKVMeta.from_sglang`.

        ``req_to_token`` is token-granular (``[pool, max_pages * page_size]``); requests sit at random rows
        and positions past each sequence hold junk slot numbers.
        """
        g = torch.Generator().manual_seed(self.seed + 1)
        pool = self.batch_size + 3
        width = self.max_pages * self.page_size
        req_to_token = torch.randint(0, self.num_pages * self.page_size, (pool, width), generator=g,
                                     dtype=torch.int32)
        rows = torch.randperm(pool, generator=g)[: self.batch_size]
        for b in range(self.batch_size):
            for pos in range(self.seq_lens[b]):
                req_to_token[rows[b], pos] = self.slot(b, pos)
        kw = dict(req_to_token=req_to_token.to(self.device), req_pool_indices=rows.to(self.device),
                  seq_lens=torch.tensor(self.seq_lens, dtype=torch.int64, device=self.device),
                  page_size=self.page_size)
        if decode_form is None:
            decode_form = self.is_decode
        if not decode_form:
            kw["extend_prefix_lens"] = torch.tensor(self.prefix_lens, dtype=torch.int32, device=self.device)
            kw["extend_seq_lens"] = torch.tensor(self.query_lens, dtype=torch.int32, device=self.device)
        if with_out_cache_loc:
            kw["out_cache_loc"] = self.new_token_slots()
        return kw

    def vllm_view(self) -> dict:
        """Keyword arguments for :meth:`PagedKVMeta.from_vllm` (junk past each request's blocks)."""
        g = torch.Generator().manual_seed(self.seed + 2)
        table = torch.randint(0, self.num_pages, (self.batch_size, self.max_pages), generator=g, dtype=torch.int32)
        for b, pages in enumerate(self.pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        qsl = [0]
        for q in self.query_lens:
            qsl.append(qsl[-1] + q)
        return dict(block_table=table.to(self.device),
                    query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
                    seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device),
                    slot_mapping=self.new_token_slots(), page_size=self.page_size)

    def meta(self) -> PagedKVMeta:
        return PagedKVMeta.from_vllm(**self.vllm_view())

    # ------------------------------------------------------------------ data
    def make_kv(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *, head_dim_v: Optional[int] = None,
                poison: float = float("nan"), stale: float = 1000.0):
        """Random per-request K/V ``[seq_len, Hkv, D]`` and a pool holding them at their slots.

        Slots no request owns are filled with ``poison`` so that a kernel reading the wrong page shows. Slots of
        a request's own pages past its sequence end hold large finite junk (``stale``, times a normal sample):
        engines allocate their caches zeroed and overwrite slots, so such slots hold stale finite values, which
        whole-page (TMA) loads read and must mask out.
        Returns ``(k_cache, v_cache, ks, vs)``.
        """
        dv = head_dim_v or head_dim
        g = torch.Generator().manual_seed(self.seed + 3)
        shape = (self.num_pages * self.page_size, num_kv_heads)
        k_flat = torch.full(shape + (head_dim,), poison, dtype=torch.float32)
        v_flat = torch.full(shape + (dv,), poison, dtype=torch.float32)
        ks, vs = [], []
        for b, n in enumerate(self.seq_lens):
            own = torch.tensor(self.pages[b], dtype=torch.long)
            tail = (own[-1:] * self.page_size + torch.arange(self.page_size))[n - (len(own) - 1) * self.page_size:] \
                if len(own) else own
            k_flat[tail] = stale * torch.randn(len(tail), num_kv_heads, head_dim, generator=g)
            v_flat[tail] = stale * torch.randn(len(tail), num_kv_heads, dv, generator=g)
            k = torch.randn(n, num_kv_heads, head_dim, generator=g)
            v = torch.randn(n, num_kv_heads, dv, generator=g)
            pos = torch.arange(n)
            slots = torch.tensor(self.pages[b], dtype=torch.long)[pos // self.page_size] * self.page_size \
                + pos % self.page_size
            k_flat[slots] = k
            v_flat[slots] = v
            ks.append(k.to(dtype).to(self.device))
            vs.append(v.to(dtype).to(self.device))
        k_cache = k_flat.view(self.num_pages, self.page_size, num_kv_heads, head_dim)
        v_cache = v_flat.view(self.num_pages, self.page_size, num_kv_heads, dv)
        return k_cache.to(dtype).to(self.device), v_cache.to(dtype).to(self.device), ks, vs


def random_batch(
    rng: random.Random,
    *,
    batch_size: int,
    page_size: int,
    max_seq_len: int,
    decode: bool = False,
    max_query_len: Optional[int] = None,
    query_lens: Optional[Sequence[int]] = None,
    prefix_lens: Optional[Sequence[int]] = None,
    spare_pages: int = 3,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """A ragged batch with shuffled pages. ``decode=True`` gives one query token per request."""
    if query_lens is None:
        hi = max_query_len or max_seq_len
        query_lens = [1 if decode else rng.randint(1, max(1, min(hi, max_seq_len))) for _ in range(batch_size)]
    if prefix_lens is None:
        prefix_lens = [rng.randint(0, max_seq_len - q) for q in query_lens]
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    max_pages = -(-max(max_seq_len, max(seq_lens)) // page_size)
    needed = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(needed) + spare_pages
    perm = list(range(num_pages))
    rng.shuffle(perm)
    pages, i = [], 0
    for n in needed:
        pages.append(perm[i: i + n])
        i += n
    return PagedBatch(prefix_lens=list(prefix_lens), query_lens=list(query_lens), page_size=page_size,
                      max_pages=max_pages, num_pages=num_pages, pages=pages, device=torch.device(device),
                      seed=rng.randint(0, 2**31 - 1))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix_len: int, causal: bool,
                    sm_scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """One request through ``torch.nn.functional.scaled_dot_product_attention`` (float32, explicit mask).

    ``q [nq, Hq, D]``, ``k``/``v`` ``[nk, Hkv, D]``; query ``i`` sits at position ``prefix_len + i``.
    """
    nq, hq, _ = q.shape
    nk, hkv, _ = k.shape
    qpos = prefix_len + torch.arange(nq, device=q.device)
    kpos = torch.arange(nk, device=q.device)
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        mask &= kpos[None] <= qpos[:, None]
    if sliding_window is not None:
        mask &= kpos[None] >= qpos[:, None] - sliding_window
    qt = q.float().transpose(0, 1)
    kt = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    vt = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=sm_scale)
    return out.transpose(0, 1)
