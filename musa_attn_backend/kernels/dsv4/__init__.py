"""DeepSeek-V4 attention ops: the FP8 "MODEL1" KV cache (584-byte rows) and indexer-key cache (132-byte rows),
their writers and reader, sparse MQA over a sliding-window and a compressed cache with a per-head sink, and the
indexer of the C4 layers (its FP8 queries, the logits for prefill and paged decode, their top-k: :mod:`.indexer`)
and the compressors that fill the compressed caches (:mod:`.compressor`).

Byte formats: :mod:`.layout`. Math: :mod:`.reference` (also the path on a CPU). Every op checks its arguments
before anything runs and names the argument it refuses. Each takes ``impl="auto" | "tilelang" | "reference"``
(``auto``: TileLang on a GPU, the reference on a CPU).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._common import check, check_same_device, resolve_impl
from . import layout
from .layout import (D, D_NOPE, D_ROPE, INDEX_D, INDEX_ROW_BYTES, ROW_BYTES, index_page_bytes, new_kv_cache, page_bytes,
                     paged_view)
from .flash_mla import FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from .schedule import SparseMQAPlan
from .compressor import compress
from .slots import attention_slots
from .indexer import INDEX_HEADS, indexer_logits, indexer_q, indexer_topk, paged_indexer_logits
from .reference import (read_index_k_reference, read_kv_v4_reference, sparse_mqa_reference, write_index_k_reference,
                        write_kv_v4_reference)

__all__ = ["write_kv_v4", "write_index_k", "read_kv_v4", "read_index_k", "sparse_mqa", "layout", "paged_view",
           "new_kv_cache", "page_bytes", "index_page_bytes", "D", "D_NOPE", "D_ROPE", "ROW_BYTES", "INDEX_ROW_BYTES",
           "MAX_HEADS", "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata", "FlashMLASchedMeta",
           "indexer_logits", "paged_indexer_logits", "indexer_topk", "indexer_q", "compress", "INDEX_HEADS",
           "norm_rope_write_kv_v4", "attention_slots", "sparse_mqa_plan", "SparseMQAPlan"]

MAX_HEADS = 128
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_slots(op: str, slots, n: int) -> None:
    check(isinstance(slots, torch.Tensor) and slots.dim() == 1 and not slots.is_floating_point()
          and slots.dtype != torch.bool, lambda: f"{op}: slots must be a 1-D integer tensor")
    check(slots.numel() == n, lambda: f"{op}: slots has {slots.numel()} entries for {n} rows")


def _write(op: str, x, width: int, name: str, cache, slots, pages_of, reference, impl: str, **kernel_args) -> None:
    """Check a writer's arguments, then run its reference or its TileLang kernel (``op``'s)."""
    check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == width,
          lambda: f"{op}: {name} must be [num_tokens, {width}], got {tuple(getattr(x, 'shape', ()))}")
    check(x.dtype in _IN_DTYPES, lambda: f"{op}: {name} dtype must be bfloat16, float16 or float32, got {x.dtype}")
    _check_slots(op, slots, x.shape[0])
    pages_of(cache, op=op)
    check_same_device(op, **{name: x}, cache=cache, slots=slots)
    if resolve_impl(impl, x.device, op) == "reference" or x.shape[0] == 0:
        reference(x, cache, slots)
        return
    from . import tilelang_impl

    getattr(tilelang_impl, f"{op}_tilelang")(x, cache, slots, **kernel_args)


def write_kv_v4(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, *, impl: str = "auto") -> None:
    """Quantise ``kv [T, 512]`` (bf16; fp16/fp32 accepted) into ``cache`` (584-byte rows, :mod:`.layout`) at
    ``slots [T]`` (``page * rows + row``), in place. Bytes identical to the engines' writers (:mod:`.reference`).
    A negative slot, or one at or past the cache's slot count, is skipped: nothing is written for it, and the
    slots are not read on the host (no synchronisation, so the op can be captured in a CUDA graph). Duplicate
    slots: which row lands is unspecified."""
    _write("write_kv_v4", kv, D, "kv", cache, slots, layout.kv_pages, write_kv_v4_reference, impl)


def norm_rope_write_kv_v4(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                          positions: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, *,
                          impl: str = "auto") -> None:
    """The attention K path of a V4 layer into the SWA cache: ``y = kv * rsqrt(mean(kv^2) + eps) * weight``
    (float32), GPT-J RoPE of ``y``'s last 64 dims at ``positions [T]`` (``cos``, ``sin [max_pos, 32]``), ``y``
    rounded to bf16, then :func:`write_kv_v4` at ``slots`` (SGLang's ``fused_k_norm_rope_flashmla``). On a GPU:
    two TileLang programs, the norm + RoPE rows (:mod:`.model_kernel`) and the writer."""
    from .model import _rotate

    op = "norm_rope_write_kv_v4"
    check(isinstance(kv, torch.Tensor) and kv.dim() == 2 and kv.shape[1] == D and kv.dtype in _IN_DTYPES,
          lambda: f"{op}: kv must be a bf16/fp16/fp32 [T, {D}] tensor, got {getattr(kv, 'dtype', None)} "
                  f"{tuple(getattr(kv, 'shape', ()))}")
    T = kv.shape[0]
    check(isinstance(weight, torch.Tensor) and weight.numel() == D, lambda: f"{op}: weight must have {D} values")
    check(isinstance(eps, float) and eps > 0, lambda: f"{op}: eps must be a positive float, got {eps!r}")
    check(isinstance(positions, torch.Tensor) and not positions.is_floating_point() and positions.dim() == 1
          and positions.numel() == T, lambda: f"{op}: positions must be an integer [{T}] tensor")
    for name, t in (("cos", cos), ("sin", sin)):
        check(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == D_ROPE // 2,
              lambda: f"{op}: {name} must be a [max_pos, {D_ROPE // 2}] tensor")
    check_same_device(op, kv=kv, weight=weight, positions=positions, cos=cos, sin=sin, cache=cache, slots=slots)
    if resolve_impl(impl, kv.device, op) == "tilelang":
        from .model_tilelang import norm_rope_rows

        y = norm_rope_rows(kv.unsqueeze(1), weight, eps, cos, sin, positions, norm="weight", round_mid=False,
                           inverse=False, out_dtype=torch.bfloat16)
        write_kv_v4(y.squeeze(1), cache, slots, impl=impl)
        return
    x = kv.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()
    y = torch.cat([y[:, :D_NOPE], _rotate(y[:, D_NOPE:], cos, sin, positions, False)], dim=1)
    write_kv_v4(y.to(torch.bfloat16), cache, slots, impl=impl)


def write_index_k(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, *, scale: str = "pow2",
                  impl: str = "auto") -> None:
    """Quantise indexer keys ``k [T, 128]`` into ``cache`` (132-byte rows: 128 FP8 bytes, then the page's float32
    scales) at ``slots [T]``, in place; slots negative or at or past the slot count are skipped, as in
    :func:`write_kv_v4`. ``scale``: a row's ``max(amax, 1e-4) / 448`` rounded up to a power of two (``"pow2"``:
    vLLM) or as is (``"exact"``: SGLang)."""
    check(scale in ("pow2", "exact"), lambda: f"write_index_k: scale must be 'pow2' or 'exact', got {scale!r}")
    _write("write_index_k", k, INDEX_D, "k", cache, slots, layout.index_pages,
           lambda x, c, s: write_index_k_reference(x, c, s, scale), impl, scale_rule=scale)


def _check_read(op: str, pages, slots) -> None:
    check(isinstance(slots, torch.Tensor) and slots.dim() == 1 and not slots.is_floating_point(),
          lambda: f"{op}: slots must be a 1-D integer tensor")
    check(slots.numel() == 0 or (int(slots.min()) >= 0 and int(slots.max()) < pages.num_slots),
          lambda: f"{op}: every slot must be in [0, {pages.num_slots})")


def read_kv_v4(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised rows ``[N, 512]`` bf16 at ``slots`` (each in ``[0, slots of the cache)``): the nope values
    ``e4m3 * 2^(exponent - 127)`` and the RoPE values, exact in bf16."""
    _check_read("read_kv_v4", layout.kv_pages(cache, op="read_kv_v4"), slots)
    return read_kv_v4_reference(cache, slots)


