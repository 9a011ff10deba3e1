"""DeepSeek-V4 layer selection in vLLM 0.33.0 under ``--attention-backend tilelang_musa``.

vLLM's V4 model (CUDA and out-of-tree platforms, MUSA included: ``models/deepseek_v4/nvidia``) picks its attention
layer class in ``nvidia.model._select_dsv4_attn_cls``, never through the attention selector, and returns its
FlashMLA class for any backend it does not know, ours included: the user's choice would be dropped silently. The
decoder layer looks the function up in its module's globals at build time (the MTP layers too), so replacing that
global takes the choice over:

- V4 (``deepseek_v4``): ``tilelang_musa`` selects :class:`.dsv4.MusaDeepseekV4Attention`, and so does no choice at
  all on a MUSA platform; every other backend keeps vLLM's choice.
- V4.1 (``deepseek_v41``, its own model package and selector): ``tilelang_musa`` is refused with a message (our
  layer serves V4's layout only); other backends keep vLLM's choice.

The modules are heavy to import (seconds), so nothing imports them early: the replacement is made when vLLM
itself imports one (a post-import hook), or at once where it is already imported. Idempotent, in every process
that loads the plugin (fork and spawn alike: each loads the plugin).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

V4 = "vllm.models.deepseek_v4.nvidia.model"
V41 = "vllm.models.deepseek_v41.nvidia.model"
TARGETS = (V4, V41)

_state = {"finder": None}


def refusal_v41() -> str:
    return ("tilelang_musa: DeepSeek-V4.1 checkpoints are not supported (this backend serves DeepSeek-V4's cache "
            "layout); pick a vLLM V4.1 backend (e.g. --attention-backend FLASHMLA_SPARSE_DSV41 on CUDA)")


def _ours_by_default() -> bool:
    from .. import platform

    return platform.get_platform().kind == "musa"


def _patch(module) -> None:
    original = module._select_dsv4_attn_cls
    if getattr(original, "_tilelang_musa", False):
        return
    v41 = module.__name__ == V41

    def select(vllm_config):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        from . import ENUM_NAME

        backend = vllm_config.attention_config.backend
        ours = backend is not None and backend is AttentionBackendEnum.__members__.get(ENUM_NAME)
        if v41:
            if ours:
                raise ValueError(refusal_v41())
            return original(vllm_config)
        if ours or (backend is None and _ours_by_default()):
            from .dsv4 import MusaDeepseekV4Attention

            return MusaDeepseekV4Attention
        return original(vllm_config)

    select._tilelang_musa = True
    select.__wrapped__ = original
    module._select_dsv4_attn_cls = select


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each of ``TARGETS`` through the other finders, and patches it right after it executes."""

    def __init__(self):
        self._loaders = {}

    def find_spec(self, name, path=None, target=None):
        if name not in TARGETS:
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
        _patch(module)


def install() -> None:
    """Take V4 layer selection over (idempotent; see the module docstring)."""
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None:
            _patch(module)
    if _state["finder"] is None:
        _state["finder"] = _PatchOnImport()
        sys.meta_path.insert(0, _state["finder"])
