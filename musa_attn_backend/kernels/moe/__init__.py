"""MoE experts with block-scaled FP8 weights (DeepSeek-V4's routed experts): :func:`fused_experts` (the routed
experts of one layer: routing, activation quantisation, the two grouped GEMMs, clamped SwiGLU, the weighted sum;
:mod:`.layer`), built on the grouped GEMMs with DeepGEMM's semantics, :func:`grouped_gemm_fp8` (the contiguous
layout, prefill) and :func:`grouped_gemm_fp8_masked` (the masked layout, decode under CUDA graphs), and
:func:`quantize_groups` (the 1 x 128 activation quantisation they read), and :func:`swiglu_quant` (V4's SwiGLU
of GEMM1's rows quantised for GEMM2 in one pass; :func:`grouped_gemm_swiglu_fp8` and
:func:`grouped_gemm_swiglu_fp8_masked`: both in GEMM1's epilogue).
Formats and the exact rule of each
layout: :mod:`.reference` (also the path on a CPU).

Every op checks its arguments before anything runs and names the argument it refuses; none reads its index
tensors on the host. Each takes ``impl="auto" | "tilelang" | "reference"`` (``auto``: TileLang on a GPU, the
reference on a CPU).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...platform import features_of
from .._common import check, check_same_device, resolve_impl
from . import layer
from .layer import (MASKED_MAX_TOKENS, combine_reference, fused_experts_reference, quantize_scatter_reference,
                    grouped_gemm_swiglu_contiguous_reference, grouped_gemm_swiglu_masked_reference,
                    route_masked_reference, swiglu_quant_reference)
from .reference import (ALIGN, BLOCK, FP4_GROUP, align_routing, dequantize_fp4, dequantize_fp8_blocks,
                        dequantize_groups, grouped_gemm_contiguous_reference, grouped_gemm_masked_reference,
                        quantize_fp4_reference, quantize_groups_reference, quantize_weight_blocks_reference)

__all__ = ["fused_experts", "fused_experts_reference", "combine_experts", "combine_reference", "quantize_scatter",
           "route_masked", "route_masked_reference",
           "quantize_scatter_reference", "grouped_gemm_fp8",
           "grouped_gemm_fp8_masked",
           "quantize_groups", "swiglu_quant", "swiglu_quant_reference", "grouped_gemm_swiglu_fp8",
           "grouped_gemm_swiglu_contiguous_reference", "grouped_gemm_swiglu_fp8_masked",
           "grouped_gemm_swiglu_masked_reference", "align_routing", "ALIGN", "BLOCK",
           "grouped_gemm_contiguous_reference", "grouped_gemm_masked_reference", "quantize_groups_reference", "quantize_weight_blocks_reference",
           "quantize_fp4_reference", "dequantize_fp8_blocks", "dequantize_fp4", "dequantize_groups", "FP4_GROUP"]

FP8 = torch.float8_e4m3fn
LAYOUTS = ("auto", "contiguous", "masked")


def _tensor(op, name, t, dtype, shape):
    """``t`` is a contiguous ``dtype`` tensor of ``shape`` (None entries: any size)."""
    check(isinstance(t, torch.Tensor), lambda: f"{op}: {name} must be a tensor, got {type(t).__name__}")
    check(t.dtype == dtype, lambda: f"{op}: {name} must be {dtype}, got {t.dtype}")
    check(t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape)),
          lambda: f"{op}: {name} must have shape {tuple('*' if s is None else s for s in shape)}, got "
                  f"{tuple(t.shape)}")
    check(t.is_contiguous(), lambda: f"{op}: {name} must be contiguous")


def _weights(op, b, b_scale, name="b", fp4=False):
    """Checks expert weights with their scales: FP8 ``[E, N, K]`` with float32 ``[E, N/128, K/128]`` block scales,
    or (``fp4``) also MXFP4 ``[E, N, K/2]`` uint8 with ``[E, N, K/32]`` scales, UE8M0 bytes (uint8) or float32
    powers of two. Returns ``(E, N, K, is_fp4)``."""
    check(isinstance(b, torch.Tensor) and b.dim() == 3, lambda: f"{op}: {name} must be a [E, N, K] tensor")
    is_fp4 = fp4 and b.dtype == torch.uint8
    check(b.dtype == FP8 or is_fp4,
          lambda: f"{op}: {name} must be float8_e4m3fn (128 x 128 block-scaled FP8 weights)"
                  + (" or uint8 (packed MXFP4)" if fp4 else "") + f", got {b.dtype}")
    E, N, K = b.shape[0], b.shape[1], b.shape[2] * (2 if is_fp4 else 1)
    check(E >= 1 and N % BLOCK == 0 and K % BLOCK == 0 and N > 0 and K > 0,
          lambda: f"{op}: {name}'s N and K must be positive multiples of {BLOCK} (its scale blocks), got N {N}, "
                  f"K {K}")
    if is_fp4:
        _tensor(op, name, b, torch.uint8, (E, N, K // 2))
        check(isinstance(b_scale, torch.Tensor) and b_scale.dtype in (torch.uint8, torch.float32),
              lambda: f"{op}: {name}_scale of FP4 weights must be uint8 (UE8M0 bytes) or float32 (powers of two), "
                      f"got {getattr(b_scale, 'dtype', type(b_scale).__name__)}")
        _tensor(op, f"{name}_scale", b_scale, b_scale.dtype, (E, N, K // FP4_GROUP))
    else:
        _tensor(op, name, b, FP8, (E, N, K))
        _tensor(op, f"{name}_scale", b_scale, torch.float32, (E, N // BLOCK, K // BLOCK))
    return E, N, K, is_fp4


def _run(op, impl, device):
    which = resolve_impl(impl, device, op)
    if which == "tilelang":
        check(features_of()["fp8"], lambda: f"{op}: the TileLang program needs FP8 tensor cores, which this "
                                            f"target lacks: {features_of()}")
    return which


def grouped_gemm_fp8(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     grouped_layout: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                     impl: str = "auto") -> torch.Tensor:
    """The contiguous layout: ``out[m] = (a[m] * a_scale[m]) @ (b[e] * b_scale[e])^T`` (bf16) for the expert ``e``
    of row ``m``'s 128-row tile (DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous``).

    - ``a [M, K]`` float8_e4m3fn, ``a_scale [M, K/128]`` float32 (:func:`quantize_groups`);
    - ``b [E, N, K]`` float8_e4m3fn, ``b_scale [E, N/128, K/128]`` float32; ``N``, ``K`` multiples of 128; or FP4
      (MXFP4) experts: ``b [E, N, K/2]`` uint8 (two E2M1 values a byte, the even one low) with ``b_scale [E, N,
      K/32]`` uint8 (UE8M0) or float32 (powers of two, as SGLang stores them; other values round to bf16 in the
      conversion), converted in the kernel;
    - ``grouped_layout [M]`` int32: each row's expert, ``-1`` for padding; each 128-row tile holds one expert's
      rows and padding, and its expert is its first row's id;
    - ``out [M, N]`` bfloat16 (allocated when None): rows with id ``-1`` are not written; a row whose id is not
      its tile's expert, or whose tile's expert is outside ``[0, E)``, is written as NaN.

    All tensors contiguous, on one device. Returns ``out``."""
    op = "grouped_gemm_fp8"
    E, N, K, fp4 = _weights(op, b, b_scale, fp4=True)
    check(isinstance(a, torch.Tensor) and a.dim() == 2, lambda: f"{op}: a must be a [M, {K}] tensor")
    M = a.shape[0]
    _tensor(op, "a", a, FP8, (M, K))
    _tensor(op, "a_scale", a_scale, torch.float32, (M, K // BLOCK))
    _tensor(op, "grouped_layout", grouped_layout, torch.int32, (M,))
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    _tensor(op, "out", out, torch.bfloat16, (M, N))
    check_same_device(op, a=a, a_scale=a_scale, b=b, b_scale=b_scale, grouped_layout=grouped_layout, out=out)
    if _run(op, impl, a.device) == "reference":
        return grouped_gemm_contiguous_reference(a, a_scale, b, b_scale, grouped_layout, out)
    from .tilelang_impl import grouped_gemm_contiguous_tilelang

    return grouped_gemm_contiguous_tilelang(a, a_scale, b, b_scale, grouped_layout, out, fp4=fp4)


def grouped_gemm_fp8_masked(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                            masked_m: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                            impl: str = "auto") -> torch.Tensor:
    """The masked layout: ``out[e, m] = (a[e, m] * a_scale[e, m]) @ (b[e] * b_scale[e])^T`` (bf16) for ``m <
    masked_m[e]`` (DeepGEMM's ``m_grouped_fp8_gemm_nt_masked``); fixed shapes and no host read of ``masked_m``, so
    a CUDA graph can hold it.

    - ``a [E, max_m, K]`` float8_e4m3fn, ``a_scale [E, max_m, K/128]`` float32;
    - ``b``, ``b_scale``: FP8 or FP4 experts, as for :func:`grouped_gemm_fp8`;
    - ``masked_m [E]`` int32, clamped to ``[0, max_m]``;
    - ``out [E, max_m, N]`` bfloat16 (allocated when None): rows at or past ``masked_m[e]`` are not written.

    All tensors contiguous, on one device. Returns ``out``."""
    op = "grouped_gemm_fp8_masked"
    E, N, K, fp4 = _weights(op, b, b_scale, fp4=True)
    check(isinstance(a, torch.Tensor) and a.dim() == 3, lambda: f"{op}: a must be a [{E}, max_m, {K}] tensor")
    MM = a.shape[1]
    _tensor(op, "a", a, FP8, (E, MM, K))
    _tensor(op, "a_scale", a_scale, torch.float32, (E, MM, K // BLOCK))
    _tensor(op, "masked_m", masked_m, torch.int32, (E,))
    if out is None:
        out = torch.empty(E, MM, N, dtype=torch.bfloat16, device=a.device)
    _tensor(op, "out", out, torch.bfloat16, (E, MM, N))
    check_same_device(op, a=a, a_scale=a_scale, b=b, b_scale=b_scale, masked_m=masked_m, out=out)
    if _run(op, impl, a.device) == "reference":
        return grouped_gemm_masked_reference(a, a_scale, b, b_scale, masked_m, out)
    from .tilelang_impl import grouped_gemm_masked_tilelang

    return grouped_gemm_masked_tilelang(a, a_scale, b, b_scale, masked_m, out, fp4=fp4)


def quantize_groups(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., K] float8_e4m3fn, scale [..., K/128] float32)`` of ``x [..., K]`` (bf16/fp16/fp32, ``K`` a
    multiple of 128): each row's 128-column groups scaled by ``amax / 448`` (``amax`` at least 1e-4; ``pow2``:
    rounded up to a power of two, the UE8M0 recipe), rounded to e4m3. Torch ops on any device."""
    op = "quantize_groups"
    check(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.is_floating_point() and x.dtype != FP8,
          lambda: f"{op}: x must be a bf16/fp16/fp32 tensor")
    check(x.shape[-1] % BLOCK == 0, lambda: f"{op}: x's last dimension must be a multiple of {BLOCK}, got "
                                            f"{x.shape[-1]}")
    q, s = quantize_groups_reference(x, pow2)
    return q.contiguous(), s.contiguous()


def _swiglu_limit(op, limit):
    check(limit is None or (isinstance(limit, (int, float)) and limit > 0),
          lambda: f"{op}: swiglu_limit must be a positive number or None, got {limit!r}")


def _swiglu_gemm_weights(op, w13, w13_scale, limit):
    """Checks GEMM1's FP8 weights (gate rows, then up rows) and the clamp; returns ``(E, I, K)``."""
    E, N, K, _ = _weights(op, w13, w13_scale, "w13")
    check(N % (2 * BLOCK) == 0, lambda: f"{op}: w13's rows (2 x intermediate) must be a multiple of {2 * BLOCK}, "
                                        f"got {N}")
    _swiglu_limit(op, limit)
    return E, N // 2, K


def _fp8_rows_out(op, out, lead: tuple, I: int, device):
    """GEMM2's input buffers ``(q [*lead, I] e4m3, s [*lead, I/128] float32)``: ``out`` checked, or allocated."""
    if out is None:
        out = layer._rows_fp8(lead, I, device)
    check(isinstance(out, (tuple, list)) and len(out) == 2, lambda: f"{op}: out must be a (q, s) pair")
    _tensor(op, "out[0]", out[0], FP8, (*lead, I))
    _tensor(op, "out[1]", out[1], torch.float32, (*lead, I // BLOCK))
    return tuple(out)


def swiglu_quant(h: torch.Tensor, rows: torch.Tensor, swiglu_limit: Optional[float] = None,
                 out: Optional[tuple] = None, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM2's FP8 input from GEMM1's output, in one pass: for each ``r`` of ``rows`` in ``[0, R)``, row ``r`` of
    ``q`` and ``s`` is :func:`quantize_groups` of ``silu(min(gate, L)) * clamp(up, -L, L)`` (float32; ``gate``,
    ``up`` the halves of ``h[r]``; no clamp when ``swiglu_limit`` is None). Other indices (a dropped choice's
    spare row) are skipped; rows no index names are not written.

    - ``h [R, 2I]`` bfloat16, ``I`` a multiple of 128; ``rows [n]`` int32 or int64;
    - ``out``: ``(q [R, I] float8_e4m3fn, s [R, I/128] float32)``, allocated when None.

    All tensors contiguous, on one device; no host read of ``rows``. Returns ``(q, s)``."""
    op = "swiglu_quant"
    check(isinstance(h, torch.Tensor) and h.dim() == 2 and h.shape[1] % (2 * BLOCK) == 0,
          lambda: f"{op}: h must be a [R, 2I] tensor with I a multiple of {BLOCK}, got "
                  f"{tuple(getattr(h, 'shape', ()))}")
    R, I = h.shape[0], h.shape[1] // 2
    _tensor(op, "h", h, torch.bfloat16, (R, 2 * I))
    check(isinstance(rows, torch.Tensor) and rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64),
          lambda: f"{op}: rows must be a 1-D int32 or int64 tensor")
    check(rows.is_contiguous(), lambda: f"{op}: rows must be contiguous")
    _swiglu_limit(op, swiglu_limit)
    out = _fp8_rows_out(op, out, (R,), I, h.device)
    check_same_device(op, h=h, rows=rows, q=out[0], s=out[1])
    check(R < 2 ** 31, lambda: f"{op}: at most 2^31 - 1 rows, got {R}")
    if _run(op, impl, h.device) == "reference":
        return swiglu_quant_reference(h, rows, swiglu_limit, out)
    from .tilelang_impl import swiglu_quant_tilelang

    return swiglu_quant_tilelang(h, rows, swiglu_limit, out)


def grouped_gemm_swiglu_fp8(a: torch.Tensor, a_scale: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                            grouped_layout: torch.Tensor, swiglu_limit: Optional[float] = None,
                            out: Optional[tuple] = None, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of the routed experts, contiguous layout, with V4's SwiGLU and GEMM2's 1 x 128 FP8 quantisation in
    its epilogue: per row ``m`` whose id is not ``-1``, ``(q[m], s[m]) = swiglu_quant(h[m])`` for ``h`` the
    :func:`grouped_gemm_fp8` result of ``w13``, which never goes to memory.

    - ``a [M, K]`` float8_e4m3fn, ``a_scale [M, K/128]`` float32; ``grouped_layout [M]`` int32: the rules of
      :func:`grouped_gemm_fp8` (rows whose id is another expert than their tile's get NaN codes and a NaN scale;
      ``-1`` rows are not written);
    - ``w13 [E, 2I, K]`` float8_e4m3fn (gate rows, then up rows) with ``w13_scale [E, 2I/128, K/128]`` float32;
    - ``out``: ``(q [M, I] float8_e4m3fn, s [M, I/128] float32)``, allocated when None.

    All tensors contiguous, on one device. Returns ``(q, s)``."""
    op = "grouped_gemm_swiglu_fp8"
    E, I, K = _swiglu_gemm_weights(op, w13, w13_scale, swiglu_limit)
    check(isinstance(a, torch.Tensor) and a.dim() == 2, lambda: f"{op}: a must be a [M, {K}] tensor")
    M = a.shape[0]
    _tensor(op, "a", a, FP8, (M, K))
    _tensor(op, "a_scale", a_scale, torch.float32, (M, K // BLOCK))
    _tensor(op, "grouped_layout", grouped_layout, torch.int32, (M,))
    out = _fp8_rows_out(op, out, (M,), I, a.device)
    check_same_device(op, a=a, a_scale=a_scale, w13=w13, w13_scale=w13_scale, grouped_layout=grouped_layout,
                      q=out[0], s=out[1])
    if _run(op, impl, a.device) == "reference":
        return grouped_gemm_swiglu_contiguous_reference(a, a_scale, w13, w13_scale, grouped_layout, swiglu_limit,
                                                        out)
    from .tilelang_impl import grouped_gemm_swiglu_contiguous_tilelang

    return grouped_gemm_swiglu_contiguous_tilelang(a, a_scale, w13, w13_scale, grouped_layout, swiglu_limit, out)


def grouped_gemm_swiglu_fp8_masked(a: torch.Tensor, a_scale: torch.Tensor, w13: torch.Tensor,
                                   w13_scale: torch.Tensor, masked_m: torch.Tensor,
                                   swiglu_limit: Optional[float] = None, out: Optional[tuple] = None, *,
                                   impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of the routed experts, masked layout, with V4's SwiGLU and GEMM2's 1 x 128 FP8 quantisation in its
    epilogue: for ``m < masked_m[e]``, ``(q[e, m], s[e, m]) = swiglu_quant(h[e, m])`` for ``h`` the
    :func:`grouped_gemm_fp8_masked` result of ``w13``, which never goes to memory.

    - ``a [E, max_m, K]`` float8_e4m3fn, ``a_scale [E, max_m, K/128]`` float32; ``masked_m [E]`` int32, clamped to
      ``[0, max_m]`` (rows past it are not written);
    - ``w13 [E, 2I, K]`` float8_e4m3fn (gate rows, then up rows) with ``w13_scale [E, 2I/128, K/128]`` float32;
    - ``out``: ``(q [E, max_m, I] float8_e4m3fn, s [E, max_m, I/128] float32)``, allocated when None.

    All tensors contiguous, on one device; fixed shapes, no host read of ``masked_m``. Returns ``(q, s)``."""
    op = "grouped_gemm_swiglu_fp8_masked"
    E, I, K = _swiglu_gemm_weights(op, w13, w13_scale, swiglu_limit)
    check(isinstance(a, torch.Tensor) and a.dim() == 3, lambda: f"{op}: a must be a [{E}, max_m, {K}] tensor")
    MM = a.shape[1]
    _tensor(op, "a", a, FP8, (E, MM, K))
    _tensor(op, "a_scale", a_scale, torch.float32, (E, MM, K // BLOCK))
    _tensor(op, "masked_m", masked_m, torch.int32, (E,))
    out = _fp8_rows_out(op, out, (E, MM), I, a.device)
    check_same_device(op, a=a, a_scale=a_scale, w13=w13, w13_scale=w13_scale, masked_m=masked_m, q=out[0],
                      s=out[1])
    if _run(op, impl, a.device) == "reference":
        return grouped_gemm_swiglu_masked_reference(a, a_scale, w13, w13_scale, masked_m, swiglu_limit, out)
    from .tilelang_impl import grouped_gemm_swiglu_masked_tilelang

    return grouped_gemm_swiglu_masked_tilelang(a, a_scale, w13, w13_scale, masked_m, swiglu_limit, out)


def route_masked(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 expert_map: Optional[torch.Tensor] = None, *, impl: str = "auto") -> tuple:
    """The masked layout's routing (:func:`.layer.route_masked_reference`): ``(slot [T, k], weights [T, k]
    float32, counts [E] int32)``, a token's repeated choices of one expert merged, choice ``(t, j)`` of local
    expert ``e`` at row ``e * T + r`` (``r``: its earlier choices of ``e`` in flat order), a choice with none at
    the spare row ``E * T``.

    - ``topk_ids [T, k]`` int32 or int64 (global ids through ``expert_map [global experts]`` int32, -1: not local,
      when given); ``topk_weights [T, k]`` float32 or bfloat16; ``num_experts`` the local experts.

    Contiguous tensors on one device; no host read. The TileLang path (one launch) returns int32 slots, the
    reference int64 ones of the same values."""
    op = "route_masked"
    check(isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2 and topk_ids.dtype in (torch.int32, torch.int64),
          lambda: f"{op}: topk_ids must be a 2-D int32 or int64 tensor [T, k]")
    T, k = topk_ids.shape
    check(isinstance(topk_weights, torch.Tensor) and tuple(topk_weights.shape) == (T, k)
          and topk_weights.dtype in (torch.float32, torch.bfloat16),
          lambda: f"{op}: topk_weights must be a float32 or bfloat16 [{T}, {k}] tensor")
    check(isinstance(num_experts, int) and 1 <= num_experts and num_experts * max(T, 1) < 2 ** 31,
          lambda: f"{op}: num_experts must be a positive int with num_experts * T < 2^31, got {num_experts!r}")
    check(expert_map is None or (isinstance(expert_map, torch.Tensor) and expert_map.dim() == 1
                                 and expert_map.dtype == torch.int32 and expert_map.is_contiguous()),
          lambda: f"{op}: expert_map must be a contiguous 1-D int32 tensor")
    check(topk_ids.is_contiguous() and topk_weights.is_contiguous(),
          lambda: f"{op}: topk_ids and topk_weights must be contiguous")
    check_same_device(op, topk_ids=topk_ids, topk_weights=topk_weights, expert_map=expert_map)
    if _run(op, impl, topk_ids.device) == "reference" or T == 0:
        return route_masked_reference(topk_ids, topk_weights, num_experts, expert_map)
    from .tilelang_impl import route_masked_tilelang

    return route_masked_tilelang(topk_ids, topk_weights, num_experts, expert_map)


def quantize_scatter(x: torch.Tensor, dest: torch.Tensor, rows: int, *,
                     impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMMs' A operand from the tokens: each row of ``x`` quantised once (:func:`quantize_groups`) and
    written to the rows its choices name, ``dest[t, j]``; a destination outside ``[0, rows)`` (a dropped choice) is
    skipped, and rows no destination names are left uninitialised.

    - ``x [T, H]`` bfloat16, ``H`` a multiple of 128; ``dest [T, k]`` int32 or int64; ``rows`` the layout's row
      count.

    Contiguous tensors on one device; no host read of ``dest``. Returns ``(a [rows, H] float8_e4m3fn,
    sa [rows, H/128] float32)``."""
    op = "quantize_scatter"
    check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % BLOCK == 0,
          lambda: f"{op}: x must be a [T, H] tensor with H a multiple of {BLOCK}, got {tuple(getattr(x, 'shape', ()))}")
    T, H = x.shape
    _tensor(op, "x", x, torch.bfloat16, (T, H))
    check(isinstance(dest, torch.Tensor) and dest.dim() == 2 and dest.shape[0] == T
          and dest.dtype in (torch.int32, torch.int64),
          lambda: f"{op}: dest must be a 2-D int32 or int64 [{T}, k] tensor")
    check(dest.is_contiguous(), lambda: f"{op}: dest must be contiguous")
    check(isinstance(rows, int) and 0 <= rows < 2 ** 31, lambda: f"{op}: rows must be an int in [0, 2^31), got {rows!r}")
    check_same_device(op, x=x, dest=dest)
    if _run(op, impl, x.device) == "reference":
        return quantize_scatter_reference(x, dest, rows)
    from .tilelang_impl import quantize_scatter_tilelang

    return quantize_scatter_tilelang(x, dest.to(torch.int32), rows)


def combine_experts(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, out: Optional[torch.Tensor] = None,
                    *, impl: str = "auto") -> torch.Tensor:
    """The weighted sum of each token's expert outputs: ``out[t] = bf16(sum_j weights[t, j] * y[rows[t, j]])``,
    float32 in choice order; a row outside ``[0, R)`` (a dropped choice) adds nothing, and rows no choice names
    are never read (the GEMMs leave them unwritten).

    - ``y [R, H]`` bfloat16, ``H`` a multiple of 128; ``rows [T, k]`` int32 or int64; ``weights [T, k]``
      floating; ``out [T, H]`` bfloat16, allocated when None.

    All tensors contiguous, on one device; no host read of ``rows``. Returns ``out``."""
    op = "combine_experts"
    check(isinstance(y, torch.Tensor) and y.dim() == 2 and y.shape[1] % BLOCK == 0,
          lambda: f"{op}: y must be a [R, H] tensor with H a multiple of {BLOCK}, got {tuple(getattr(y, 'shape', ()))}")
    R, H = y.shape
    _tensor(op, "y", y, torch.bfloat16, (R, H))
    check(isinstance(rows, torch.Tensor) and rows.dim() == 2 and rows.dtype in (torch.int32, torch.int64),
          lambda: f"{op}: rows must be a 2-D int32 or int64 [T, k] tensor")
    check(rows.is_contiguous(), lambda: f"{op}: rows must be contiguous")
    T, k = rows.shape
    check(isinstance(weights, torch.Tensor) and weights.is_floating_point() and tuple(weights.shape) == (T, k),
          lambda: f"{op}: weights must be a floating [{T}, {k}] tensor, got {tuple(getattr(weights, 'shape', ()))}")
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=y.device)
    _tensor(op, "out", out, torch.bfloat16, (T, H))
    check_same_device(op, y=y, rows=rows, weights=weights, out=out)
    check(R < 2 ** 31, lambda: f"{op}: at most 2^31 - 1 rows, got {R}")
    if _run(op, impl, y.device) == "reference":
        return combine_reference(y, rows, weights, out)
    from .tilelang_impl import combine_tilelang

    return combine_tilelang(y, rows.to(torch.int32), weights.float().contiguous(), out)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                  swiglu_limit: Optional[float] = None, expert_map: Optional[torch.Tensor] = None,
                  apply_router_weight_on_input: bool = False, out: Optional[torch.Tensor] = None,
                  layout: str = "auto", impl: str = "auto") -> torch.Tensor:
    """The routed experts of one MoE layer (the formula: :mod:`.layer`): ``[T, H]`` bf16, written into ``out``
    when given.

    - ``hidden [T, H]`` bfloat16; ``topk_weights [T, k]`` floating, ``topk_ids [T, k]`` integer (global expert
      ids, ``-1``: none; a token naming one expert twice gets the sum of both choices on either layout);
    - ``w13 [E, 2I, H]`` float8_e4m3fn (gate rows, then up rows) with ``w13_scale [E, 2I/128, H/128]`` float32;
      ``w2 [E, H, I]`` with ``w2_scale [E, H/128, I/128]``; ``E`` the experts on this rank. Or FP4 (MXFP4)
      experts: ``w13 [E, 2I, H/2]``, ``w2 [E, H, I/2]`` uint8 with UE8M0 scales ``[E, 2I, H/32]``, ``[E, H, I/32]``;
    - ``expert_map [num_global]`` integer (optional): global id to local expert, ``-1`` where not on this rank;
    - ``swiglu_limit``: V4's clamp (10), None for plain SwiGLU; ``apply_router_weight_on_input``: top-1 only;
    - ``layout``: ``masked`` (fixed shapes, what a CUDA graph needs; ``E x T`` rows), ``contiguous`` (rows grouped
      by expert), ``auto``: masked up to 64 tokens.

    No host synchronisation on either layout."""
    op = "fused_experts"
    E, N13, H, fp4 = _weights(op, w13, w13_scale, "w13", fp4=True)
    check(N13 % (2 * BLOCK) == 0, lambda: f"{op}: w13's rows (2 x intermediate) must be a multiple of {2 * BLOCK}, "
                                          f"got {N13}")
    I = N13 // 2
    w2_shape = (E, H, I // 2 if fp4 else I)
    check(isinstance(w2, torch.Tensor) and tuple(w2.shape) == w2_shape and w2.dtype == w13.dtype,
          lambda: f"{op}: w2 must be {w13.dtype} of shape {w2_shape} (experts, hidden, intermediate"
                  f"{' / 2: packed FP4' if fp4 else ''}), got {getattr(w2, 'dtype', None)} "
                  f"{tuple(getattr(w2, 'shape', ()))}")
    _weights(op, w2, w2_scale, "w2", fp4=fp4)
    check(isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and hidden.shape[1] == H,
          lambda: f"{op}: hidden must be a [T, {H}] tensor, got {tuple(getattr(hidden, 'shape', ()))}")
    T = hidden.shape[0]
    _tensor(op, "hidden", hidden, torch.bfloat16, (T, H))
    check(isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2 and topk_ids.shape[0] == T
          and not topk_ids.is_floating_point() and topk_ids.dtype != torch.bool,
          lambda: f"{op}: topk_ids must be an integer [{T}, k] tensor")
    k = topk_ids.shape[1]
    check(isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point()
          and tuple(topk_weights.shape) == (T, k),
          lambda: f"{op}: topk_weights must be a floating [{T}, {k}] tensor, got "
                  f"{tuple(getattr(topk_weights, 'shape', ()))}")
    check(expert_map is None or (isinstance(expert_map, torch.Tensor) and expert_map.dim() == 1
                                 and not expert_map.is_floating_point()),
          lambda: f"{op}: expert_map must be a 1-D integer tensor (global id -> local expert, -1: not here)")
    _swiglu_limit(op, swiglu_limit)
    check(not apply_router_weight_on_input or k == 1,
          lambda: f"{op}: apply_router_weight_on_input needs top-1 routing, got top-{k}")
    check(layout in LAYOUTS, lambda: f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=hidden.device)
    _tensor(op, "out", out, torch.bfloat16, (T, H))
    check_same_device(op, hidden=hidden, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale,
                      topk_weights=topk_weights, topk_ids=topk_ids, expert_map=expert_map, out=out)
    which = _run(op, impl, hidden.device)
    if T == 0:
        return out
    if apply_router_weight_on_input:
        hidden = (hidden.float() * topk_weights.float()).to(torch.bfloat16)
        topk_weights = torch.ones_like(topk_weights, dtype=torch.float32)
    masked = layout == "masked" or (layout == "auto" and T <= MASKED_MAX_TOKENS)
    path = layer.SWIGLU_PATH
    check(path in layer.SWIGLU_PATHS, lambda: f"{op}: layer.SWIGLU_PATH must be one of {layer.SWIGLU_PATHS}, got "
                                               f"{path!r}")
    if path == "fused" and fp4:
        path = "pass"  # no epilogue-fused GEMM1 reads FP4 weights
    ops = _LayerOps(which)
    if masked:
        gemm = lambda *args: grouped_gemm_fp8_masked(*args, impl=which)  # noqa: E731
        return layer.fused_experts_masked(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                          swiglu_limit, expert_map, gemm, out, path, ops)
    gemm = lambda *args: grouped_gemm_fp8(*args, impl=which)  # noqa: E731
    return layer.fused_experts_contiguous(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                          swiglu_limit, expert_map, gemm, out, path, ops)


class _LayerOps:
    """The between-GEMM ops :mod:`.layer` calls, bound to one implementation."""

    def __init__(self, impl: str):
        self.impl = impl

    def swiglu_quant(self, *args):
        return swiglu_quant(*args, impl=self.impl)

    def gemm_swiglu(self, *args):
        return grouped_gemm_swiglu_fp8(*args, impl=self.impl)

    def gemm_swiglu_masked(self, *args):
        return grouped_gemm_swiglu_fp8_masked(*args, impl=self.impl)

    def _glue(self):
        return self.impl if layer.GLUE_KERNELS else "reference"

    def route_masked(self, *args):
        return route_masked(*args, impl=self.impl if layer.ROUTE_KERNEL else "reference")

    def quantize_scatter(self, *args):
        return quantize_scatter(*args, impl=self._glue())

    def combine(self, *args):
        return combine_experts(*args, impl=self._glue())
