"""``musa-attn warmup`` for DeepSeek-V4 models (``musa_attn_backend.warmup_dsv4``): the plan of the tiny V4 and of
V4-Flash / V4-Pro-sized configs (config files only) for both engines, what it holds per engine, target, tensor
parallel size and expert format, the refusals, and the CLI. That the plan is complete (every kernel the engines'
V4 paths ask for) is tested against the engines' own cases: ``tests/sglang/test_sglang_dsv4_warmup_plan.py``,
``tests/vllm/test_vllm_dsv4_layer.py``; on the H200, ``tests/dsv4/test_gpu_dsv4_warmup.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musa_attn_backend import _tilelang, config, warmup, warmup_dsv4 as wd
from musa_attn_backend.testing.dsv4_configs import FLASH, PRO

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integration_tests"))
from tiny_dsv4 import CONFIG as TINY  # noqa: E402


def kinds(jobs) -> dict:
    out: dict = {}
    for j in jobs:
        out.setdefault(j.kind, []).append(j)
    return out


def test_v4_configs_are_recognised_and_read():
    assert wd.is_v4(TINY) and wd.is_v4(FLASH) and not wd.is_v4({"model_type": "llama"})
    m = wd.from_hf_config(FLASH, tp=8)
    assert (m.heads, m.local_heads, m.ratios, m.window, m.index_heads, m.index_topk) == (64, 8, (0, 4, 128), 128, 64,
                                                                                         512)
    assert (m.hidden, m.experts, m.top_k, m.moe_intermediate, m.swiglu_limit) == (4096, 256, 6, 2048, 10.0)
    assert wd.from_hf_config(PRO).index_topk == 1024 and wd.from_hf_config(TINY).ratios == (0, 4, 128)


@pytest.mark.parametrize("cfg,what,match", [
    (dict(TINY, compress_ratios=[0, 1, 2]), {}, r"compress ratios \[1, 2\] are not supported"),
    (dict(TINY, head_dim=256), {}, r"heads of 512 dims"),
    (TINY, {"tp": 3}, r"not divisible by tp=3"),
    ({"model_type": "llama"}, {}, r"not a DeepSeek-V4 config"),
])
def test_configs_the_kernels_do_not_take_are_refused_by_name(cfg, what, match):
    with pytest.raises(ValueError, match=match):
        wd.from_hf_config(cfg, **what)


def test_plan_refuses_settings_v4_does_not_serve():
    m = wd.from_hf_config(TINY)
    with pytest.raises(ValueError, match=r"caches are FP8 .* got 'bf16'"):
        wd.plan(m, kv_dtype="bf16")
    with pytest.raises(ValueError, match=r"experts must be one of \('fp8', 'fp4'\)"):
        wd.plan(m, experts="int4")
    with pytest.raises(ValueError, match="engine must be one of"):
        wd.plan(m, engine="trt")


@pytest.mark.parametrize("engine", wd.ENGINES)
def test_flash_plan_holds_every_v4_family(engine, use_settings):
    """V4-Flash on MUSA with our MoE: attention for window-only and compressed layers, split and not, with the
    combine; writers; compressors of both ratios and the indexer's; the indexer; the engine's own layer kernels;
    the MoE glue and GEMMs of both layouts."""
    use_settings(target="mp_31", moe="auto")
    jobs = kinds(wd.plan(wd.from_hf_config(FLASH, tp=8), engine=engine))
    sparse = {j.args[:4] for j in jobs["dsv4_sparse_mqa"]}
    H = 64 if engine == "sglang" else 8  # SGLang pads a rank's 8 heads to FlashMLA's 64; vLLM does not
    assert sparse == {(H, False, True, False), (H, False, True, True), (H, True, True, False), (H, True, True, True)}
    assert {j.args[1] for j in jobs["dsv4_compress_rows"]} == {4, 128}
    assert len(jobs["dsv4_paged_indexer_logits"]) == 1 and jobs["dsv4_indexer_topk"][0].args[0] == 512
    assert {"moe_fp8_masked", "moe_fp8_contiguous", "moe_quantize_scatter", "moe_swiglu_quant",
            "moe_combine"} <= set(jobs)
    assert {j.args for j in jobs["moe_fp8_masked"]} == {(4096, 4096), (4096, 2048)}
    if engine == "vllm":
        assert {j.args[1] for j in jobs["dsv4_attention_slots"]} == {1, 4, 128}
    else:  # SGLang's model-side kernels on MUSA (model_hooks): mHC, clamped SwiGLU, RoPE
        assert {"dsv4_mhc_pre", "dsv4_mhc_post", "dsv4_silu_mul_clamp"} <= set(jobs)


def test_what_depends_on_target_and_settings(use_settings):
    """On CUDA: no MoE (MUSA_ATTN_MOE=auto) and none of SGLang's model-side hooks (SGLang's own kernels run
    there), the K store's norm + RoPE kept (our backend's); MUSA_ATTN_MODEL_KERNELS=on brings the hooks' kernels,
    =off takes them away on MUSA; MUSA_ATTN_MOE=on brings the MoE back; FP4 experts
    plan the FP4 programs (masked, contiguous in both packings `auto` chooses between, both scale dtypes)."""
    m = wd.from_hf_config(FLASH, tp=8)
    use_settings(target="sm_90a", moe="auto")
    cuda = kinds(wd.plan(m, engine="sglang"))
    assert not any(k.startswith("moe_") for k in cuda) and "dsv4_mhc_pre" not in cuda
    assert [j.args for j in cuda["dsv4_norm_rope"]] == [(512, 1, "bfloat16", "bfloat16", "weight", False, False)]
    use_settings(model_kernels="on")  # the MUSA situation on CUDA: SGLang's V4 model takes our model-side kernels
    hooked = kinds(wd.plan(m, engine="sglang"))
    assert {"dsv4_mhc_pre", "dsv4_mhc_post", "dsv4_silu_mul_clamp"} <= set(hooked)
    use_settings(target="mp_31", model_kernels="off")
    assert "dsv4_mhc_pre" not in kinds(wd.plan(m, engine="sglang"))
    use_settings(target="sm_90a", moe="on", model_kernels="auto")
    fp4 = kinds(wd.plan(m, engine="vllm", experts="fp4"))
    assert "moe_fp8_masked" not in fp4 and len(fp4["moe_fp4_masked"]) == 4
    assert {dict(j.kwargs)["packing"] for j in fp4["moe_fp4_contiguous"]} == {"fp8", "words"}


def test_scheduled_program_plans_its_kernels_and_the_keys_its_launch_asks_for(use_settings):
    """MUSA_ATTN_DSV4_PROGRAM=scheduled on CUDA: one program a kind of layer (split or not) and its combine,
    built under the compile keys the launcher's glue asks for."""
    use_settings(target="sm_90a", dsv4_program="scheduled")
    jobs = kinds(wd.plan(wd.from_hf_config(FLASH, tp=8), engine="vllm"))
    assert {j.args[:2] for j in jobs["dsv4_sparse_mqa"]} == {(8, False), (8, True)}
    assert "dsv4_combine" not in jobs and [j.args for j in jobs["dsv4_sparse_combine"]] == [(8, True, "bfloat16")]
    keys = []
    with _tilelang.intercepting(lambda k, b, t, p: keys.append(k)):
        for job in jobs["dsv4_sparse_mqa"] + jobs["dsv4_sparse_combine"]:
            warmup._build(job)
    assert set(keys) == {("dsv4_sparse_mqa_sched", 8, False, True, "bfloat16"),
                         ("dsv4_sparse_mqa_sched", 8, True, True, "bfloat16"),
                         ("dsv4_sparse_combine", 8, True, "bfloat16")}


