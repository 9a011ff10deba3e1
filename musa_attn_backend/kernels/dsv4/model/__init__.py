"""DeepSeek-V4's small model-side ops around attention and the shared expert, the ones the engines run as
CUDA-only kernels: the q head norm + RoPE, the (inverse) RoPE of the attention output, the bf16 K path's norm +
RoPE, the clamped SwiGLU, and the hyper-connections (mHC: the mixes, Sinkhorn, the combine before a sublayer,
the update after it, the head). The math (and where it rounds to bf16) is that of DeepSeek-V4's reference
``inference/model.py`` as SGLang's kernels compute it. Every op is checked before it runs. The RoPE ops and the
clamped SwiGLU run TileLang programs on a GPU (:mod:`.kernel`; ``impl``: ``"auto"``, ``"tilelang"`` or
``"reference"``, the vectorised torch form, which also runs on a CPU); mHC and the experts are torch ops on any
device.

RoPE is GPT-J style on the last 64 dims: the pairs ``(x[2j], x[2j + 1])`` rotate by ``cos[pos, j]``, ``sin[pos, j]``
(``[max_pos, 32]`` float tables); the inverse rotates by the conjugate.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._common import check, check_same_device, resolve_impl
from ....platform import stream_capturing
from ..compressor.reference import rope_gptj

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
    return rope_gptj(x, c, -s if inverse else s)


def _kernel_dims(op: str, d: int) -> None:
    check(ROPE <= d <= 1024 and d & (d - 1) == 0,
          lambda: f"{op}: the TileLang program takes rows of a power-of-two size from {ROPE} to 1024, got {d}")


def q_norm_rope(q: torch.Tensor, eps: Optional[float], cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, out: Optional[torch.Tensor] = None, *, impl: str = "auto") -> torch.Tensor:
    """Each query head of ``q [T, H, D]`` RMS-normalised (no weight; ``eps`` None: no norm) and rounded to bf16,
    then its last 64 dims rotated at ``positions [T]`` and rounded again. Written into ``out`` (same shape,
    bf16 or FP8 e4m3, any strides) when given, else returned as a new bf16 tensor."""
    op = "q_norm_rope"
    _check_rope(op, q, cos, sin, positions)
    check(q.dim() == 3, lambda: f"{op}: q must be [T, heads, head_dim], got {tuple(q.shape)}")
    check(out is None or (isinstance(out, torch.Tensor) and out.shape == q.shape),
          lambda: f"{op}: out must be a {tuple(q.shape)} tensor")
    if resolve_impl(impl, q.device, op) == "tilelang":
        from .tilelang_impl import norm_rope_rows

        _kernel_dims(op, q.shape[-1])
        y = norm_rope_rows(q, None, eps, cos, sin, positions, norm="none" if eps is None else "plain",
                           round_mid=True, inverse=False, out_dtype=torch.bfloat16)
        if out is None:
            return y
        out.copy_(y)
        return out
    x = q.float()
    y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) if eps is not None else x).to(torch.bfloat16)
    y = torch.cat([y[..., :-ROPE], _rotate(y[..., -ROPE:].float(), cos, sin, positions, False).to(torch.bfloat16)],
                  dim=-1)
    if out is None:
        return y
    out.copy_(y)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          inverse: bool = False, *, impl: str = "auto") -> torch.Tensor:
    """Rotate ``x [T, ..., 64]`` in place (any strides: the output's last 64 dims as a view), in float32 and
    rounded back to ``x``'s dtype; ``inverse``: by the conjugate (undoing the rotation of the keys in the
    attention output)."""
    op = "rope_"
    _check_rope(op, x, cos, sin, positions)
    check(x.shape[-1] == ROPE, lambda: f"{op}: x must have {ROPE} rotated dims last, got {x.shape[-1]}")
    if resolve_impl(impl, x.device, op) == "tilelang":
        from .tilelang_impl import norm_rope_rows

        heads = math.prod(x.shape[1:-1])  # T may be 0: no -1 in the shape
        y = norm_rope_rows(x.reshape(x.shape[0], heads, ROPE), None, None, cos, sin, positions, norm="none",
                           round_mid=False, inverse=inverse, out_dtype=x.dtype)
        x.copy_(y.view(x.shape))
        return x
    x.copy_(_rotate(x.float(), cos, sin, positions, inverse).to(x.dtype))
    return x


def norm_rope_(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``kv [T, D]`` in place: RMSNorm with ``weight`` in float32, rounded to bf16, then the last 64 dims rotated
    from the rounded values and rounded again (the bf16 K path)."""
    op = "norm_rope_"
    _check_rope(op, kv, cos, sin, positions)
    check(kv.dim() == 2 and isinstance(weight, torch.Tensor) and weight.numel() == kv.shape[1],
          lambda: f"{op}: kv must be [T, D] and weight [D]")
    if resolve_impl(impl, kv.device, op) == "tilelang":
        from .tilelang_impl import norm_rope_rows

        _kernel_dims(op, kv.shape[1])
        y = norm_rope_rows(kv.unsqueeze(1), weight, eps, cos, sin, positions, norm="weight", round_mid=True,
                           inverse=False, out_dtype=torch.bfloat16)
        kv.copy_(y.squeeze(1))
        return kv
    x = kv.float()
    y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()).to(torch.bfloat16)
    y = torch.cat([y[:, :-ROPE], _rotate(y[:, -ROPE:].float(), cos, sin, positions, False).to(torch.bfloat16)], 1)
    kv.copy_(y)
    return kv


