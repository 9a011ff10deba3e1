"""DeepSeek-V4 layer selection in vLLM 0.33.0 under ``--attention-backend tilelang_musa``.

vLLM's V4 model (CUDA and out-of-tree platforms, MUSA included: ``models/deepseek_v4/nvidia``) picks its attention
layer class in ``nvidia.model._select_dsv4_attn_cls``, never through the attention selector, and returns its
FlashMLA class for any backend it does not know, ours included: the user's choice would be dropped silently. The
decoder layer looks the function up in its module's globals at build time (the MTP layers too), so replacing that
global takes the choice over.

Until this package's V4 layer lands, the replacement refuses ``tilelang_musa`` for a V4 model with a message
that says what to use instead; every other backend keeps vLLM's choice. The module is heavy to import (seconds),
so nothing imports it early: the replacement is made when vLLM itself imports it (a post-import hook), or at once
where it is already imported. Idempotent, in every process that loads the plugin.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.models.deepseek_v4.nvidia.model"

_state = {"finder": None}


def refusal() -> str:
    return ("tilelang_musa: DeepSeek-V4 attention through vLLM is not supported yet (its layer is not built); "
            "serve V4 with SGLang (--attention-backend tilelang_musa), or pick a vLLM V4 backend "
            "(e.g. --attention-backend FLASHMLA_SPARSE_DSV4 on CUDA)")


def _patch(module) -> None:
    original = module._select_dsv4_attn_cls
    if getattr(original, "_tilelang_musa", False):
        return

    def select(vllm_config):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        from . import ENUM_NAME

        backend = vllm_config.attention_config.backend
        if backend is not None and backend is AttentionBackendEnum.__members__.get(ENUM_NAME):
            raise ValueError(refusal())
        return original(vllm_config)

    select._tilelang_musa = True
    select.__wrapped__ = original
    module._select_dsv4_attn_cls = select


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``TARGET`` through the other finders, and patches it right after it executes."""

    def __init__(self):
        self._loader = None

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec) if hasattr(self._loader, "create_module") else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


def install() -> None:
    """Take V4 layer selection over (idempotent; see the module docstring)."""
    module = sys.modules.get(TARGET)
    if module is not None:
        _patch(module)
        return
    if _state["finder"] is None:
        _state["finder"] = _PatchOnImport()
        sys.meta_path.insert(0, _state["finder"])
