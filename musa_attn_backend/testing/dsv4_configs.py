"""DeepSeek-V4 model configs for planning and checks (config only: no weights, nothing downloads): V4-Flash and
V4-Pro as their ``config.json`` describe them (``../shared/reference/deepseek-v4-and-kernels.md``: 43 / 61 layers,
hidden 4096 / 7168, 64 / 128 heads, 256 / 384 routed experts of 2048 / 3072, the indexer's top-512 / 1024, a
context of 1M), the fields the engines and :mod:`musa_attn_backend.warmup_dsv4` read."""

from __future__ import annotations

_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448, "v_head_dim": 512, "kv_lora_rank": 512,
    "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "vocab_size": 129280,
    "sliding_window": 128, "swiglu_limit": 10.0, "max_position_embeddings": 1048576, "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
}

FLASH = dict(_COMMON, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
             index_topk=512, n_routed_experts=256, moe_intermediate_size=2048, routed_scaling_factor=1.5,
             compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0])  # the MTP layer: window only
PRO = dict(_COMMON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
           index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
           compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0])

CONFIGS = {"V4-Flash": FLASH, "V4-Pro": PRO}
