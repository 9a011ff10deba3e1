"""Float32 references of the MoE grouped GEMMs (ground truth in the tests, and the path on a CPU) and the
block-scaled formats they read.

Formats (DeepSeek-V4's experts, DeepGEMM's operands):

- FP8 weights: ``b [E, N, K]`` e4m3 with ``b_scale [E, N/128, K/128]`` float32: element ``(e, n, k)`` is
  ``b[e, n, k] * b_scale[e, n // 128, k // 128]``.
- FP4 weights (MXFP4): ``b [E, N, K/2]`` uint8, two E2M1 values a byte (element ``2j`` in the low nibble, ``2j + 1``
  in the high one; a nibble is sign, two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
  negatives) with ``b_scale [E, N, K/32]`` uint8 UE8M0 (a byte ``s`` is ``2^(s - 127)``; 255 is NaN).
- Activations: ``a [M, K]`` e4m3 with ``a_scale [M, K/128]`` float32, one scale a row per 128 columns
  (:func:`quantize_groups_reference`).

The grouped GEMM is ``D[m] = A[m] @ B_e^T`` (dequantised operands, float32 accumulation, bf16 out) for the expert
``e`` of row ``m``, in two layouts:

- contiguous: ``a [M, K]`` with ``grouped_layout [M]`` int32, each row's expert, ``-1`` for padding rows. Rows
  come in tiles of :data:`ALIGN` (128) rows; a tile holds the rows of one expert and padding (what
  :func:`align_routing` produces). A tile's expert is the id of its first row. Rows whose id is ``-1`` are not
  written. A row whose id differs from its tile's expert, or any row of a tile whose expert is not in ``[0, E)``,
  is written as NaN: a malformed layout is visible in the output, never silently wrong.
- masked: ``a [E, max_m, K]`` with ``masked_m [E]`` int32: expert ``e``'s rows are ``a[e, :masked_m[e]]``
  (clamped to ``[0, max_m]``); rows past it are not written.
"""

from __future__ import annotations

from typing import Optional

import torch

ALIGN = 128  # rows a tile of the contiguous layout; also the block of the weight and activation scales
BLOCK = 128
FP4_GROUP = 32
FP8_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(device=None) -> torch.Tensor:
    """The 16 E2M1 values by nibble (float32)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def ue8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes as float32 powers of two (``2^(s - 127)``; 255 is NaN)."""
    v = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 127)
    return torch.where(s.to(torch.int32) == 255, torch.full_like(v, float("nan")), v)


