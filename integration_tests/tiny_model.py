"""Build a tiny Llama-style model locally: config, random safetensors weights and a byte-level BPE tokenizer
trained on local text (no downloads). Used by the real-server tests and the main-job demo."""

from __future__ import annotations

import json
from pathlib import Path

# the tokenizer's training text: a frozen copy of the README of 7601a9e, not the README itself, whose every edit
# retrained the tokenizer and so changed the tests' text prompts' token ids and the served sequences they check
TEXT = Path(__file__).resolve().parent / "tokenizer_corpus.txt"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


SPECIALS = ("<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>")


def build_tokenizer(out: Path, vocab: int = 512, specials: tuple[str, ...] = SPECIALS, bos: str = "<s>",
                    eos: str = "</s>"):
    """A byte-level BPE tokenizer trained on :data:`TEXT` (``specials`` first, ``bos`` and ``eos`` among them; with a
    chat template), saved into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = TEXT.read_text() if TEXT.exists() else "hello world " * 200
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()] * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_tiny_llama(out_dir: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     vocab: int = 512, seed: int = 0, dtype: str = "float32") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(out, vocab)

    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id, tie_word_embeddings=False, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init, so greedy decoding is not a flat tie
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": fast.bos_token_id,
                                                            "eos_token_id": fast.eos_token_id}))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_llama"))
