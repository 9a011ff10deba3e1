"""Argument checks and implementation selection shared by the kernel families."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

IMPLS = ("auto", "tilelang", "reference")

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def check(cond: bool, msg: Union[str, Callable[[], str]]) -> None:
    """Raise ``ValueError(msg)`` unless ``cond`` (every argument check goes through here). ``msg`` may be a
    callable that builds the message: checks run on every launch, and formatting shapes and dtypes into
    messages nobody reads would cost more than the checks themselves."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def is_int_tensor(t) -> bool:
    """``t`` is a tensor of an integer dtype (bool excluded): what index, slot and length arguments must be."""
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool


def resolve_impl(impl: str, device: torch.device, op: str) -> str:
    """``auto`` → ``tilelang`` on a GPU tensor, ``reference`` on a CPU tensor."""
    check(impl in IMPLS, lambda: f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "reference" if device.type == "cpu" else "tilelang"
    if impl == "tilelang":
        check(device.type != "cpu",
              lambda: f"{op}: impl='tilelang' needs the tensors on a CUDA or MUSA device, they are on {device}")
    return impl


def check_same_device(op: str, **tensors: Optional[torch.Tensor]) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    check(all(d == first for d in devices.values()),
          lambda: f"{op}: all tensors must be on one device; got "
                  f"{{{', '.join(f'{n}: {d}' for n, d in devices.items())}}}")
    return first


def check_scale(op: str, name: str, scale: Optional[Union[float, torch.Tensor]], num_kv_heads: int) -> None:
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        check(scale.numel() in (1, num_kv_heads),
              lambda: f"{op}: {name} must be a scalar (per-tensor) or have {num_kv_heads} elements (per KV head), "
              f"got shape {tuple(scale.shape)}")
        check(scale.is_floating_point(), lambda: f"{op}: {name} must be a floating tensor, got {scale.dtype}")
    else:
        check(isinstance(scale, (int, float)) and scale > 0,
              lambda: f"{op}: {name} must be a positive number, got {scale!r}")


_CONSTANTS: dict = {}


def constant_vector(kind: str, n: int, device) -> torch.Tensor:
    """Cached all-ones / all-zeros float32 vectors for kernels (no allocation or fill on the hot path)."""
    key = (kind, n, torch.device(device) if isinstance(device, str) else device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = (torch.ones if kind == "ones" else torch.zeros)(n, dtype=torch.float32, device=device)
        _CONSTANTS[key] = t
    return t


def per_kv_head(scale: Optional[Union[float, torch.Tensor]], num_kv_heads: int, device) -> torch.Tensor:
    """A float32 ``[num_kv_heads]`` scale vector for a kernel (ones when ``scale`` is None)."""
    if scale is None:
        return constant_vector("ones", num_kv_heads, device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    return s.expand(num_kv_heads).contiguous()
