"""SGLang adapter (entry point ``sglang.srt.plugins: tilelang_musa``).

SGLang calls :func:`register` with no arguments in each of its processes (launcher, scheduler,
detokenizer). For now it announces the plugin; the attention backend itself is registered by the SGLang
adapter issue.
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
        logger.info("musa_attn_backend: SGLang plugin %r loaded", BACKEND_NAME)
    registered = True
