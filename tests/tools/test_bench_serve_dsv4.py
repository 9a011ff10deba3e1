"""``benchmarks/bench_serve_dsv4.py`` on the CPU: the V4-Flash-sized model it serves has V4-Flash's dimensions, the
warmup plans it like any V4 checkpoint (FP8 experts through our MoE kernels when ``MUSA_ATTN_MOE=on``), and its
cases run cheapest first within the prompt-token cap. The serving itself needs a GPU (issue 40)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serve_dsv4 as bench  # noqa: E402

from musa_attn_backend import warmup_dsv4  # noqa: E402


def test_the_model_has_v4_flashs_dimensions_and_fp8_checkpoint_format(tmp_path):
    assert bench.main(["--config-only", str(tmp_path), "--layers", "3"]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (4096, 64, 512)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (256, 6, 2048)
    assert (cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"], cfg["index_topk"]) == (1024, 1024, 8, 512)
    assert cfg["compress_ratios"] == [4, 128, 4]
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["expert_dtype"] == "fp8"
    assert "quantization_config" not in bench.flash_config(quant="none")
    model = warmup_dsv4.from_hf_config(cfg)
    assert (model.heads, model.hidden, model.experts, model.top_k, model.ratios) == (64, 4096, 256, 6, (4, 128))


def test_the_warmup_plans_its_moe_experts_when_they_are_ours():
    from musa_attn_backend import config

    model = warmup_dsv4.from_hf_config(bench.flash_config())
    with config.override(moe="on"):
        with_moe = warmup_dsv4.plan(model, engine="vllm", experts="fp8", target_kind="cuda")
    with config.override(moe="off"):
        without = warmup_dsv4.plan(model, engine="vllm", experts="fp8", target_kind="cuda")
    assert len(with_moe) > len(without) > 0


def test_cases_run_cheapest_first_within_the_cap():
    got = bench.cases([1, 8, 64], [4096, 32768], max_tokens=1 << 18)
    assert got == [(1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 4096)]
    assert all(b * c <= 1 << 18 for b, c in got)


@pytest.mark.parametrize("kw", [{"layers": 0}, {"ratios": (2,)}, {"quant": "fp4"}])
def test_refuses_what_it_cannot_build(kw):
    with pytest.raises(ValueError):
        bench.flash_config(**kw)
