"""Launch glue of the model-side TileLang programs (:mod:`.kernel`): arguments are checked by the public ops
in :mod:`.model`; this copies strided inputs to contiguous ones, launches, and writes the result where the op
promises it."""

from __future__ import annotations

import torch

from ...._tilelang import compile_cached, tl, tl_dtype
from .kernel import build_mhc_post, build_mhc_pre, build_norm_rope, build_silu_mul_clamp


def pass_configs() -> dict:
    """The norm + RoPE program places its barriers itself (none under a branch the block does not share)."""
    return {tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def norm_rope_kernel(D: int, H: int, in_dtype: str, out_dtype: str, norm: str, round_mid: bool, inverse: bool,
                     target=None):
    return compile_cached(("dsv4_norm_rope", D, H, in_dtype, out_dtype, norm, round_mid, inverse),
                          lambda: build_norm_rope(D, H, in_dtype, out_dtype, norm, round_mid, inverse),
                          target=target, pass_configs=pass_configs())


def silu_mul_clamp_kernel(I: int, dtype: str, target=None):
    return compile_cached(("dsv4_silu_mul_clamp", I, dtype), lambda: build_silu_mul_clamp(I, dtype), target=target)


def mhc_pre_kernel(n: int, H: int, iters: int, head: bool, has_norm: bool, dtype: str, target=None):
    return compile_cached(("dsv4_mhc_pre", n, H, iters, head, has_norm, dtype),
                          lambda: build_mhc_pre(n, H, iters, head, has_norm, dtype), target=target,
                          pass_configs=pass_configs())


def mhc_post_kernel(n: int, H: int, dtype: str, target=None):
    return compile_cached(("dsv4_mhc_post", n, H, dtype), lambda: build_mhc_post(n, H, dtype), target=target)


def norm_rope_rows(x: torch.Tensor, weight, eps, cos, sin, positions, *, norm: str, round_mid: bool,
                   inverse: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [T, H, D]`` (any strides) through the norm + RoPE program; a new contiguous ``[T, H, D]`` tensor."""
    T_, H, D = x.shape
    xin = x.contiguous()
    out = torch.empty(T_, H, D, dtype=out_dtype, device=x.device)
    if T_ == 0:
        return out
    w = (weight.reshape(-1).float().contiguous() if weight is not None
         else torch.ones(D, dtype=torch.float32, device=x.device))
    kernel = norm_rope_kernel(D, H, tl_dtype(x.dtype), tl_dtype(out_dtype), norm, round_mid, inverse)
    kernel(xin, w, positions.to(torch.int64).contiguous(), cos.float().contiguous(), sin.float().contiguous(),
           float(eps if eps is not None else 0.0), out)
    return out


def silu_mul_clamp(x: torch.Tensor, limit: float) -> torch.Tensor:
    """``x [M, 2I]`` (any strides) through the clamped SwiGLU program; a new ``[M, I]`` tensor of ``x``'s dtype."""
    M, two_i = x.shape
    out = torch.empty(M, two_i // 2, dtype=x.dtype, device=x.device)
    if M == 0 or two_i == 0:
        return out
    kernel = silu_mul_clamp_kernel(two_i // 2, tl_dtype(x.dtype))
    kernel(x.contiguous(), float(limit), out)
    return out


def mhc_pre_rows(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, residual: torch.Tensor, *, iters: int,
                 head: bool, pre_eps: float, sk_eps: float, post_mult: float, norm_weight=None, norm_eps=None):
    """The mHC program after the GEMM: ``(post [T, n], comb [T, n, n], y [T, H])`` (``head``: ``y`` only, the
    others empty)."""
    T_, n, H = residual.shape
    dev = residual.device
    post = torch.empty(T_, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T_, n, n, dtype=torch.float32, device=dev)
    y = torch.empty(T_, H, dtype=residual.dtype, device=dev)
    if T_ == 0:
        return post, comb, y
    has_norm = norm_weight is not None
    kernel = mhc_pre_kernel(n, H, iters, head, has_norm, tl_dtype(residual.dtype))
    s = scale.reshape(-1).float()
    s3 = torch.cat([s, s.new_zeros(3 - s.numel())]) if s.numel() < 3 else s.contiguous()
    w = norm_weight.reshape(-1).float().contiguous() if has_norm else torch.ones(H, dtype=torch.float32, device=dev)
    kernel(mixes.float().contiguous(), s3, base.reshape(-1).float().contiguous(), residual.contiguous(), w,
           float(pre_eps), float(sk_eps), float(post_mult), float(norm_eps or 0.0), post, comb, y)
    return post, comb, y


def mhc_post_rows(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a sublayer through the mHC program; a new contiguous ``[T, n, H]`` tensor."""
    T_, n, H = residual.shape
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if T_ == 0:
        return out
    kernel = mhc_post_kernel(n, H, tl_dtype(x.dtype))
    kernel(x.contiguous(), residual.contiguous(), post.reshape(T_, n).float().contiguous(), comb.float().contiguous(),
           out)
    return out


def attention_slots_kernel(window: int, mode: int, target=None):
    from .slots_kernel import build_attention_slots

    return compile_cached(("dsv4_attention_slots", window, mode), lambda: build_attention_slots(window, mode),
                          target=target)


def attention_slots_tilelang(positions, req, swa_table, swa_block, window, ratio, main_table, main_rows, topk_local,
                             width):
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.model.slots.attention_slots` (arguments checked
    there): one launch for both sets."""
    dev = positions.device
    T = positions.numel()
    K = topk_local.shape[1] if ratio == 4 else (width if ratio == 128 else 1)  # window only: a dummy column
    win = torch.empty(T, window, dtype=torch.int32, device=dev)
    comp = torch.empty(T, K, dtype=torch.int32, device=dev)
    i32 = lambda t: t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()  # noqa: E731
    mt = i32(main_table) if main_table is not None else torch.full((1, 1), -1, dtype=torch.int32, device=dev)
    tk = i32(topk_local) if ratio == 4 else torch.empty(T, K, dtype=torch.int32, device=dev)
    attention_slots_kernel(window, ratio)(i32(positions), i32(req), i32(swa_table), mt, tk,
                                          win, comp, swa_block, max(main_rows, 1), ratio)
    return win, (comp if ratio != 1 else None)
