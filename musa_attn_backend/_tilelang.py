"""The one place that imports TileLang and compiles kernels for the current platform target."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Optional

import torch
from filelock import FileLock

from .cache import cache_dir, configure_tilelang_env
from .config import kernel_settings
from .platform import get_platform

configure_tilelang_env()

import tilelang as tl  # noqa: E402
import tilelang.language as tl_lang  # noqa: E402

__all__ = ["tl", "tl_lang", "tl_dtype", "compile_cached", "launcher", "tilelang_version", "intercepting", "lower"]

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
# the compile keys this process compiled with no cached build on disk (its marker missing): the kernels a warm
# cache did not hold, which a server compiles on its hot path (the warmup completeness test reads it)
cold_compiles: list = []
# (key, build, target, pass_configs) -> result, in place of compiling (see intercepting)
Handler = Callable[[Hashable, Callable[[], Any], Any, Optional[dict]], Any]
_handler: Optional[Handler] = None


def tilelang_version() -> str:
    return getattr(tl, "__version__", "unknown")


def tl_dtype(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError:
        raise ValueError(f"no TileLang dtype for {dtype}; supported: {list(_TORCH_TO_TL)}") from None


def kernel_digest(full_key) -> str:
    return hashlib.sha256(repr(full_key).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def _header_text(path) -> str:
    """A force-included header's text (read once a process: a kernel's key holds it)."""
    return Path(path).read_text()


def compile_cached(key: Hashable, build: Callable[[], Any], *, target=None, pass_configs=None,
                   headers: tuple = ()):
    """Compile ``build()`` (a ``@T.prim_func``) once per (key, target, pass configs, TileLang version, kernel
    settings). The kernel settings (``config.kernel_settings``: the switches that change which kernels are
    built) are in the key even where ``key`` already names their effect, so a build a switch changes can never
    load a kernel compiled under another value. ``headers``: device-code headers (paths) the kernel's compile
    force-includes (``-include``: device functions a program calls with ``T.call_extern``, CUDA only); their text
    is in the key.

    In a process: a dict. Across processes: TileLang's on-disk cache inside our cache directory, guarded by
    a per-kernel file lock so that processes starting at once compile each kernel once (the others wait,
    then load it), plus a marker file written by atomic rename once the kernel is in the cache (``musa-attn
    warmup`` counts the markers to report what was already warm).
    """
    target = target if target is not None else get_platform().tilelang_target()
    if _handler is not None:
        return _handler(key, build, target, pass_configs)
    full_key = (key, repr(target), repr(sorted((pass_configs or {}).items())), tilelang_version(),
                kernel_settings()) + tuple(_header_text(h) for h in headers)
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
                marker = root / f"{digest}.done"
                if not marker.exists():
                    cold_compiles.append(key)
                func = build()
                check_portable(key, func, target)
                flags = [f for h in headers for f in ("-include", str(h))]
                kernel = tl.compile(func, target=target, pass_configs=pass_configs,
                                    **({"compile_flags": flags} if flags else {}))
                if not marker.exists():
                    tmp = root / f".{digest}.{os.getpid()}.tmp"
                    tmp.write_text(repr(full_key) + "\n")
                    os.replace(tmp, marker)
            _kernels[full_key] = kernel
    return kernel



class _Entry:
    """A compiled kernel's TVM-FFI entry, called with the kernel's positional arguments (every output passed by
    the caller), one entry per device: TileLang 0.1.12 makes one per device, so the entry of the device current
    at the call is taken (the kernel's own call makes it on a device's first launch)."""

    __slots__ = ("kernel", "adapter", "entries")

    def __init__(self, kernel, adapter):
        self.kernel, self.adapter, self.entries = kernel, adapter, {}

    def __call__(self, *args):
        device = torch.cuda.current_device()
        entry = self.entries.get(device)
        if entry is None:
            self.kernel(*args)  # through TileLang once on this device: it makes and checks the entry
            self.entries[device] = _entry_function(_compiled_entry(self.adapter, device))
            return None
        return entry(*args)

    def handle(self, device: int):
        """The TVM-FFI handle of the entry's function on ``device`` (for :mod:`._ffi_launch`; the function object
        is kept here), None before the kernel's first launch there."""
        entry = self.entries.get(device)
        return None if entry is None else int(entry.__chandle__())


def _entry_function(entry):
    """The TVM-FFI function behind ``entry``: TileLang keeps a ``tvm.runtime.Executable`` (both versions; its call
    JIT-links a module and looks ``main`` up on every call) or, for a kernel loaded from TileLang's own cache, a
    ``tvm_ffi.Module``; either's entry function is taken once, so a launch is one FFI call."""
    import tvm_ffi

    if isinstance(entry, tvm_ffi.Function):
        return entry
    module = entry.jit() if hasattr(entry, "jit") else entry
    return module[module.entry_name]


