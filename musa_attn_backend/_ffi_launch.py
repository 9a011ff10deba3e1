"""Compiled launches of TileLang kernels (``csrc/ffi_launch.cpp``): several kernels' compiled TVM-FFI entries
called in one crossing from Python, with the scratch tensors they share made in C++ and every tensor passed as a
DLTensor pointer, on the stream torch is on. For the hottest eager paths (a decode step's attention launches on
every layer), where Python's part of two launches costs more than the GPU work.

The extension is built on first use with torch's C++ extension loader into the cache directory (``ext/``), keyed
by the torch and TVM-FFI versions, and loaded from there afterwards. Where it cannot be built, :func:`load`
raises with the compiler's reason; the callers that use it do so only behind their own switch, never as a silent
replacement.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

from .cache import cache_dir
from .config import on_change, settings

SOURCE = Path(__file__).with_name("csrc") / "ffi_launch.cpp"

_lock = threading.Lock()
_module = None
_enabled: list = [None]  # enabled()'s answer for the current settings
_warned: set = set()
on_change(lambda: _enabled.__setitem__(0, None))
log = logging.getLogger("musa_attn_backend")


def wanted(target_kind: Optional[str] = None) -> bool:
    """Whether ``MUSA_ATTN_COMPILED_LAUNCH`` asks for the compiled launch on ``target_kind`` (default: this
    platform's): not ``off``, and the platform calls TileLang's compiled entries directly
    (:func:`musa_attn_backend.platform.direct_launch`: CUDA)."""
    from .platform import direct_launch

    return settings().compiled_launch != "off" and direct_launch(target_kind)


def enabled() -> bool:
    """Whether the launches that offer it go through :func:`run` / :func:`prepare` now: :func:`wanted`, and the
    extension loads (built here the first time: 30-60 s; ``musa-attn warmup`` builds it before serving). A build
    that fails raises under ``on``; under ``auto`` it is reported once, as a warning with the compiler's reason,
    and the answer is False (TileLang's launches: the same kernels and results, more host time)."""
    hit = _enabled[0]
    if hit is None:
        hit = wanted()
        if hit:
            try:
                load()
            except Exception as e:  # noqa: BLE001 - reported (or raised under "on"), never silent
                if settings().compiled_launch == "on":
                    raise RuntimeError(f"MUSA_ATTN_COMPILED_LAUNCH=on: the compiled launch's extension "
                                       f"({SOURCE.name}) did not build: {e}") from e
                if SOURCE.name not in _warned:
                    _warned.add(SOURCE.name)
                    log.warning("musa_attn_backend: the compiled launch's extension (%s) did not build, so "
                                "DeepSeek-V4's sparse decode launches through TileLang (more host time a call; "
                                "MUSA_ATTN_COMPILED_LAUNCH=off silences this): %s", SOURCE.name, e)
                hit = False
        _enabled[0] = hit
    return hit


def _tvm_ffi_paths() -> tuple[Path, Path]:
    import tvm_ffi

    root = Path(tvm_ffi.__file__).resolve().parent
    return root / "include", root / "lib"


def _build_dir(create: bool = False) -> tuple[str, Path]:
    """The extension's tag (its source, torch's and TVM-FFI's versions) and its build directory in the cache."""
    import tvm_ffi

    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + f"{torch.__version__} {tvm_ffi.__version__}".encode()).hexdigest()[:16]
    return tag, cache_dir(create=create) / "ext" / f"ffi_launch_{tag}"


def status() -> str:
    """One line for ``musa-attn doctor``: whether the compiled launch is used here and whether it is built."""
    if settings().compiled_launch == "off":
        return "off (MUSA_ATTN_COMPILED_LAUNCH=off): TileLang's launches"
    if not wanted():
        return "not used on this platform (TileLang's launches)"
    try:
        tag, build = _build_dir()
    except Exception as e:  # noqa: BLE001 - reported as the status
        return f"unavailable: {type(e).__name__}: {e}"
    built = build / f"musa_attn_ffi_launch_{tag}.so"
    return (f"{settings().compiled_launch}, built ({built})" if built.exists() else
            f"{settings().compiled_launch}, not built yet (musa-attn warmup builds it, else the first V4 decode)")


def load():
    """The compiled module (built once per torch / TVM-FFI / source version, then loaded from the cache)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            from torch.utils import cpp_extension

            include, lib = _tvm_ffi_paths()
            tag, build = _build_dir(create=True)
            build.mkdir(parents=True, exist_ok=True)
            _module = cpp_extension.load(
                name=f"musa_attn_ffi_launch_{tag}", sources=[str(SOURCE)], build_directory=str(build),
                extra_include_paths=[str(include)], extra_cflags=["-O2"],
                extra_ldflags=[f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"], verbose=False)
    return _module


class Alloc(tuple):
    """Argument placeholder: the ``i``-th tensor of :func:`run`'s ``allocs``."""

    def __new__(cls, i: int):
        return super().__new__(cls, (i,))


def handle(entry) -> int:
    """The TVM-FFI handle of a compiled entry (a ``tvm_ffi.Function``; the caller keeps the object alive)."""
    return int(entry.__chandle__())


def run(calls: Sequence[tuple[int, Sequence]], allocs: Sequence[tuple[Sequence[int], torch.dtype]],
        like: torch.Tensor, module: Optional[object] = None) -> list:
    """Make ``allocs`` (shape, dtype) on ``like``'s device, then call each ``(handle, args)`` of ``calls`` in
    order (``args``: tensors, ints, floats, :class:`Alloc`); returns the made tensors. An entry's error is raised
    as a RuntimeError with the entry's message (its argument checks run as when Python calls it)."""
    return (module or load()).run(calls, allocs, like)


class SlotView(tuple):
    """Argument placeholder for :func:`prepare`: ``view``, a view of ``slots[k]``, remade over each call's
    ``slots[k]`` (same dtype, shape, strides and byte offset from its data)."""

    def __new__(cls, k: int, view: torch.Tensor):
        return super().__new__(cls, (k, view))


def prepare(calls: Sequence[tuple[int, Sequence]], allocs: Sequence[tuple[Sequence[int], torch.dtype]],
            slots: Sequence[torch.Tensor], module: Optional[object] = None):
    """:func:`run`'s launches recorded once for calls that differ only in ``slots`` (tensors; ``calls`` may also
    name them as :class:`SlotView`): the returned object's ``run(slots: list)`` makes ``allocs`` on ``slots[0]``'s
    device and launches, or returns None (launching nothing) where a slot differs from the one recorded in shape,
    strides, dtype, device or data alignment (16 bytes). Tensors in ``calls`` are kept alive by it."""
    return (module or load()).Prepared(calls, allocs, list(slots))
