"""A tiny DeepSeek-V4 (``tiny_dsv4.py``: 4 layers with compress ratios 0, 4, 128, 4, random bf16 weights under
DeepSeek's checkpoint names, FP8 KV cache, the DeepSeek special tokens) served over HTTP by a real ``python -m
sglang.launch_server --attention-backend tilelang_musa`` on the CPU: our V4 backend, both compressors, the C4
indexer and this package's model kernels inside SGLang's own server.

Checked against ``dsv4_reference.Reference``, an independent float32 V4 forward written from the model's math, by
teacher forcing (``dsv4_reference.agreement``): every prompt position's log-probability as SGLang's prefill computes
it and every greedy step's, for a short prompt, one of 2,600 tokens (the window wraps, the C4 indexer chooses 512 of
650 compressed rows, the C128 layer reads 20 rows) and one sharing 1,300 tokens with it, each decoding 64 tokens in
one batch; then the short and shared prompts again (the shared prefix a radix-cache hit) and a text prompt. An
empty prompt first gets a 400 (``musa_attn_backend.sglang.requests``) and the server answers everything after it. The
OpenAI chat endpoint answers through SGLang's V4 chat encoder with the same tokens ``/generate`` gives for the
encoded prompt."""

import sys
import urllib.error
from pathlib import Path

import pytest

pytest.importorskip("sglang")
pytest.importorskip("deepseek_recipe")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dsv4_reference import Reference, agreement, load, served_logprobs  # noqa: E402
from sglang_server import post, sglang_server  # noqa: E402
from tiny_dsv4 import SERVER, build, prompts  # noqa: E402

MAX_NEW = 64
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def _check(ref, name, prompt, out, *, with_prompt: bool):
    ids, lps = out["output_ids"], served_logprobs(out)
    assert len(ids) == MAX_NEW, f"{name}: {len(ids)} tokens"
    if not with_prompt:  # only the output's log-probabilities: pad the prompt positions
        lps = [None] * len(prompt) + lps
    res = agreement(ref, prompt + ids, lps, len(prompt))
    assert not res["failures"], f"{name} disagrees with the reference V4 forward: {res}"
    print(name, {k: v for k, v in res.items() if k != "failures"})
    return ids, res


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny-v4"), tokenizer=True, weights=True)


def test_tiny_deepseek_v4_over_http_agrees_with_the_reference(model, tmp_path):
    import json

    from transformers import AutoTokenizer

    config = json.loads((model / "config.json").read_text())
    ref = Reference(config, load(model))
    asks = prompts(config["vocab_size"])
    log = tmp_path / "server.log"
    with sglang_server(model, "tilelang_musa", log=log, shim_log=tmp_path / "shim.log", **SERVER) as base:
        # an empty prompt: refused with a 400 before the scheduler (SGLang's own 0-token prefill would stop it);
        # every request below is the next one the server must still answer
        with pytest.raises(urllib.error.HTTPError) as empty:
            post(base + "/generate", {"text": "", "sampling_params": GREEDY}, timeout=120)
        assert empty.value.code == 400 and "The input is empty" in empty.value.read().decode(), empty.value
        names = ["short", "long", "shared"]
        batch = post(base + "/generate", {"input_ids": [asks[n] for n in names], "sampling_params": GREEDY,
                                          "return_logprob": True, "logprob_start_len": 0}, timeout=900)
        again = post(base + "/generate", {"input_ids": [asks["short"], asks["shared"]],
                                          "sampling_params": GREEDY, "return_logprob": True}, timeout=600)
        text = post(base + "/generate", {"text": "The attention backend reads the cache", "sampling_params": GREEDY,
                                         "return_logprob": True, "logprob_start_len": 0}, timeout=600)
        messages = [{"role": "user", "content": "Which kernels run the attention?"}]
        chat = post(base + "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 16,
                                                    "temperature": 0, "ignore_eos": True}, timeout=600)
        # the chat prompt as SGLang's V4 encoder writes it, through /generate
        from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe

        enc = DeepSeekRecipe.from_hf_tokenizer("dsv4", AutoTokenizer.from_pretrained(model))
        chat_ids = enc.encode({"messages": messages, "thinking": False})
        plain = post(base + "/generate", {"input_ids": chat_ids, "sampling_params": {**GREEDY, "max_new_tokens": 16},
                                          "return_logprob": True}, timeout=600)

    (tmp_path / "served.json").write_text(json.dumps({"prompts": asks, "batch": batch, "again": again}))
    for name, out in zip(names, batch):
        _check(ref, name, asks[name], out, with_prompt=True)
    # the second pass: the shared prompt's five pages come from the radix cache
    assert again[1]["meta_info"]["cached_tokens"] >= 1280, again[1]["meta_info"]
    for name, out in zip(["short", "shared"], again):
        _check(ref, name + " again", asks[name], out, with_prompt=False)
    # a text prompt through the server's tokenizer: its ids come back with the prompt log-probabilities
    text_ids = [x[1] for x in text["meta_info"]["input_token_logprobs"]]
    _check(ref, "text", text_ids, text, with_prompt=True)
    tok = AutoTokenizer.from_pretrained(model)
    assert text["text"] == tok.decode(text["output_ids"], skip_special_tokens=True)
    # chat: SGLang's V4 encoder, the same greedy tokens as /generate on the encoded prompt
    assert chat["usage"]["prompt_tokens"] == len(chat_ids) and chat["usage"]["completion_tokens"] == 16, chat
    assert chat["choices"][0]["message"]["content"] == tok.decode(plain["output_ids"], skip_special_tokens=True)
    assert "TileLangMusaDSV4Backend" in log.read_text(errors="replace")
