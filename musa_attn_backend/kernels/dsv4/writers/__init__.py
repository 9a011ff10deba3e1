"""The V4 cache writers and readers: the attention cache's 584-byte FP8 rows (:func:`write_kv_v4`, with the K
path's norm and RoPE in :func:`norm_rope_write_kv_v4`) and the indexer-key cache's 132-byte rows
(:func:`write_index_k`), checked, then the reference or the TileLang writer (:mod:`.kernel`). Byte formats:
:mod:`.layout`."""

from __future__ import annotations

import torch

from ..._common import check, check_same_device, resolve_impl
from .. import layout
from ..layout import D, D_NOPE, D_ROPE, INDEX_D
from .reference import read_index_k_reference, read_kv_v4_reference, write_index_k_reference, write_kv_v4_reference

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
    two TileLang programs, the norm + RoPE rows (:mod:`..model.kernel`) and the writer."""
    from ..model import _rotate

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
        from ..model.tilelang_impl import norm_rope_rows

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
