"""A tiny DeepSeek-V4 for engine tests, built locally from a config (nothing downloads): 4 layers with compress
ratios 0, 4, 128, 4, head dim 512 (448 + 64), 16 indexer heads choosing 512 compressed rows, 4 routed experts and
1 shared (top 2, SwiGLU clamp 10), mHC over 4 streams, a 1024-token vocabulary. With ``weights``, random bf16
weights under DeepSeek's checkpoint names (``dsv4_reference.checkpoint``) go into ``model.safetensors``; without,
the engines load it with ``load_format="dummy"``."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 64,
    "o_lora_rank": 64, "o_groups": 2, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448, "v_head_dim": 512,
    "kv_lora_rank": 512, "compress_ratios": [0, 4, 128, 4], "index_n_heads": 16, "index_head_dim": 128,
    "index_topk": 512, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "intermediate_size": 256, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "vocab_size": 1024, "sliding_window": 128, "window_size": 128, "num_hash_layers": 0, "swiglu_limit": 10.0,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "bos_token_id": 0, "eos_token_id": 1,
    "topk_method": "noaux_tc", "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "moe_layer_freq": 1, "ep_size": 1, "attention_bias": False,
    "tie_word_embeddings": False, "q_head_norm": True,
}

DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "<｜System｜>",
                     "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>", "｜DSML｜", "<｜deepseek_image｜>",
                     "<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>", "<｜point｜>", "<｜/point｜>", "<｜polygon｜>",
                     "<｜/polygon｜>")

# How the engine tests and the V4 demo start SGLang's server for this model (``sglang_server.sglang_server``).
SERVER = {"page_size": 256, "max_total_tokens": 16384, "startup_timeout": 600.0,
          "extra": ["--dtype", "bfloat16", "--swa-full-tokens-ratio", "0.5", "--mem-fraction-static", "0.3"]}


def prompts(vocab: int, medium: bool = False) -> dict[str, list[int]]:
    """Token prompts past the special tokens: 35 tokens, 2,600 (the window wraps, the indexer chooses 512 of 650
    compressed rows), and 1,303 sharing the long one's first five whole 256-token pages; with ``medium``, 300."""
    first = 32
    long = [first + (7 + 37 * i) % (vocab - first) for i in range(2600)]
    out = {"short": [first + (5 * i) % (vocab - first) for i in range(35)]}
    if medium:
        out["medium"] = [first + (11 * i + 3) % (vocab - first) for i in range(300)]
    return {**out, "long": long, "shared": long[:1300] + [first + 1, first + 2, first + 3]}


def build(out: Path, tokenizer: bool = False, weights: bool = False, seed: int = 0) -> Path:
    """``config.json`` in ``out``; with ``tokenizer``, the tiny Llama's byte-level BPE tokenizer and a matching
    vocabulary size; with ``weights``, ``model.safetensors`` (random, from ``seed``)."""
    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG)
    if tokenizer:  # DeepSeek's special tokens, as SGLang's V4 chat encoder (deepseek-recipe) spells them
        from tiny_model import build_tokenizer

        fast = build_tokenizer(out, specials=DEEPSEEK_SPECIALS, bos=DEEPSEEK_SPECIALS[0], eos=DEEPSEEK_SPECIALS[1])
        config.update(vocab_size=len(fast), bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if weights:
        import dsv4_reference

        dsv4_reference.save(dsv4_reference.checkpoint(config, seed), out)
    return out
