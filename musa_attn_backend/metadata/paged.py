"""Engine-neutral paged-KV metadata: one batch as the attention kernels read it.

One :class:`PagedKVMeta` describes a batch the way the kernels want it, whatever engine built it (the engine
translations live in :mod:`.sglang` and :mod:`.vllm`):

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

Every constructor ends in :meth:`PagedKVMeta.from_lengths` (per-request lengths, page table, slots), so both
engines' constructors produce identical tensors for the same logical batch (a property test checks it).

CUDA graphs: :meth:`PagedKVMeta.allocate` makes a capacity-sized instance; passing it as ``out=`` to any
constructor writes the batch into those buffers in place and returns views of them, so the tensor addresses
a captured graph recorded stay valid. The decode path (query lengths all 1) never reads a device value on
the host when ``max_seqlen_k`` is given or may default to the page-table capacity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PagedKVMeta", "require", "check_1d", "check_page_size", "cumsum0"]


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_1d(name: str, t: torch.Tensor, length: Optional[int] = None) -> None:
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    require(not t.is_floating_point(), f"{name} must be an integer tensor, got {t.dtype}")
    if length is not None:
        require(t.numel() == length, f"{name} must have {length} elements (one per request), got {t.numel()}")


# engine -> its translation of batch tensors into PagedKVMeta: each engine's module (metadata/sglang.py,
# metadata/vllm.py) registers itself, so this engine-neutral module imports neither
_TRANSLATIONS: dict = {}


def register_translation(engine: str, fn) -> None:
    _TRANSLATIONS[engine] = fn


def _translation(engine: str):
    """The registered translation (the package's ``__init__`` imports both engines' modules before any of its
    modules can be used)."""
    return _TRANSLATIONS[engine]


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
        require(0 <= start < stop <= self.batch_size, f"requests({start}, {stop}) of a batch of {self.batch_size}")
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
        require(0 < self.num_decodes < self.batch_size,
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
        require(max_batch >= 1 and max_tokens >= 1 and max_pages >= 1, "allocate: capacities must be >= 1")
        check_page_size(page_size)
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
    def from_sglang(cls, **kwargs) -> "PagedKVMeta":
        """From SGLang's batch tensors (``req_to_token``, ``req_pool_indices``, ``seq_lens``, ...): see
        :func:`musa_attn_backend.metadata.sglang.paged_kv_meta` for the arguments."""
        return _translation("sglang")(**kwargs)

    @classmethod
    def from_vllm(cls, **kwargs) -> "PagedKVMeta":
        """From vLLM's ``CommonAttentionMetadata`` tensors (``block_table``, ``query_start_loc``, ``seq_lens``,
        ``slot_mapping``, ``page_size``): see :func:`musa_attn_backend.metadata.vllm.paged_kv_meta`."""
        return _translation("vllm")(**kwargs)

    @classmethod
    def from_lengths(cls, *, query_lens: torch.Tensor, seqlens_k: torch.Tensor, prefix_lens: torch.Tensor,
                     page_table: torch.Tensor, slot_mapping: torch.Tensor, page_size: int,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     out: Optional["PagedKVMeta"] = None) -> "PagedKVMeta":
        """The engine-neutral constructor every engine translation ends in.

        ``query_lens``, ``seqlens_k``, ``prefix_lens`` int32 ``[B]`` on the page table's device;
        ``page_table`` int32 ``[B, pages]`` (entries past a request's last page may hold anything: they are
        zeroed here); ``slot_mapping`` int64 ``[num_tokens]``. ``max_seqlen_q`` defaults to the longest query
        (a host sync unless every request is a decode), ``max_seqlen_k`` to the page-table capacity. With
        ``out=`` (from :meth:`allocate`) the batch is written into those buffers and views of them returned.
        """
        q_lens, prefix, pages, slots = query_lens, prefix_lens, page_table, slot_mapping
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
        cu = cumsum0(q_lens)
        if out is None:
            return cls(cu_seqlens_q=cu, seqlens_k=seqlens_k, prefix_lens=prefix, page_table=pages.contiguous(),
                       slot_mapping=slots, page_size=page_size, max_seqlen_q=int(max_seqlen_q),
                       max_seqlen_k=int(max_seqlen_k))
        require(out.page_size == page_size, f"out= buffers were allocated for page_size {out.page_size}, "
                                             f"batch has {page_size}")
        require(bs <= out.batch_size, f"batch of {bs} exceeds the out= capacity of {out.batch_size}")
        require(num_tokens <= out.num_tokens, f"{num_tokens} tokens exceed the out= capacity of {out.num_tokens}")
        require(pages.shape[1] <= out.max_pages,
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
        require(int(self.cu_seqlens_q[0]) == 0, "cu_seqlens_q[0] must be 0")
        require(bool((q_lens >= 0).all()), "cu_seqlens_q must be non-decreasing")
        require(int(self.cu_seqlens_q[-1]) == self.num_tokens,
                f"cu_seqlens_q[-1]={int(self.cu_seqlens_q[-1])} but slot_mapping has {self.num_tokens} tokens")
        require(bool((self.prefix_lens >= 0).all()), "prefix lengths must be >= 0 (seq_lens < query lengths?)")
        require(bool((self.prefix_lens + q_lens == self.seqlens_k).all()), "seqlens_k != prefix + query length")
        if self.batch_size:
            require(int(q_lens.max()) <= self.max_seqlen_q, "max_seqlen_q is smaller than a query length")
            require(int(self.seqlens_k.max()) <= self.max_seqlen_k, "max_seqlen_k is smaller than a sequence")
            require(int(self.seqlens_k.max()) <= self.max_pages * self.page_size,
                    "a sequence is longer than the page table can address")


def check_page_size(page_size) -> None:
    require(isinstance(page_size, int) and page_size >= 1,
            f"page_size must be a positive int, got {page_size!r}")


def cumsum0(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens, 0, dtype=torch.int32)
    return out
