"""DeepSeek-V4's small model-side ops around attention and the shared expert, the ones the engines run as
CUDA-only kernels: the q head norm + RoPE, the (inverse) RoPE of the attention output, the bf16 K path's norm +
RoPE, and the clamped SwiGLU. The math (and where it rounds to bf16) is that of DeepSeek-V4's reference
``inference/model.py`` as SGLang's kernels compute it; these are vectorised torch ops on any device (a TileLang
program per op is the next step), checked before they run.

RoPE is GPT-J style on the last 64 dims: the pairs ``(x[2j], x[2j + 1])`` rotate by ``cos[pos, j]``, ``sin[pos, j]``
(``[max_pos, 32]`` float tables); the inverse rotates by the conjugate.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._common import check, check_same_device

ROPE = 64


def _check_rope(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    check(isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] >= ROPE and x.is_floating_point(),
          lambda: f"{op}: the input must be a floating [T, ..., >= {ROPE}] tensor, got "
                  f"{tuple(getattr(x, 'shape', ()))}")
    for name, t in (("cos", cos), ("sin", sin)):
        check(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == ROPE // 2 and t.is_floating_point(),
              lambda: f"{op}: {name} must be a floating [max_pos, {ROPE // 2}] tensor")
    check(isinstance(positions, torch.Tensor) and not positions.is_floating_point() and positions.dim() == 1
          and positions.numel() == x.shape[0], lambda: f"{op}: positions must be an integer [{x.shape[0]}] tensor")
    check_same_device(op, x=x, cos=cos, sin=sin, positions=positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            inverse: bool) -> torch.Tensor:
    """``x [T, ..., 64]`` (float32) rotated at each token's position; float32 out."""
    at = positions.long().clamp(0, cos.shape[0] - 1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (ROPE // 2,)
    c, s = cos[at].float().view(shape), sin[at].float().view(shape)
    if inverse:
        s = -s
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


def q_norm_rope(q: torch.Tensor, eps: Optional[float], cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each query head of ``q [T, H, D]`` RMS-normalised (no weight; ``eps`` None: no norm) and rounded to bf16,
    then its last 64 dims rotated at ``positions [T]`` and rounded again. Written into ``out`` (same shape,
    bf16 or FP8 e4m3, any strides) when given, else returned as a new bf16 tensor."""
    op = "q_norm_rope"
    _check_rope(op, q, cos, sin, positions)
    check(q.dim() == 3, lambda: f"{op}: q must be [T, heads, head_dim], got {tuple(q.shape)}")
    check(out is None or (isinstance(out, torch.Tensor) and out.shape == q.shape),
          lambda: f"{op}: out must be a {tuple(q.shape)} tensor")
    x = q.float()
    y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) if eps is not None else x).to(torch.bfloat16)
    y = torch.cat([y[..., :-ROPE], _rotate(y[..., -ROPE:].float(), cos, sin, positions, False).to(torch.bfloat16)],
                  dim=-1)
    if out is None:
        return y
    out.copy_(y)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          inverse: bool = False) -> torch.Tensor:
    """Rotate ``x [T, ..., 64]`` in place (any strides: the output's last 64 dims as a view), in float32 and
    rounded back to ``x``'s dtype; ``inverse``: by the conjugate (undoing the rotation of the keys in the
    attention output)."""
    op = "rope_"
    _check_rope(op, x, cos, sin, positions)
    check(x.shape[-1] == ROPE, lambda: f"{op}: x must have {ROPE} rotated dims last, got {x.shape[-1]}")
    x.copy_(_rotate(x.float(), cos, sin, positions, inverse).to(x.dtype))
    return x


def norm_rope_(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """``kv [T, D]`` in place: RMSNorm with ``weight`` in float32, rounded to bf16, then the last 64 dims rotated
    from the rounded values and rounded again (the bf16 K path)."""
    op = "norm_rope_"
    _check_rope(op, kv, cos, sin, positions)
    check(kv.dim() == 2 and isinstance(weight, torch.Tensor) and weight.numel() == kv.shape[1],
          lambda: f"{op}: kv must be [T, D] and weight [D]")
    x = kv.float()
    y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()).to(torch.bfloat16)
    y = torch.cat([y[:, :-ROPE], _rotate(y[:, -ROPE:].float(), cos, sin, positions, False).to(torch.bfloat16)], 1)
    kv.copy_(y)
    return kv


def silu_and_mul_clamp(x: torch.Tensor, limit: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """V4's clamped SwiGLU: ``g, u = x[:, :I], x[:, I:]``; ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``
    in ``x``'s dtype; ``out = silu(g) * u`` in float32, rounded to ``x``'s dtype (into ``out [M, I]`` if given)."""
    op = "silu_and_mul_clamp"
    check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % 2 == 0 and x.is_floating_point(),
          lambda: f"{op}: x must be a floating [M, 2 * I] tensor, got {tuple(getattr(x, 'shape', ()))}")
    check(isinstance(limit, (int, float)) and limit > 0, lambda: f"{op}: limit must be positive, got {limit!r}")
    half = x.shape[1] // 2
    check(out is None or (isinstance(out, torch.Tensor) and tuple(out.shape) == (x.shape[0], half)),
          lambda: f"{op}: out must be [{x.shape[0]}, {half}]")
    g = x[:, :half].clamp(max=limit).float()
    u = x[:, half:].clamp(-limit, limit).float()
    y = (g * torch.sigmoid(g) * u).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
