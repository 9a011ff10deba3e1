"""Which TileLang kernels the engines' paths ask for, found on a CPU: every public op called with CPU tensors and
``impl="auto"`` runs its TileLang launch glue first, as it would on a GPU, with each kernel the glue asks
``compile_cached`` for recorded (its compile key) and replaced by a launch that does nothing; then the op runs its
reference as it always does on a CPU, so results, and every test's assertions, stay those of the reference.

This is what the warmup completeness test compares with :func:`musa_attn_backend.warmup.plan_dsv4`: a kernel
the engines ask for that the plan lacks would compile on the serving hot path.

The ops choose their path through :func:`musa_attn_backend.kernels._common.resolve_impl`, which each op module
imports by name; :func:`tracing` replaces that name in every op module. From the replacement, the op being
resolved is the calling frame: it is called again, with its arguments as bound in that frame and ``impl``
``"tilelang"``, while the interception records the kernels (ops the glue calls in turn take the TileLang path
too, as on a GPU), and then resolved to its reference. Ops called from inside a reference run are not traced:
on a GPU they would not run.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from typing import Iterator

import torch

from .. import _tilelang, config
from ..kernels import _common


def op_modules() -> list[str]:
    """The kernel modules whose public ops resolve their path with ``resolve_impl`` (those importing it by name at
    module level), found in the sources so that a module moved or added is traced without a list to keep."""
    import ast
    from pathlib import Path

    root = Path(_common.__file__).resolve().parent  # musa_attn_backend/kernels
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.ImportFrom) and any(a.name == "resolve_impl" for a in node.names)
               for node in tree.body):
            parts = path.relative_to(root.parent.parent).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


class _NoLaunch:
    """What a traced kernel is: callable with anything, does nothing."""

    def __init__(self, key):
        self.key = key

    def __call__(self, *args, **kwargs):
        return None


class Trace:
    """The compile keys asked for, per target, in order (``keys[target]``), and the ops that asked
    (``(target, op, key)`` triples)."""

    def __init__(self, targets):
        self.keys: dict = {t: [] for t in targets}
        self.by_op: list = []
        self._at: list = []  # (target, op) of the launch being traced

    def unique(self, target) -> list:
        return list(dict.fromkeys(self.keys[target]))


def _tensors(args, kwargs) -> list:
    """The tensors among ``args`` and ``kwargs`` (and in the lists, tuples and dicts they hold), once each."""
    out, seen = [], set()

    def walk(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(list(args))
    walk(kwargs)
    return out


def _bound_args(frame, fn) -> tuple[list, dict]:
    """``fn``'s arguments as its running ``frame`` holds them, with ``impl="tilelang"``."""
    params = inspect.signature(fn).parameters
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params.values())
    args, kwargs = [], {}
    for name, p in params.items():
        value = "tilelang" if name == "impl" else frame.f_locals[name]
        if p.kind == p.VAR_POSITIONAL:
            args.extend(value)
        elif p.kind == p.VAR_KEYWORD:
            kwargs.update(value)
        elif p.kind == p.POSITIONAL_ONLY or (varargs and p.kind == p.POSITIONAL_OR_KEYWORD):
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


@contextlib.contextmanager
def tracing(targets=("sm_90a",)) -> Iterator[Trace]:
    """While the block runs (one at a time in a process), CPU calls of the public ops record the kernels their
    TileLang path would compile for each of ``targets`` (``MUSA_ATTN_TARGET`` values; :data:`Trace.keys`) and
    return their reference results."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    trace = Trace(targets)
    real = _common.resolve_impl
    state = threading.local()
    # the frames of ops resolved to their reference that may still run (held, so no later frame takes their id)
    reference_frames: list = []

    def resolve(impl, device, op):
        if getattr(device, "type", device) != "cpu":
            return real(impl, device, op)
        if getattr(state, "depth", 0):  # inside a traced launch: the TileLang path, as on a GPU
            return "tilelang" if impl in ("auto", "tilelang") else real(impl, device, op)
        caller = sys._getframe(1)
        above = []
        frame = caller.f_back
        while frame is not None:
            above.append(frame)
            frame = frame.f_back
        reference_frames[:] = [f for f in reference_frames if any(f is g for g in above)]
        if impl != "auto" or reference_frames:
            return real(impl, device, op)  # an explicit choice, or called by a reference: not a GPU launch
        fn = caller.f_globals[caller.f_code.co_name]
        args, kwargs = _bound_args(caller, fn)
        # the glue may write what the (idle) kernels returned into its arguments (in-place ops): each tensor
        # argument is put back as it was if its version counter moved
        saved = [(t, t._version, t.clone()) for t in _tensors(args, kwargs)]
        state.depth = 1
        try:
            for target in targets:
                trace._at.append((target, op))
                try:
                    with config.override(target=target):
                        fn(*args, **kwargs)
                finally:
                    trace._at.pop()
        finally:
            state.depth = 0
            for t, version, copy in saved:
                if t._version != version:
                    with torch.no_grad():
                        t.copy_(copy)
        reference_frames.append(caller)
        return real(impl, device, op)

    def record(key, build, tgt, pass_configs):
        target, op = trace._at[-1] if trace._at else (targets[0], None)
        trace.keys[target].append(key)
        trace.by_op.append((target, op, key))
        return _NoLaunch(key)

    modules = [importlib.import_module(m) for m in op_modules()]
    patched = [(m, m.resolve_impl) for m in modules if getattr(m, "resolve_impl", None) is real]
    with _tilelang.intercepting(record):
        for m, _ in patched:
            m.resolve_impl = resolve
        try:
            yield trace
        finally:
            for m, fn in patched:
                m.resolve_impl = fn