def read_index_k(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised indexer keys ``[N, 128]`` float32 at ``slots``."""
    _check_read("read_index_k", layout.index_pages(cache, op="read_index_k"), slots)
    return read_index_k_reference(cache, slots)


def _check_index_set(op: str, q, name: str, cache_name: str, cache, indices, lengths) -> None:
    layout.kv_pages(cache, cache_name, op=op)
    check(isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.dtype == torch.int32,
          lambda: f"{op}: {name} must be an int32 tensor [num_tokens, topk], got "
                  f"{getattr(indices, 'dtype', None)} {tuple(getattr(indices, 'shape', ()))}")
    check(indices.shape[0] == q.shape[0],
          lambda: f"{op}: {name} has {indices.shape[0]} rows for {q.shape[0]} query tokens")
    if lengths is not None:
        check(isinstance(lengths, torch.Tensor) and lengths.dim() == 1 and lengths.numel() == q.shape[0]
              and not lengths.is_floating_point() and lengths.dtype != torch.bool,
              lambda: f"{op}: the lengths of {name} must be a 1-D integer tensor of {q.shape[0]} entries")


def check_sparse_mqa_args(q, cache, indices, lengths=None, *, extra_cache=None, extra_indices=None,
                          extra_lengths=None, sink=None, sm_scale=None, out=None, plan=None) -> None:
    op = "sparse_mqa"
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] == D,
          lambda: f"{op}: q must be [num_tokens, num_heads, {D}], got {tuple(getattr(q, 'shape', ()))}")
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32),
          lambda: f"{op}: q dtype must be bfloat16 (float16/float32 accepted), got {q.dtype}")
    check(1 <= q.shape[1] <= MAX_HEADS, lambda: f"{op}: num_heads must be in [1, {MAX_HEADS}], got {q.shape[1]}")
    _check_index_set(op, q, "indices", "cache", cache, indices, lengths)
    check((extra_cache is None) == (extra_indices is None),
          f"{op}: extra_cache and extra_indices go together (both or neither)")
    check(extra_lengths is None or extra_indices is not None, f"{op}: extra_lengths without extra_indices")
    if extra_cache is not None:
        _check_index_set(op, q, "extra_indices", "extra_cache", extra_cache, extra_indices, extra_lengths)
    if sink is not None:
        check(isinstance(sink, torch.Tensor) and sink.dim() == 1 and sink.numel() == q.shape[1]
              and sink.dtype == torch.float32, lambda: f"{op}: sink must be a float32 tensor [{q.shape[1]}]")
    check(sm_scale is None or (isinstance(sm_scale, (int, float)) and sm_scale > 0),
          lambda: f"{op}: sm_scale must be a positive number, got {sm_scale!r}")
    if out is not None:
        check(isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype
              and out.is_contiguous(), lambda: f"{op}: out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    check_same_device(op, q=q, cache=cache, indices=indices, lengths=lengths, extra_cache=extra_cache,
                      extra_indices=extra_indices, extra_lengths=extra_lengths, sink=sink, out=out)
    if plan is not None:
        check(isinstance(plan, SparseMQAPlan), lambda: f"{op}: plan must come from sparse_mqa_plan, got "
                                                      f"{type(plan).__name__}")
        k2 = extra_indices.shape[1] if extra_indices is not None else 0
        plan.check_matches(op, q.shape[0], indices.shape[1], k2, q.device)


def sparse_mqa(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
               *, extra_cache: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
               extra_lengths: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
               sm_scale: Optional[float] = None, out: Optional[torch.Tensor] = None, return_lse: bool = False,
               plan: Optional[SparseMQAPlan] = None, impl: str = "auto"):
    """Sparse multi-query attention of DeepSeek-V4, decode and prefill alike.

    Query token ``t`` (``q [T, H, 512]``) attends to the rows of ``cache`` at ``indices[t, :K1]`` (physical slots
    ``page * rows + row``) and, where given, the rows of ``extra_cache`` at ``extra_indices[t, :K2]``: the
    window rows and the compressed rows of a V4 layer. Entry ``j`` counts only if ``j < lengths[t]`` (all entries
    when ``lengths`` is None), and the index is ``>= 0`` and below its cache's slot count; any other entry is
    skipped and its row never read. One softmax runs over the union of both sets and the per-head ``sink``:
    ``o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h})`` with ``s_j = sm_scale * q . k_j`` and ``k_j = v_j``
    the dequantised 512-d row (``sm_scale`` default ``512 ** -0.5``). Returns ``o [T, H, 512]`` in q's dtype
    (written into ``out`` if given) and, with ``return_lse``, ``lse [T, H]`` float32: the natural-log
    ``log(sum_j e^{s_j})``, sink excluded (FlashMLA's convention); a token with no valid entry gets ``o = 0``,
    ``lse = -inf``.

    ``plan``: the work plan of the scheduled program (``MUSA_ATTN_DSV4_PROGRAM=scheduled``), from
    :func:`sparse_mqa_plan` for this batch's shapes and lengths, so that layers of one kind share it (made per
    call when None; checked against the call's shapes, ignored by the other programs and the reference).
    """
    check_sparse_mqa_args(q, cache, indices, lengths, extra_cache=extra_cache, extra_indices=extra_indices,
                          extra_lengths=extra_lengths, sink=sink, sm_scale=sm_scale, out=out, plan=plan)
    which = resolve_impl(impl, q.device, "sparse_mqa")
    kwargs = dict(extra_cache=extra_cache, extra_indices=extra_indices, extra_lengths=extra_lengths, sink=sink,
                  sm_scale=D ** -0.5 if sm_scale is None else float(sm_scale), out=out, return_lse=return_lse)
    if which == "reference" or q.shape[0] == 0:
        return sparse_mqa_reference(q, cache, indices, lengths, **kwargs)
    from .tilelang_impl import sparse_mqa_tilelang

    return sparse_mqa_tilelang(q, cache, indices, lengths, plan=plan, **kwargs)


def sparse_mqa_plan(q: torch.Tensor, indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                    extra_indices: Optional[torch.Tensor] = None,
                    extra_lengths: Optional[torch.Tensor] = None) -> SparseMQAPlan:
    """The scheduled program's work plan (:mod:`.schedule`) for :func:`sparse_mqa` calls of these shapes and
    lengths (the tensors' values are read on the device; nothing synchronises): make it once per batch and pass it
    to every layer whose index lists have these lengths."""
    op = "sparse_mqa_plan"
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] == D,
          lambda: f"{op}: q must be [num_tokens, num_heads, {D}], got {tuple(getattr(q, 'shape', ()))}")
    for name, idx, lens in (("indices", indices, lengths), ("extra_indices", extra_indices, extra_lengths)):
        if idx is None:
            check(lens is None, lambda: f"{op}: {name} lengths without {name}")
            continue
        check(isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[0] == q.shape[0],
              lambda: f"{op}: {name} must be [{q.shape[0]}, topk]")
        check(lens is None or (isinstance(lens, torch.Tensor) and lens.dim() == 1 and lens.numel() == q.shape[0]),
              lambda: f"{op}: the lengths of {name} must be a 1-D tensor of {q.shape[0]} entries")
    from .tilelang_impl import sparse_mqa_plan as make

    return make(q, indices, lengths, extra_indices if extra_indices is not None and extra_indices.shape[1] else None,
                extra_lengths if extra_indices is not None and extra_indices.shape[1] else None)
