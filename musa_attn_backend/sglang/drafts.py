"""SGLang's speculative draft backends (EAGLE / NEXTN, DeepSeek-V4's MTP head) under ``tilelang_musa``.

SGLang 0.5.23 builds the draft's backends in ``speculative.draft_utils.DraftBackendFactory`` from maps keyed by
backend name that end in ``"EAGLE is not supported in ... backend {name}"`` for any name they do not list, ours
included. :func:`install` wraps the factory's one dispatch step (``_create_backend``) so that our name builds our
V4 backends for a V4 draft (the multi-step decode backend, and the draft-extend backend); every other name and
model goes to SGLang's maps unchanged. Idempotent.
"""

from __future__ import annotations

import functools

from .. import BACKEND_NAME

_installed = False


def _ours(factory, backend_map):
    """Our entry for ``backend_map`` (a decode map when it holds SGLang's V4 multi-step builder), or None where
    the draft is not a V4 model (then SGLang's refusal stands)."""
    from .dsv4_selection import is_deepseek_v4_runner

    runner = factory.draft_model_runner
    if not is_deepseek_v4_runner(runner):
        return None
    decode = getattr(backend_map.get("dsv4"), "__func__", None) is type(factory)._create_dsv4_decode_backend

    def build():
        from .dsv4 import TileLangMusaDSV4Backend, TileLangMusaDSV4MultiStepBackend

        if decode:
            return BACKEND_NAME, TileLangMusaDSV4MultiStepBackend(runner, factory.topk,
                                                                  factory.speculative_num_steps)
        return BACKEND_NAME, TileLangMusaDSV4Backend(runner, skip_prefill=False)

    return build


def install() -> None:
    global _installed
    if _installed:
        return
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    original = DraftBackendFactory._create_backend

    @functools.wraps(original)
    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        entry = _ours(self, backend_map) if BACKEND_NAME not in backend_map else None
        if entry is not None:
            backend_map = dict(backend_map, **{BACKEND_NAME: entry})
        return original(self, backend_name, backend_map, error_template, stamps_children)

    DraftBackendFactory._create_backend = _create_backend
    _installed = True
