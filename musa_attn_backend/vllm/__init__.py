"""vLLM adapter (entry point ``vllm.general_plugins: tilelang_musa``).

vLLM calls :func:`register` with no arguments in every process. It adds the ``TILELANG_MUSA`` member to
``AttentionBackendEnum`` (so ``--attention-backend tilelang_musa``, ``LLM(..., attention_backend=
"tilelang_musa")`` and ``--attention-config '{"backend": "tilelang_musa"}'`` resolve; the lookup is
case-insensitive) and makes that member survive pickling into *spawned* workers. For DeepSeek-V4, whose model
picks its layer class itself, :mod:`.dsv4_selection` makes that choice return our V4 layer (:mod:`.dsv4`) for
``tilelang_musa`` instead of dropping it (and refuse it, with a message, for V4.1 checkpoints). :mod:`.moe` runs
the FP8 and MXFP4 MoE experts on this package's grouped GEMMs where ``MUSA_ATTN_MOE`` says so (on MUSA by
default).

The spawn trap: enum members pickle by value, and a spawned worker unpickles the ``VllmConfig`` holding the
member before it loads plugins, so a dynamically added member fails (``'...' is not a valid
AttentionBackendEnum``). Our member pickles by reference instead: to a call of :func:`_restore_member`, which
imports this module, registers, and returns the member. Nothing for the user to do: fork and spawn both work.
"""

from __future__ import annotations

import logging

from .names import CLASS_PATH, ENUM_NAME

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.33.0",)

registered = False


def _restore_member(name: str):
    """Unpickling target of our enum member (see the module docstring)."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _reduce_member(protocol=None):
    return _restore_member, (ENUM_NAME,)


def register() -> None:
    """Entry-point hook; idempotent."""
    global registered
    if registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ENUM_NAME not in AttentionBackendEnum.__members__:
        register_backend(ENUM_NAME, CLASS_PATH)
    member = AttentionBackendEnum[ENUM_NAME]
    # An instance attribute: pickle looks __reduce_ex__ up on the object, so only our member changes.
    object.__setattr__(member, "__reduce_ex__", _reduce_member)
    from . import dsv4_selection

    dsv4_selection.install()  # DeepSeek-V4 picks its layer class itself: take that choice over
    from . import moe

    moe.install()  # FP8 MoE experts on our grouped GEMMs where MUSA_ATTN_MOE says so
    import vllm

    version = getattr(vllm, "__version__", "?")
    if version not in SUPPORTED_VLLM:
        logger.warning("musa_attn_backend: vLLM %s is untested (tested: %s)", version, ", ".join(SUPPORTED_VLLM))
    logger.info("musa_attn_backend: registered attention backend %s with vLLM %s", ENUM_NAME, version)
    registered = True
