"""Which SGLang backend class serves a runner, and the model-override provider that keeps ``tilelang_musa`` for
DeepSeek-V4. Light imports only: :func:`musa_attn_backend.sglang.register` loads this in every SGLang process."""

from __future__ import annotations


def is_deepseek_v4_runner(model_runner) -> bool:
    """Whether SGLang built the runner's pool for DeepSeek-V4 (the pool is chosen from the model, never from the
    backend's name)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return isinstance(getattr(model_runner, "token_to_kv_pool", None), DeepSeekV4TokenToKVPool)


def keep_tilelang_musa(server_args, hf_config) -> dict:
    """A model-override provider for ``DeepseekV4ForCausalLM``, registered after SGLang's own (which sets the
    attention backend to ``dsv4`` unconditionally): the user's ``--attention-backend tilelang_musa`` stays."""
    from .. import BACKEND_NAME

    return {"attention_backend": BACKEND_NAME} if getattr(server_args, "attention_backend", None) == BACKEND_NAME \
        else {}