def silu_and_mul_clamp(x: torch.Tensor, limit: float, out: Optional[torch.Tensor] = None, *,
                       impl: str = "auto") -> torch.Tensor:
    """V4's clamped SwiGLU: ``g, u = x[:, :I], x[:, I:]``; ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``
    in ``x``'s dtype; ``out = silu(g) * u`` in float32, rounded to ``x``'s dtype (into ``out [M, I]`` if given)."""
    op = "silu_and_mul_clamp"
    check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % 2 == 0 and x.is_floating_point(),
          lambda: f"{op}: x must be a floating [M, 2 * I] tensor, got {tuple(getattr(x, 'shape', ()))}")
    check(isinstance(limit, (int, float)) and limit > 0, lambda: f"{op}: limit must be positive, got {limit!r}")
    half = x.shape[1] // 2
    check(out is None or (isinstance(out, torch.Tensor) and tuple(out.shape) == (x.shape[0], half)),
          lambda: f"{op}: out must be [{x.shape[0]}, {half}]")
    if resolve_impl(impl, x.device, op) == "tilelang":
        from .tilelang_impl import silu_mul_clamp

        check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
              lambda: f"{op}: the TileLang program takes bf16, fp16 or fp32, got {x.dtype}")
        y = silu_mul_clamp(x, float(limit))
        if out is None:
            return y
        out.copy_(y)
        return out
    g = x[:, :half].clamp(max=limit).float()
    u = x[:, half:].clamp(-limit, limit).float()
    y = (g * torch.sigmoid(g) * u).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


# ---- mHC: DeepSeek-V4's hyper-connections (``n`` residual streams mixed around each sublayer) ----------------


