"""vLLM adapter (entry point ``vllm.general_plugins: tilelang_musa``).

vLLM calls :func:`register` with no arguments in every process. For now it announces the plugin; the v1
attention backend is registered by the vLLM adapter issue.
"""

from __future__ import annotations

import logging

from .. import BACKEND_NAME

logger = logging.getLogger(__name__)

registered = False


def register() -> None:
    """Entry-point hook; idempotent."""
    global registered
    if not registered:
        logger.info("musa_attn_backend: vLLM plugin %r loaded", BACKEND_NAME)
    registered = True
