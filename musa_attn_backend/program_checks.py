"""The registry of the check :func:`musa_attn_backend._tilelang.compile_cached` runs on every program before lowering
it: ``check(prim_func, feature flags) -> [violations]`` (the kernels' TIR rules, :func:`.kernels._tir.violations`,
register it when the kernels package is imported). A module of its own at the bottom of the package, importing
nothing, so neither the compile layer imports the kernels nor the kernels' import pulls in TileLang."""

from __future__ import annotations

from typing import Callable, Optional

_check: list = []


def register(check_fn: Callable) -> None:
    """Make ``check_fn(func, features)`` the rule check run before lowering."""
    _check[:] = [check_fn]


def registered() -> Optional[Callable]:
    return _check[0] if _check else None
