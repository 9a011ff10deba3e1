"""``--attention-backend tilelang_musa`` for a DeepSeek-V4 model: SGLang's V4 model override replaces any backend
by ``dsv4``; our provider, registered after it by the entry point, keeps ours. Resolved in fresh interpreters from
a tiny V4 ``config.json`` written here (nothing downloads), as SGLang's launcher resolves ``ServerArgs``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[2]

TINY_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 64,
    "o_lora_rank": 64, "o_groups": 2, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448, "v_head_dim": 512,
    "kv_lora_rank": 512, "compress_ratios": [0, 4, 128, 4], "index_n_heads": 4, "index_head_dim": 128,
    "index_topk": 512, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "intermediate_size": 256, "hc_mult": 4, "vocab_size": 1024, "sliding_window": 128,
    "window_size": 128, "num_hash_layers": 0, "swiglu_limit": 10.0, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16", "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024, "beta_fast": 32,
                     "beta_slow": 1},
}

RESOLVE = """
import sys
if sys.argv[2] == "plugins":
    from sglang.srt.plugins import load_plugins
    load_plugins()
    load_plugins()  # every SGLang process loads them; a second load must change nothing
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view
args = ServerArgs(model_path=sys.argv[1], device="cpu", skip_tokenizer_init=True, **dict(
    a.split("=") for a in sys.argv[3:]))
args.resolve_once()
view = resolved_view(args)
print("RESOLVED", view.attention_backend, *attention_backends_of(view))
"""


def _resolve(tmp_path, plugins: bool, *fields: str) -> list:
    (tmp_path / "config.json").write_text(json.dumps(TINY_V4))
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "integration_tests" / "sgl_kernel_shim"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", RESOLVE, str(tmp_path), "plugins" if plugins else "none", *fields],
                         capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESOLVED")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return line[-1].split()[1:]


def test_sglang_alone_replaces_the_backend_by_dsv4(tmp_path):
    """The trap our provider closes: without the plugin, SGLang resolves a V4 model to ``dsv4``."""
    assert _resolve(tmp_path, False, "attention_backend=tilelang_musa") == ["dsv4"] * 3


def test_tilelang_musa_survives_the_v4_override(tmp_path):
    assert _resolve(tmp_path, True, "attention_backend=tilelang_musa") == ["tilelang_musa"] * 3


def test_other_backends_keep_sglangs_choice(tmp_path):
    assert _resolve(tmp_path, True, "attention_backend=triton") == ["dsv4"] * 3


def test_split_flags_select_ours(tmp_path):
    got = _resolve(tmp_path, True, "prefill_attention_backend=tilelang_musa", "decode_attention_backend=tilelang_musa")
    assert got[1:] == ["tilelang_musa", "tilelang_musa"]
