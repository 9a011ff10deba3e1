"""The one place that imports TileLang and compiles kernels for the current platform target."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Callable, Hashable

import torch
from filelock import FileLock

from .cache import cache_dir, configure_tilelang_env
from .config import kernel_settings
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


def kernel_digest(full_key) -> str:
    return hashlib.sha256(repr(full_key).encode()).hexdigest()[:32]


def compile_cached(key: Hashable, build: Callable[[], Any], *, target=None, pass_configs=None):
    """Compile ``build()`` (a ``@T.prim_func``) once per (key, target, pass configs, TileLang version, kernel
    settings). The kernel settings (``config.kernel_settings``: the switches that change which kernels are
    built) are in the key even where ``key`` already names their effect, so a build a switch changes can never
    load a kernel compiled under another value.

    In a process: a dict. Across processes: TileLang's on-disk cache inside our cache directory, guarded by
    a per-kernel file lock so that processes starting at once compile each kernel once (the others wait,
    then load it), plus a marker file written by atomic rename once the kernel is in the cache (``musa-attn
    warmup`` counts the markers to report what was already warm).
    """
    target = target if target is not None else get_platform().tilelang_target()
    full_key = (key, repr(target), repr(sorted((pass_configs or {}).items())), tilelang_version(),
                kernel_settings())
    kernel = _kernels.get(full_key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get(full_key)
        if kernel is None:
            digest = kernel_digest(full_key)
            root = cache_dir(create=True) / "kernels"
            root.mkdir(exist_ok=True)
            with FileLock(str(root / f"{digest}.lock")):
                kernel = tl.compile(build(), target=target, pass_configs=pass_configs)
                marker = root / f"{digest}.done"
                if not marker.exists():
                    tmp = root / f".{digest}.{os.getpid()}.tmp"
                    tmp.write_text(repr(full_key) + "\n")
                    os.replace(tmp, marker)
            _kernels[full_key] = kernel
    return kernel

