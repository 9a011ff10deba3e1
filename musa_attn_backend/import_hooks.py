"""Patch an engine module right after it is imported (or at once, where it is imported already), without
importing it early: the engines' model and quantisation modules are heavy, and some import compiled extensions
that a given install may lack. One finder at the front of ``sys.meta_path`` serves every registration; it finds
the module through the other finders and runs the patch after the module executes."""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

_lock = threading.Lock()
_patches: dict[str, list[Callable]] = {}
_finder = None


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._loaders = {}

    def find_spec(self, name, path=None, target=None):
        if name not in _patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                self._loaders[name] = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        loader = self._loaders[spec.name]
        return loader.create_module(spec) if hasattr(loader, "create_module") else None

    def exec_module(self, module):
        self._loaders[module.__spec__.name].exec_module(module)
        for patch in _patches.get(module.__spec__.name, ()):
            patch(module)


def patch_on_import(name: str, patch: Callable) -> None:
    """Run ``patch(module)`` when module ``name`` is imported, or now if it is. Registering the same ``patch``
    for a name twice runs it once; ``patch`` itself must be idempotent (a module imported before and patched now
    may be patched again by a later registration)."""
    global _finder
    with _lock:
        fns = _patches.setdefault(name, [])
        if patch not in fns:
            fns.append(patch)
        if _finder is None:
            _finder = _PatchOnImport()
            sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
