"""A request SGLang 0.5.23 cannot serve, refused at its door instead of in its scheduler.

An empty prompt (``"text": ""`` with a tokenizer that adds no BOS, or ``"input_ids": []``) passes SGLang's
validation and reaches the scheduler as a prefill of 0 tokens; SGLang's own model code then fails on it (the
RoPE of a dense model on ``torch_native`` as well, the logits processor's last-token gather of every model) and
the failure stops the scheduler, so every other client loses the server. Under ``tilelang_musa`` the tokenizer
manager refuses such a request with a 400 naming the cause, before it is scheduled; everything else reaches
SGLang's validation unchanged. (Our kernels and hooks take 0-token batches: SGLang also schedules IDLE
batches of 0 tokens on data-parallel attention ranks with no request. This guard is for SGLang's own code.)
"""

from __future__ import annotations

from .. import BACKEND_NAME

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"

EMPTY_PROMPT = ("The input is empty (0 tokens): a prompt needs at least one token ({backend} refuses it here; "
                "SGLang {version} stops its scheduler on a 0-token prefill)")


def serves_with_us(server_args) -> bool:
    """Whether any of the server's attention backends (prefill, decode or both) is this package's."""
    names = {getattr(server_args, n, None) for n in ("attention_backend", "prefill_attention_backend",
                                                       "decode_attention_backend")}
    return BACKEND_NAME in names


def validate_one_request(original, self, obj, input_ids, *args, **kwargs):
    """Around ``TokenizerManager._validate_one_request``: a prompt of token ids with none in it is refused (a
    ``ValueError``, which SGLang answers with a 400) when this package serves the attention; prompts given as
    embeddings (``input_ids`` None) and every other request go to SGLang's validation as they are."""
    if input_ids is not None and len(input_ids) == 0 and serves_with_us(getattr(self, "server_args", None)):
        import sglang

        raise ValueError(EMPTY_PROMPT.format(backend=BACKEND_NAME, version=getattr(sglang, "__version__", "?")))
    return original(self, obj, input_ids, *args, **kwargs)


_installed = False


def install() -> None:
    """Register the guard with SGLang's hook registry (idempotent; every device)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_one_request, HookType.AROUND)
    _installed = True
