"""The one place that imports TileLang and compiles kernels for the current platform target."""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import torch

from .cache import configure_tilelang_env
from .platform import get_platform

configure_tilelang_env()

import tilelang as tl  # noqa: E402
import tilelang.language as tl_lang  # noqa: E402

__all__ = ["tl", "tl_lang", "tl_dtype", "compile_cached", "tilelang_version"]

_TORCH_TO_TL = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3",
    torch.int32: "int32",
    torch.int64: "int64",
}

_lock = threading.Lock()
_kernels: dict[Hashable, Any] = {}


def tilelang_version() -> str:
    return getattr(tl, "__version__", "unknown")


def tl_dtype(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError:
        raise ValueError(f"no TileLang dtype for {dtype}; supported: {list(_TORCH_TO_TL)}") from None


def compile_cached(key: Hashable, build: Callable[[], Any], *, target=None, pass_configs=None):
    """Compile ``build()`` (a ``@T.prim_func``) once per (key, target) in this process.

    TileLang keeps compiled libraries on disk as well (see :mod:`musa_attn_backend.cache`), so a second
    process with the same kernel loads it instead of invoking nvcc / mcc again.
    """
    target = target if target is not None else get_platform().tilelang_target()
    full_key = (key, repr(target), repr(sorted((pass_configs or {}).items())))
    kernel = _kernels.get(full_key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(full_key)
            if kernel is None:
                kernel = tl.compile(build(), target=target, pass_configs=pass_configs)
                _kernels[full_key] = kernel
    return kernel