def hc_mixes(residual: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``F.linear(x, fn) * rsqrt(mean(x^2) + rms_eps)`` of the flattened streams ``x = residual [T, n, H]`` in
    float32: ``[T, rows of fn]``."""
    x = residual.flatten(1).float()
    return torch.nn.functional.linear(x, fn.float()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                      eps: float, post_mult: float = 2.0, pre_eps: Optional[float] = None):
    """``mixes [..., n * (n + 2)]`` into ``pre [..., n] = sigmoid(m * s0 + b) + pre_eps`` (default ``eps``),
    ``post [..., n] = post_mult * sigmoid(m * s1 + b)`` and ``comb [..., n, n]``: a row softmax of
    ``m * s2 + b`` (plus ``eps``), then ``iters`` column / row normalisations (Sinkhorn; each divides by the sum
    plus ``eps``), column first."""
    m = mixes.float()
    s, b = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :n] * s[0] + b[:n]) + (eps if pre_eps is None else pre_eps)
    post = post_mult * torch.sigmoid(m[..., n:2 * n] * s[1] + b[n:2 * n])
    comb = (m[..., 2 * n:] * s[2] + b[2 * n:]).unflatten(-1, (n, n))
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_combine(residual: torch.Tensor, pre: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """``y[t, h] = sum_k pre[t, k] * residual[t, k, h]`` in float32, rounded to ``out_dtype``."""
    return (pre.float().unsqueeze(-1) * residual.float()).sum(-2).to(out_dtype)


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            pre_eps: float, sinkhorn_eps: float, post_mult: float, sinkhorn_iters: int,
            norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None, *, impl: str = "auto"):
    """Before a sublayer: ``(post [T, n, 1], comb [T, n, n], layer_input [T, H])`` from the streams ``residual
    [T, n, H]`` (bf16). ``layer_input`` is the ``pre``-weighted sum in bf16, RMS-normalised with ``norm_weight``
    when given (its mean square taken on the float32 sum, applied to the bf16 one, as SGLang's fused kernel
    does). On a GPU the mixes are torch's GEMM and the rest one TileLang program."""
    op = "mhc_pre"
    check(isinstance(residual, torch.Tensor) and residual.dim() == 3,
          lambda: f"{op}: residual must be [T, n, H], got {tuple(getattr(residual, 'shape', ()))}")
    n = residual.shape[1]
    check(fn.dim() == 2 and fn.shape == (n * (n + 2), n * residual.shape[2]),
          lambda: f"{op}: fn must be [{n * (n + 2)}, {n * residual.shape[2]}], got {tuple(fn.shape)}")
    if resolve_impl(impl, residual.device, op) == "tilelang":
        from .tilelang_impl import mhc_pre_rows

        check(residual.dtype == torch.bfloat16, lambda: f"{op}: the TileLang program takes bf16 streams, got "
                                                        f"{residual.dtype}")
        post, comb, y = mhc_pre_rows(hc_mixes(residual, fn, rms_eps), scale, base, residual, iters=sinkhorn_iters,
                                     head=False, pre_eps=pre_eps, sk_eps=sinkhorn_eps, post_mult=post_mult,
                                     norm_weight=norm_weight, norm_eps=norm_eps)
        return post.unsqueeze(-1), comb, y
    pre, post, comb = hc_split_sinkhorn(hc_mixes(residual, fn, rms_eps), scale, base, n, sinkhorn_iters,
                                        sinkhorn_eps, post_mult, pre_eps)
    y32 = hc_combine(residual, pre, torch.float32)
    y = y32.to(torch.bfloat16)
    if norm_weight is not None:
        inv = torch.rsqrt(y32.square().mean(-1, keepdim=True) + norm_eps)
        y = (y.float() * inv * norm_weight.float()).to(torch.bfloat16)
    return post.unsqueeze(-1), comb, y


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
             impl: str = "auto") -> torch.Tensor:
    """After a sublayer: the streams ``R'[i] = post[i] * x + sum_j comb[j, i] * R[j]`` (float32, rounded once to
    ``x``'s dtype) from its output ``x [T, H]``, the streams ``residual [T, n, H]``, ``post [T, n]`` (or
    ``[T, n, 1]``) and ``comb [T, n, n]``."""
    op = "mhc_post"
    check(isinstance(residual, torch.Tensor) and residual.dim() == 3 and isinstance(x, torch.Tensor)
          and x.shape == (residual.shape[0], residual.shape[2]) and post.numel() == residual.shape[0] * residual.shape[1]
          and comb.shape == (residual.shape[0], residual.shape[1], residual.shape[1]),
          lambda: f"{op}: x must be [T, H], residual [T, n, H], post [T, n] and comb [T, n, n]")
    if resolve_impl(impl, residual.device, op) == "tilelang":
        from .tilelang_impl import mhc_post_rows

        check(x.dtype == residual.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32),
              lambda: f"{op}: x and residual must share a bf16, fp16 or fp32 dtype")
        return mhc_post_rows(x, residual, post, comb)
    p = post.reshape(residual.shape[0], residual.shape[1]).float()  # T may be 0: no -1 in the shape
    return (p.unsqueeze(-1) * x.float().unsqueeze(1)
            + (comb.float().unsqueeze(-1) * residual.float().unsqueeze(2)).sum(1)).to(x.dtype)


