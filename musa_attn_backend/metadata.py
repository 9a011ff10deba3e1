"""Paged-KV metadata shared by the SGLang and vLLM adapters.

One :class:`PagedKVMeta` describes a batch the way the kernels want it, whatever engine built it:

* ``cu_seqlens_q`` int32 ``[B + 1]``: query tokens of request ``b`` are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
  of the packed ``q``.
* ``seqlens_k`` int32 ``[B]``: keys visible to request ``b`` (cached prefix + new tokens).
* ``prefix_lens`` int32 ``[B]``: keys already cached before this step (``seqlens_k - query lengths``); query row
  ``i`` of request ``b`` sits at absolute position ``prefix_lens[b] + i``.
* ``page_table`` int32 ``[B, max_pages]``: page ``j`` of request ``b``; entries past the request's last page are 0.
* ``slot_mapping`` int64 ``[num_tokens]``: cache slot (``page * page_size + offset``) for each new token, < 0 = skip.
* ``page_size``, ``max_seqlen_q``, ``max_seqlen_k`` (host ints; ``max_seqlen_k`` may be an upper bound).
* ``num_decodes`` (host int, default 0 = not known): the first ``num_decodes`` requests have one query token
  each. An engine that orders decodes first (vLLM) may say so; the GPU path then runs them with the decode
  kernel and only the rest with the prefill kernel.
* ``new_kv_only`` (host bool, default False = not known): no request after the leading ``num_decodes`` has a
  cached prefix, so each one's keys are exactly its new tokens (rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of
  the batch's new K/V). The engines set it from host-side lengths; the GPU prefill may then read the new K/V
  instead of the cache (``paged_attention(new_kv=...)``).

Both constructors produce identical tensors for the same logical batch (a property test checks it).

CUDA graphs: :meth:`PagedKVMeta.allocate` makes a capacity-sized instance; passing it as ``out=`` to either
constructor writes the batch into those buffers in place and returns views of them, so the tensor addresses
a captured graph recorded stay valid. The decode path (query lengths all 1) never reads a device value on
the host when ``max_seqlen_k`` is given or may default to the page-table capacity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PagedKVMeta"]


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_1d(name: str, t: torch.Tensor, length: Optional[int] = None) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    _require(not t.is_floating_point(), f"{name} must be an integer tensor, got {t.dtype}")
    if length is not None:
        _require(t.numel() == length, f"{name} must have {length} elements (one per request), got {t.numel()}")


@dataclass
class PagedKVMeta:
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    prefix_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_decodes: int = 0
    new_kv_only: bool = False

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        return self.seqlens_k.numel()

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.seqlens_k.device

    @property
    def is_decode(self) -> bool:
        """Every request has exactly one query token."""
        return self.max_seqlen_q == 1

    def requests(self, start: int, stop: int, *, max_seqlen_q: Optional[int] = None) -> "PagedKVMeta":
        """Requests ``start:stop`` as a batch of their own (fresh, aligned tensors; query rows keep their indices
        into the packed ``q``, so ``cu_seqlens_q`` is not rebased and ``slot_mapping`` stays whole)."""
        _require(0 <= start < stop <= self.batch_size, f"requests({start}, {stop}) of a batch of {self.batch_size}")
        return PagedKVMeta(cu_seqlens_q=self.cu_seqlens_q[start:stop + 1].clone(),
                           seqlens_k=self.seqlens_k[start:stop].clone(),
                           prefix_lens=self.prefix_lens[start:stop].clone(),
                           page_table=self.page_table[start:stop].clone(), slot_mapping=self.slot_mapping,
                           page_size=self.page_size,
                           max_seqlen_q=self.max_seqlen_q if max_seqlen_q is None else max_seqlen_q,
                           max_seqlen_k=self.max_seqlen_k,
                           new_kv_only=self.new_kv_only and start >= self.num_decodes)

    def decode_split(self) -> tuple["PagedKVMeta", "PagedKVMeta"]:
        """The leading ``num_decodes`` requests (one query token each) and the rest, as batches of their own
        (:meth:`requests`). Built on the first call and reused by every later one (every layer of the step): a
        metadata object whose ``num_decodes`` is set is read-only, the engines build one per batch."""
        _require(0 < self.num_decodes < self.batch_size,
                 f"decode_split: num_decodes {self.num_decodes} must be in (0, batch size {self.batch_size})")
        views = self.__dict__.get("_decode_split")
        if views is None:
            views = (self.requests(0, self.num_decodes, max_seqlen_q=1),
                     self.requests(self.num_decodes, self.batch_size))
            self.__dict__["_decode_split"] = views  # not a field: dataclasses.replace() starts without it
        return views

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    # ------------------------------------------------------------------ capacity buffers
    @classmethod
    def allocate(cls, max_batch: int, max_tokens: int, max_pages: int, page_size: int,
                 device: torch.device | str) -> "PagedKVMeta":
        """Fixed-capacity buffers to pass as ``out=`` (CUDA-graph capture and replay)."""
        _require(max_batch >= 1 and max_tokens >= 1 and max_pages >= 1, "allocate: capacities must be >= 1")
        _check_page_size(page_size)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            cu_seqlens_q=torch.zeros(max_batch + 1, **i32),
            seqlens_k=torch.zeros(max_batch, **i32),
            prefix_lens=torch.zeros(max_batch, **i32),
            page_table=torch.zeros(max_batch, max_pages, **i32),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            page_size=page_size,
            max_seqlen_q=1,
            max_seqlen_k=max_pages * page_size,
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_sglang(
        cls,
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
        out: Optional["PagedKVMeta"] = None,
    ) -> "PagedKVMeta":
        """From SGLang's batch view.

        ``req_to_token`` ``[pool_size, max_context]`` maps (request slot, token position) to a KV slot;
        SGLang allocates whole pages, so the page of position ``p`` is ``req_to_token[r, p] // page_size`` and
        the first position of each page gives the page table. ``seq_lens`` are total lengths (prefix + new).
        For a decode batch leave ``extend_prefix_lens``/``extend_seq_lens`` out (one new token per request).
        ``out_cache_loc`` (slots of the new tokens) defaults to ``req_to_token`` at the new positions, where
        SGLang has written it before the forward pass.
        """
        _check_page_size(page_size)
        _require(isinstance(req_to_token, torch.Tensor) and req_to_token.dim() == 2,
                 "req_to_token must be a 2-D tensor [pool_size, max_context_len]")
        _check_1d("req_pool_indices", req_pool_indices)
        bs = req_pool_indices.numel()
        _check_1d("seq_lens", seq_lens, bs)
        _require((extend_prefix_lens is None) == (extend_seq_lens is None),
                 "extend_prefix_lens and extend_seq_lens must be given together (or both omitted for decode)")
        device = req_to_token.device
        seqlens_k = seq_lens.to(device=device, dtype=torch.int32)
        if extend_seq_lens is None:
            q_lens = torch.ones(bs, dtype=torch.int32, device=device)
            prefix = seqlens_k - 1
            if max_seqlen_q is None:
                max_seqlen_q = 1
        else:
            _check_1d("extend_seq_lens", extend_seq_lens, bs)
            _check_1d("extend_prefix_lens", extend_prefix_lens, bs)
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
            cu = _cumsum0(q_lens)
            tok_req = torch.repeat_interleave(torch.arange(bs, device=device), q_lens.long())
            tok_pos = prefix.long()[tok_req] + (torch.arange(tok_req.numel(), device=device) - cu.long()[tok_req])
            slots = rows[tok_req, tok_pos].long()
        else:
            _check_1d("out_cache_loc", out_cache_loc)
            slots = out_cache_loc.to(device=device, dtype=torch.int64)
        return cls._finish(q_lens, seqlens_k, prefix, pages, slots, page_size, max_seqlen_q, max_seqlen_k, out)

    @classmethod
    def from_vllm(
        cls,
        *,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        page_size: int,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None,
        out: Optional["PagedKVMeta"] = None,
    ) -> "PagedKVMeta":
        """From vLLM's ``CommonAttentionMetadata`` view (``block_table_tensor``, ``query_start_loc``,
        ``seq_lens``, ``slot_mapping``; ``page_size`` = the kernel block size)."""
        _check_page_size(page_size)
        _require(isinstance(block_table, torch.Tensor) and block_table.dim() == 2,
                 "block_table must be a 2-D tensor [num_reqs, max_blocks]")
        bs = seq_lens.numel()
        _check_1d("seq_lens", seq_lens, bs)
        _check_1d("query_start_loc", query_start_loc, bs + 1)
        _check_1d("slot_mapping", slot_mapping)
        _require(block_table.shape[0] >= bs, f"block_table has {block_table.shape[0]} rows for {bs} requests")
        device = block_table.device
        qsl = query_start_loc.to(device=device, dtype=torch.int32)
        q_lens = qsl[1:] - qsl[:-1]
        seqlens_k = seq_lens.to(device=device, dtype=torch.int32)
        prefix = seqlens_k - q_lens
        pages = block_table[:bs].to(torch.int32)
        slots = slot_mapping.to(device=device, dtype=torch.int64)
        return cls._finish(q_lens, seqlens_k, prefix, pages, slots, page_size, max_seqlen_q, max_seqlen_k, out)

    # ------------------------------------------------------------------ shared tail
    @classmethod
    def _finish(cls, q_lens, seqlens_k, prefix, pages, slots, page_size, max_seqlen_q, max_seqlen_k, out):
        bs = seqlens_k.numel()
        num_tokens = slots.numel()
        # Pages past each request's last one are zeroed so that both engines' views agree exactly
        # (and a kernel that over-reads never follows a stale page id).
        used = torch.div(seqlens_k + (page_size - 1), page_size, rounding_mode="floor")
        col = torch.arange(pages.shape[1], device=pages.device, dtype=torch.int32)
        pages = torch.where(col[None, :] < used[:, None], pages, torch.zeros((), dtype=torch.int32,
                                                                              device=pages.device))
        if max_seqlen_q is None:
            # With every request holding >= 1 query token, num_tokens == batch means all are decodes:
            # no host sync on that path.
            max_seqlen_q = 1 if num_tokens == bs else int(q_lens.max().item()) if bs else 0
        if max_seqlen_k is None:
            max_seqlen_k = (out.max_pages if out is not None else pages.shape[1]) * page_size
        cu = _cumsum0(q_lens)
        if out is None:
            return cls(cu_seqlens_q=cu, seqlens_k=seqlens_k, prefix_lens=prefix, page_table=pages.contiguous(),
                       slot_mapping=slots, page_size=page_size, max_seqlen_q=int(max_seqlen_q),
                       max_seqlen_k=int(max_seqlen_k))
        _require(out.page_size == page_size, f"out= buffers were allocated for page_size {out.page_size}, "
                                             f"batch has {page_size}")
        _require(bs <= out.batch_size, f"batch of {bs} exceeds the out= capacity of {out.batch_size}")
        _require(num_tokens <= out.num_tokens, f"{num_tokens} tokens exceed the out= capacity of {out.num_tokens}")
        _require(pages.shape[1] <= out.max_pages,
                 f"the page table has {pages.shape[1]} columns; the out= buffers hold {out.max_pages}")
        out.cu_seqlens_q[: bs + 1].copy_(cu)
        out.seqlens_k[:bs].copy_(seqlens_k)
        out.prefix_lens[:bs].copy_(prefix)
        width = pages.shape[1]
        out.page_table[:bs, :width].copy_(pages)
        if width < out.max_pages:
            out.page_table[:bs, width:].zero_()
        out.slot_mapping[:num_tokens].copy_(slots)
        return cls(cu_seqlens_q=out.cu_seqlens_q[: bs + 1], seqlens_k=out.seqlens_k[:bs],
                   prefix_lens=out.prefix_lens[:bs], page_table=out.page_table[:bs],
                   slot_mapping=out.slot_mapping[:num_tokens], page_size=page_size,
                   max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))

    # ------------------------------------------------------------------ host-side helpers (tests, reference)
    def query_lens(self) -> torch.Tensor:
        return self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]

    def validate(self) -> None:
        """Host-side consistency check (syncs; for tests and debugging, not the hot path)."""
        q_lens = self.query_lens()
        _require(int(self.cu_seqlens_q[0]) == 0, "cu_seqlens_q[0] must be 0")
        _require(bool((q_lens >= 0).all()), "cu_seqlens_q must be non-decreasing")
        _require(int(self.cu_seqlens_q[-1]) == self.num_tokens,
                 f"cu_seqlens_q[-1]={int(self.cu_seqlens_q[-1])} but slot_mapping has {self.num_tokens} tokens")
        _require(bool((self.prefix_lens >= 0).all()), "prefix lengths must be >= 0 (seq_lens < query lengths?)")
        _require(bool((self.prefix_lens + q_lens == self.seqlens_k).all()), "seqlens_k != prefix + query length")
        if self.batch_size:
            _require(int(q_lens.max()) <= self.max_seqlen_q, "max_seqlen_q is smaller than a query length")
            _require(int(self.seqlens_k.max()) <= self.max_seqlen_k, "max_seqlen_k is smaller than a sequence")
            _require(int(self.seqlens_k.max()) <= self.max_pages * self.page_size,
                     "a sequence is longer than the page table can address")


def _check_page_size(page_size) -> None:
    _require(isinstance(page_size, int) and page_size >= 1,
             f"page_size must be a positive int, got {page_size!r}")


def _cumsum0(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens, 0, dtype=torch.int32)
    return out
