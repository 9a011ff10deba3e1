"""The request guard (``musa_attn_backend.sglang.requests``): under ``tilelang_musa`` SGLang's tokenizer manager
refuses a prompt of no token with a ValueError (SGLang's 400) before it is scheduled; prompts with tokens, prompts
given as embeddings and servers of other backends reach SGLang's own validation unchanged. (The real server:
``integration_tests/test_sglang_dsv4_server.py`` and ``test_sglang_dsv4_load.py``.)"""

import types

import pytest

pytest.importorskip("sglang")

from musa_attn_backend.sglang import requests  # noqa: E402


def _manager(backend="tilelang_musa", **others):
    names = dict(attention_backend=backend, prefill_attention_backend=None, decode_attention_backend=None)
    return types.SimpleNamespace(server_args=types.SimpleNamespace(**{**names, **others}))


def test_an_empty_prompt_is_refused_before_sglang_validates():
    calls = []
    with pytest.raises(ValueError, match="The input is empty \\(0 tokens\\)"):
        requests.validate_one_request(lambda *a: calls.append(a), _manager(), object(), [])
    assert not calls


@pytest.mark.parametrize("manager, ids", [
    (_manager(), [5]),  # a prompt with a token
    (_manager(), None),  # embeddings instead of ids
    (_manager("torch_native"), []),  # another backend: SGLang's behaviour stays SGLang's
    (_manager("torch_native", decode_attention_backend="tilelang_musa"), [3, 4]),
])
def test_everything_else_reaches_sglang(manager, ids):
    calls = []
    requests.validate_one_request(lambda *a: calls.append(a) or "checked", manager, "obj", ids)
    assert calls == [(manager, "obj", ids)]


def test_a_split_backend_is_guarded_too():
    m = _manager("torch_native", prefill_attention_backend="tilelang_musa")
    with pytest.raises(ValueError, match="empty"):
        requests.validate_one_request(lambda *a: None, m, object(), [])


def test_the_guard_is_registered_on_sglangs_validation():
    from sglang.srt.plugins.hook_registry import HookRegistry

    requests.install()
    hooks = HookRegistry._hooks[requests.TARGET]
    assert any(h is requests.validate_one_request for _, h, _ in hooks)
    import importlib

    mod, cls, meth = requests.TARGET.rsplit(".", 2)
    assert hasattr(getattr(importlib.import_module(mod), cls), meth), "SGLang's validation moved"
