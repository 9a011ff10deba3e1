"""SGLang adapter (entry point ``sglang.srt.plugins: tilelang_musa``).

SGLang calls :func:`register` with no arguments in each of its processes (launcher, scheduler,
detokenizer). It registers the ``tilelang_musa`` attention backend factory, adds the name to the
``--attention-backend`` / ``--prefill-attention-backend`` / ``--decode-attention-backend`` choices and keeps the
name for DeepSeek-V4 models (whose model override would replace it by ``dsv4``). It is idempotent. Registration
errors are raised (SGLang logs and skips a failing plugin, so the user then sees ``invalid choice:
'tilelang_musa'`` together with our log line naming the cause).
"""

from __future__ import annotations

import logging

from .. import BACKEND_NAME

logger = logging.getLogger(__name__)

registered = False

SUPPORTED_SGLANG = ("0.5.23",)


def register() -> None:
    """Entry-point hook; idempotent."""
    global registered
    if registered:
        return
    try:
        import sglang
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
        from sglang.srt.layers.attention.attention_registry import register_attention_backend
    except Exception as e:
        logger.error("musa_attn_backend: cannot register %r with this SGLang (%s: %s); supported: SGLang %s",
                     BACKEND_NAME, type(e).__name__, e, ", ".join(SUPPORTED_SGLANG))
        raise
    from .backend import create_backend

    register_attention_backend(BACKEND_NAME)(create_backend)
    _keep_backend_for_deepseek_v4()
    from .drafts import install as install_draft_backends

    install_draft_backends()
    from .model_hooks import install as install_model_kernels

    install_model_kernels()
    from .moe import install as install_moe_experts

    install_moe_experts()
    from .requests import install as install_request_guard

    install_request_guard()
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    version = getattr(sglang, "__version__", "?")
    if version not in SUPPORTED_SGLANG:
        logger.warning("musa_attn_backend: SGLang %s is untested (tested: %s)", version, ", ".join(SUPPORTED_SGLANG))
    logger.info("musa_attn_backend: registered attention backend %r with SGLang %s", BACKEND_NAME, version)
    registered = True


def _keep_backend_for_deepseek_v4() -> None:
    """SGLang's model override for DeepSeek-V4 sets ``attention_backend = "dsv4"`` whatever the user asked; a
    provider registered after it keeps ``tilelang_musa`` (the overrides merge last-writer-wins). SGLang's own
    providers are registered when ``attention_registry`` imports its override module, which the caller did."""
    from sglang.srt.arg_groups.model_override_base import register_model_override

    from .dsv4_selection import keep_tilelang_musa

    register_model_override("DeepseekV4ForCausalLM")(keep_tilelang_musa)