def dequantize_fp8_blocks(b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` float32 from e4m3 ``b`` and its 128 x 128 block scales ``[..., N/128, K/128]``."""
    s = b_scale.float().repeat_interleave(BLOCK, -1).repeat_interleave(BLOCK, -2)
    return b.float() * s[..., :b.shape[-2], :b.shape[-1]]


def dequantize_fp4(b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` float32 from packed E2M1 ``b [..., N, K/2]`` and ``b_scale [..., N, K/32]``: UE8M0 bytes
    (uint8), or float32 values (SGLang's storage of the same powers of two)."""
    table = e2m1_table(b.device)
    lo, hi = table[(b & 0x0F).long()], table[(b >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)
    scale = b_scale if b_scale.dtype == torch.float32 else ue8m0_to_float(b_scale)
    return vals * scale.repeat_interleave(FP4_GROUP, -1)


def dequantize_groups(a: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` float32 from e4m3 ``a`` and its per-row 1 x 128 scales ``[..., K/128]``."""
    return a.float() * a_scale.float().repeat_interleave(BLOCK, -1)[..., :a.shape[-1]]


def quantize_groups_reference(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3 [..., K], scale float32 [..., K/128])``: each row's 128-column groups scaled by ``amax / 448``
    (``amax`` at least 1e-4; with ``pow2``, the scale rounded up to a power of two) and rounded to e4m3."""
    K = x.shape[-1]
    g = x.float().unflatten(-1, (K // BLOCK, BLOCK))
    amax = g.abs().amax(-1).clamp(min=1e-4)
    # an IEEE division on every device, as the programs': on CUDA, torch divides by a Python scalar as a
    # multiplication by its reciprocal (one float32 unit off at times), by a tensor it divides
    scale = amax / torch.full_like(amax, FP8_MAX)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return q, scale


def quantize_weight_blocks_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., N, K], scale float32 [..., N/128, K/128])``: 128 x 128 blocks scaled by ``amax / 448``."""
    *lead, N, K = w.shape
    g = w.float().reshape(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    amax = g.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    q = (g / (amax / FP8_MAX)).to(torch.float8_e4m3fn).reshape(*lead, N, K)
    return q, (amax / FP8_MAX).squeeze(-1).squeeze(-2)


def quantize_fp4_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [..., N, K/2], UE8M0 uint8 [..., N, K/32])``: each 32-value group scaled by the power of two
    that brings its amax to at most 6, then rounded to the nearest E2M1 value."""
    *lead, N, K = w.shape
    g = w.float().unflatten(-1, (K // FP4_GROUP, FP4_GROUP))
    amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)
    # the nearest magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6) by the midpoints between them; a tie takes the smaller
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device)
    code = torch.bucketize(x.abs(), mids).to(torch.uint8)
    code = code + 8 * ((x < 0) & (code > 0)).to(torch.uint8)
    code = code.flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (exp.squeeze(-1) + 127).to(torch.uint8)


def dequantize_weights(b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` float32 of FP8 block-scaled (e4m3) or FP4 (packed uint8) weights."""
    return dequantize_fp4(b, b_scale) if b.dtype == torch.uint8 else dequantize_fp8_blocks(b, b_scale)


def grouped_gemm_contiguous_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                      grouped_layout: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The contiguous layout (module docstring): ``out [M, N]`` bf16 (allocated, zeros, when None)."""
    M, E = a.shape[0], b.shape[0]
    w = dequantize_weights(b, b_scale)
    N = w.shape[1]
    out = torch.zeros(M, N, dtype=torch.bfloat16, device=a.device) if out is None else out
    ids = grouped_layout.long()
    tile = ids[torch.arange(M, device=a.device) // ALIGN * ALIGN]
    ok = (tile >= 0) & (tile < E)
    run = ok & (ids == tile)
    bad = (ids >= 0) & ~run
    x = dequantize_groups(a, a_scale)
    for e in torch.unique(tile[run]).tolist():
        rows = torch.where(run & (tile == e))[0]
        out[rows] = (x[rows] @ w[e].T).to(out.dtype)
    out[bad] = float("nan")
    return out


def grouped_gemm_masked_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                  masked_m: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The masked layout (module docstring): ``out [E, max_m, N]`` bf16 (allocated, zeros, when None)."""
    E, max_m = a.shape[0], a.shape[1]
    w = dequantize_weights(b, b_scale)
    out = torch.zeros(E, max_m, w.shape[1], dtype=torch.bfloat16, device=a.device) if out is None else out
    x = dequantize_groups(a, a_scale)
    for e, m in enumerate(masked_m.clamp(0, max_m).tolist()):
        if m:
            out[e, :m] = (x[e, :m] @ w[e].T).to(out.dtype)
    return out


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int,
                     expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 local expert of each choice (``topk_ids``' shape), ``num_experts`` for a choice with none: a negative
    id, an id past ``expert_map`` or mapped to ``-1`` by it, or a local id outside ``[0, num_experts)``."""
    ids = topk_ids.long()
    if expert_map is not None:
        inside = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, max(expert_map.numel() - 1, 0))], -1)
    return torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)


def align_routing(topk_ids: torch.Tensor, num_experts: int,
                  expert_map: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous layout of a routing, on the routing's device with no host synchronisation: ``(row_src,
    grouped_layout)``, both int32 ``[M]`` with ``M = T * k + E * (ALIGN - 1)`` rounded up to ``ALIGN`` (the most
    any routing of ``T x k`` choices needs, so the shape depends on the batch size only).

    ``topk_ids [T, k]`` are global expert ids; ``expert_map [num_global]`` (int, optional) maps them to local
    experts (``-1``: not on this rank); without it ids are local already. Choices outside ``[0, E)`` after the
    map (``E = num_experts``, local) take no row. Expert ``e``'s rows form one segment starting at a multiple of
    ``ALIGN``, in order of the flat choice index ``t * k + j``; ``row_src[m]`` is that index (``-1`` for padding)
    and ``grouped_layout[m]`` the expert (``-1`` for padding)."""
    T, k = topk_ids.shape
    dev = topk_ids.device
    ids = local_expert_ids(topk_ids, num_experts, expert_map).reshape(-1)  # num_experts: no row
    # a scatter, not torch.bincount: bincount reads the largest id on the host (a synchronisation, and no CUDA
    # graph capture)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, ids, torch.ones_like(ids))[:num_experts]
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in the sorted order
    keep = sorted_ids < num_experts
    e = sorted_ids.clamp(max=num_experts - 1)
    rank = torch.arange(ids.numel(), device=dev) - first[e]
    M = -(-(T * k + num_experts * (ALIGN - 1)) // ALIGN) * ALIGN
    dest = torch.where(keep, starts[e] + rank, M)  # M: a spare slot, dropped below
    row_src = torch.full((M + 1,), -1, dtype=torch.int32, device=dev)
    layout = torch.full((M + 1,), -1, dtype=torch.int32, device=dev)
    # dropped choices land on the spare slot M, reset by fill_: ``row_src[M] = -1`` copies a host scalar, a
    # synchronisation that fails CUDA graph capture (the GPU test in sync-debug mode caught it)
    row_src.scatter_(0, dest, order.to(torch.int32))
    layout.scatter_(0, dest, sorted_ids.to(torch.int32))
    row_src[M:].fill_(-1)
    layout[M:].fill_(-1)
    return row_src[:M], layout[:M]