def hc_head(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float, *, impl: str = "auto") -> torch.Tensor:
    """Before the final norm: the streams ``[T, n, H]`` summed with ``sigmoid(mixes * scale + base) + hc_eps``
    (float32), in ``residual``'s dtype."""
    if resolve_impl(impl, residual.device, "hc_head") == "tilelang" and residual.dtype == torch.bfloat16:
        from .tilelang_impl import mhc_pre_rows

        return mhc_pre_rows(hc_mixes(residual, fn, norm_eps), scale, base, residual, iters=1, head=True,
                            pre_eps=hc_eps, sk_eps=0.0, post_mult=0.0)[2]
    pre = torch.sigmoid(hc_mixes(residual, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return hc_combine(residual, pre, residual.dtype)


def moe_swiglu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's routed experts with unquantised weights: for each token and each of its ``K`` experts ``e``
    (``topk_ids [T, K]``; an id outside ``[0, E)`` contributes nothing), ``h = silu_and_mul_clamp(x @ w13[e]^T,
    limit)`` and ``h @ w2[e]^T``, in ``x``'s dtype, then summed with ``topk_weights [T, K]`` in float32.
    ``w13 [E, 2I, H]`` (gate rows first), ``w2 [E, H, I]``. The tokens are grouped by expert on the host (one
    synchronisation a call): the path for a CPU and for devices without a grouped GEMM. While a graph is being
    captured nothing may synchronise, so every expert runs on every choice and keeps its own (``E`` times the
    work: a capturable stand-in for unquantised checkpoints, which V4 does not ship)."""
    op = "moe_swiglu_experts"
    check(isinstance(x, torch.Tensor) and x.dim() == 2, lambda: f"{op}: x must be [T, H]")
    T, H = x.shape
    check(w13.dim() == 3 and w13.shape[2] == H and w13.shape[1] % 2 == 0 and w2.dim() == 3
          and w2.shape[0] == w13.shape[0] and w2.shape[1] == H and w2.shape[2] * 2 == w13.shape[1],
          lambda: f"{op}: w13 must be [E, 2I, {H}] and w2 [E, {H}, I], got {tuple(w13.shape)}, {tuple(w2.shape)}")
    check(topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == T,
          lambda: f"{op}: topk_ids and topk_weights must be [{T}, K]")
    E, K = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    if stream_capturing(x.device):
        xk = x.repeat_interleave(K, dim=0)  # choice j of token t is row t * K + j
        out = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
        for e in range(E):
            y = (silu_and_mul_clamp(xk @ w13[e].t(), limit) @ w2[e].t()).float()
            out += torch.where((flat == e).unsqueeze(1), y, 0.0)
        return (out.view(T, K, H) * topk_weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
    valid = (flat >= 0) & (flat < E)
    order = torch.where(valid, flat, torch.full_like(flat, E)).argsort(stable=True)
    counts = torch.bincount(flat[valid], minlength=E).tolist()
    out = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            rows = order[start:start + c]
            h = silu_and_mul_clamp(x[rows // K] @ w13[e].t(), limit)
            out[rows] = (h @ w2[e].t()).float()
            start += c
    return (out.view(T, K, H) * topk_weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