def test_paired_ws_program_plans_its_program_and_its_gather(use_settings):
    """MUSA_ATTN_DSV4_PROGRAM=paired_ws on CUDA: one program a head count (with or without an extra set: the
    workspace holds both) and the gather of the workspace's rows, under the keys the launch asks for (the first
    prefill would otherwise compile them)."""
    use_settings(target="sm_90a", dsv4_program="paired_ws")
    jobs = kinds(wd.plan(wd.from_hf_config(FLASH, tp=8), engine="vllm"))
    assert "dsv4_sparse_combine" not in jobs and "dsv4_combine" not in jobs
    keys = []
    with _tilelang.intercepting(lambda k, b, t, p: keys.append(k)):
        for job in jobs["dsv4_sparse_mqa"] + jobs["dsv4_workspace_rows"]:
            warmup._build(job)
    default_build = ("pipelined", "hint", "smem_out", "qasync", "rowcopy", "groupcopy")  # paired_ws_kernel's switches on by default
    assert set(keys) == {("dsv4_sparse_mqa_paired_ws", 8, True, "bfloat16") + default_build,
                         ("dsv4_workspace_rows", True)}


def test_scheduled_program_plans_both_forms_for_128_heads(use_settings):
    """65-128 heads a rank on CUDA: the clustered form (calls of SCHED_CLUSTER_MIN_TOKENS tokens and more) and the
    unclustered one (fewer), each under the key its launch asks for."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    use_settings(target="sm_90a", dsv4_program="scheduled")
    jobs = kinds(wd.plan(wd.from_hf_config(PRO, tp=1), engine="vllm"))
    assert {j.args[0] for j in jobs["dsv4_sparse_mqa"]} == {128}
    assert {(j.args[:2], j.kwargs) for j in jobs["dsv4_sched"]} == {((128, False), (("cluster", False),)),
                                                                      ((128, True), (("cluster", False),))}
    keys = []
    with _tilelang.intercepting(lambda k, b, t, p: keys.append(k)):
        for job in jobs["dsv4_sparse_mqa"] + jobs["dsv4_sched"]:
            warmup._build(job)
    assert set(keys) == {("dsv4_sparse_mqa_sched", 128, extra, True, "bfloat16") + form
                         for extra in (False, True) for form in ((), ("cluster",))}
    assert ti._sched_cluster(128, None, ti.SCHED_CLUSTER_MIN_TOKENS)  # what the launches ask for, by tokens
    assert not ti._sched_cluster(128, None, 1)


def test_plans_build_for_both_targets_and_keep_musas_rules():
    """Every job of the tiny V4's and V4-Pro's plans builds (the launchers' getters accept its arguments) for
    sm_90a and mp_31, and on mp_31 keeps every rule of MUSA's lowering."""
    from musa_attn_backend.kernels._tir import violations
    from musa_attn_backend import platform

    for target in ("sm_90a", "mp_31"):
        funcs = {}
        with config.override(target=target, moe="on"), _tilelang.intercepting(
                lambda k, b, t, p: funcs.setdefault(repr(k), b())):
            flags = platform.features_of(None)
            for cfg in (TINY, PRO):
                for engine in wd.ENGINES:
                    jobs = wd.plan(wd.from_hf_config(cfg), engine=engine, speculative_tokens=1)
                    for job in jobs:
                        warmup._build(job)
        assert len(funcs) >= 40
        if target == "mp_31":
            assert not [(k, violations(f, flags)) for k, f in funcs.items() if violations(f, flags)]


def _cli(tmp_path, cfg, *args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "MUSA_ATTN_CACHE_DIR": str(tmp_path / "cache"), "MUSA_ATTN_MOE": "auto"}
    return subprocess.run([sys.executable, "-m", "musa_attn_backend.cli", "warmup", "--model-config", str(path),
                           "--quiet", "-j", "2", *args], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.parametrize("engine", wd.ENGINES)
def test_cli_checks_a_flash_sized_v4_for_mp31(tmp_path, engine):
    """``musa-attn warmup --model-config <V4-Flash config> --target mp_31 --lower-only``: the V4 plan (not a dense
    model of head dim 512), every kernel checked against MUSA's rules; with FP4 experts, their programs."""
    res = _cli(tmp_path, FLASH, "--engine", engine, "--tp", "8", "--target", "mp_31", "--lower-only",
               "--experts", "fp4", "--out", str(tmp_path / "src"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "V4Model(" in res.stdout and "passed the target's rules" in res.stdout
    index = json.loads((tmp_path / "src" / "index.json").read_text())
    got = {k["kind"] for k in index["kernels"]}
    assert {"dsv4_sparse_mqa", "dsv4_indexer_q", "dsv4_compress_rows", "moe_fp4_masked"} <= got
    assert all(k.get("checked_only") for k in index["kernels"])


def test_cli_refuses_a_v4_setting_with_its_reason(tmp_path):
    res = _cli(tmp_path, TINY, "--target", "mp_31", "--lower-only", "--kv-cache-dtype", "auto",
               "--engine", "sglang")
    assert res.returncode == 0, res.stderr[-2000:]
    res = _cli(tmp_path, dict(TINY, compress_ratios=[1, 2]), "--target", "mp_31", "--lower-only")
    assert res.returncode == 2 and "compress ratios [1, 2] are not supported" in res.stderr
    res = _cli(tmp_path, TINY, "--target", "mp_31", "--lower-only", "--kv-cache-dtype", "fp8")
    assert res.returncode == 0 and "V4Model(" in res.stdout, res.stderr[-2000:]


def test_tune_refuses_a_v4_config(tmp_path, capsys, use_settings, monkeypatch):
    """``musa-attn tune`` picks dense prefill tilings; a V4 config gets a message, not a dense plan."""
    from musa_attn_backend import cli, platform

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    monkeypatch.setattr(platform, "get_platform", lambda: platform.Platform(kind="cuda", target_kind="cuda",
                                                                            arch="sm_90a"))
    assert cli.main(["tune", "--model-config", str(path)]) == 2
    assert "DeepSeek-V4's kernels have no tuning table" in capsys.readouterr().err