def _compiled_entry(adapter, device: int):
    """The TVM-FFI executable TileLang's wrapper of ``adapter`` calls on ``device``: 0.1.15 keeps one
    (``_get_executable``), 0.1.12 one per device (``executable`` once set, else ``_executables_by_device``)."""
    get = getattr(adapter, "_get_executable", None)
    if get is not None:
        return get()
    entry = getattr(adapter, "executable", None) or adapter._executables_by_device.get(device)
    if entry is None:
        raise RuntimeError(f"launcher: TileLang {tilelang_version()} made no executable for device {device}")
    return entry


def launcher(kernel):
    """``kernel`` (from :func:`compile_cached`; every output passed by the caller) as the cheapest callable taking
    its positional arguments: on targets where :func:`musa_attn_backend.platform.direct_launch` holds and the
    kernel runs through TileLang's TVM-FFI adapter, its compiled entry called without TileLang's Python wrapper
    (the same arguments reach the same entry, which checks each argument's dtype, shape and device as before;
    about half the host time of a launch), else ``kernel`` itself. A kernel whose outputs TileLang allocates
    (``out_idx``) keeps the wrapper. For hot launch paths (an eager decode step's); a launcher returns None."""
    from .platform import direct_launch

    adapter = getattr(kernel, "adapter", None)
    if (adapter is None or getattr(adapter, "result_idx", None) or not direct_launch()
            or type(adapter).__name__ != "TVMFFIKernelAdapter"
            or not (hasattr(adapter, "_get_executable") or hasattr(adapter, "_executables_by_device"))):
        return kernel
    return _Entry(kernel, adapter)


def check_portable(key, func, target) -> None:
    """Raise a ValueError naming the kernel where ``func`` breaks a rule of ``target``'s lowering (the registered
    check, :func:`.kernels._tir.violations`: a register A operand where GEMMs take A from shared memory only, one
    tile in two majornesses, a 16-bit GEMM extent the target's layouts refuse, a slice at a run-time offset, a
    float vector wider than its code generator prints), and on every target the invariants (warp groups' register
    counts within the block's share). Before any lowering, so the error names the program and the rule instead
    of failing deep in the target's GEMM lowering or hanging on the device."""
    from . import program_checks
    from .platform import features_of

    check_fn = program_checks.registered()
    if check_fn is None:
        raise RuntimeError("compile_cached: no program check registered (import musa_attn_backend.kernels first)")
    try:
        feats = features_of(target)
    except ValueError:
        return  # a target this package does not describe: nothing known to check
    bad = check_fn(func, feats)
    if bad:
        raise ValueError(
            f"kernel {key!r} does not lower for {target!r}: " + "; ".join(
            f"{v.detail} [" + (f"platform.{v.flag} is false" if v.flag else "every target") + "]" for v in bad))


@contextlib.contextmanager
def intercepting(handler: Handler) -> Iterator[None]:
    """While the block runs, :func:`compile_cached` returns ``handler(key, build, target, pass_configs)`` instead
    of a compiled kernel: nothing is compiled, loaded or cached. For looking at the programs the launchers
    would build (their TIR, or their lowering alone: :func:`lower`) without a device compiler. The
    derived caches (plans, kernel handles) are emptied at both ends, so no handler result outlives the block.
    One block at a time in a process."""
    from .config import clear_derived_caches

    global _handler
    with _lock:
        if _handler is not None:
            raise RuntimeError("intercepting: another block is already intercepting compile_cached")
        _handler = handler
    clear_derived_caches()
    try:
        yield
    finally:
        with _lock:
            _handler = None
        clear_derived_caches()


class LoweredProgram(NamedTuple):
    """What TileLang's lowering of a program made: the generated device source, and the shared memory one block
    allocates (the dynamic pool plus static buffers, bytes)."""

    source: str
    shared_bytes: int


def lower(func, target, pass_configs: Optional[dict] = None) -> LoweredProgram:
    """TileLang's lowering of the prim_func ``func`` for ``target`` (any form TileLang takes), up to the
    generated device source. Runs no device compiler (nvcc, mcc): this is what tells whether a program lowers
    for a target on a machine without its toolchain. Raises what the lowering raises."""
    import importlib

    from tilelang import tvm

    tgt = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    with tvm.transform.PassContext(opt_level=3, config=pass_configs or {}), tgt:
        artifact = tl.lower(func, target=tgt, enable_host_codegen=False, enable_device_compile=False)
    shared = 0
    for _, fn in artifact.device_mod.functions.items():
        tir = importlib.import_module(type(fn).__module__.rsplit(".", 1)[0])
        shared += int((fn.attrs or {}).get("dyn_shared_memory_buf", 0))
        static = {}  # buffer name -> bytes (a buffer is allocated, and may be declared again)

        def visit(node, static=static):
            buf = getattr(node, "buffer", None)
            if type(node).__name__ in ("AllocBuffer", "DeclBuffer") and buf is not None and buf.scope() == "shared":
                static[buf.name] = functools.reduce(lambda n, x: n * int(x), buf.shape, 1) * buf.dtype.bits // 8

        tir.stmt_functor.post_order_visit(fn.body, visit)
        shared += sum(static.values())
    return LoweredProgram(artifact.kernel_source, shared)
