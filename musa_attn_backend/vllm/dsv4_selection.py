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

V4 = "vllm.models.deepseek_v4.nvidia.model"
V41 = "vllm.models.deepseek_v41.nvidia.model"
TARGETS = (V4, V41)


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

        from .names import ENUM_NAME

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


def install() -> None:
    """Take V4 layer selection over (idempotent; see the module docstring)."""
    from ..import_hooks import patch_on_import

    for name in TARGETS:
        patch_on_import(name, _patch)
