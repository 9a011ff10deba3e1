"""vLLM's FP8 block-scaled and MXFP4 MoE layers built by vLLM's own constructors (``FusedMoEFactory`` with an
``Fp8Config`` of 128 x 128 blocks or an ``Mxfp4Config``, a tiny DeepSeek-V4-like layer: 4 experts, H 256, I 128,
top-2, SwiGLU clamp 10) on this package's
experts class (:mod:`musa_attn_backend.vllm.moe`), run in a fresh interpreter on the CPU: vLLM picks our class
under ``MUSA_ATTN_MOE=on``, its kernel (no-EP prepare/finalize + our experts) computes exactly what
``fused_experts_reference`` computes, through our op, for plain and expert-mapped routing; with the switch at
``auto`` on a CPU (off) vLLM's own selection answers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, sys, torch
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
import musa_attn_backend.vllm as plugin
plugin.register()
from musa_attn_backend.kernels import moe
from musa_attn_backend.testing import vllm_dsv4 as fx
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

fp4 = sys.argv[2] == "fp4"

calls = []
real = moe.fused_experts
def counted(*a, **k):
    calls.append(k.get("swiglu_limit"))
    return real(*a, **k)
moe.fused_experts = counted
report = {}
with set_current_vllm_config(VllmConfig()):
    fx.init_distributed()
    if sys.argv[3] == "v4":  # V4's own config; the expert dtype a Flash (fp4) or Flash-Base (fp8) config gives
        from vllm.models.deepseek_v4.quant_config import DeepseekV4FP8Config
        qc = DeepseekV4FP8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                                 weight_block_size=[128, 128])
        qc._resolved_expert_dtype = "fp4" if fp4 else "fp8"
    else:
        qc = Mxfp4Config() if fp4 else Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                                                 weight_block_size=[128, 128])
    report["quant_config"] = type(qc).__name__
    runner = FusedMoEFactory(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128,
                             params_dtype=torch.bfloat16, quant_config=qc, swiglu_limit=10.0,
                             prefix="model.layers.0.mlp.experts")
    qm = runner._quant_method
    report["experts_cls"] = getattr(qm.experts_cls, "__name__", str(qm.experts_cls))
    report["backend"] = str(qm.mxfp4_backend if fp4 else qm.fp8_backend)
    if report["experts_cls"] == "MusaBlockFp8Experts":
        g = torch.Generator().manual_seed(0)
        layer = runner.routed_experts
        quant = moe.quantize_fp4_reference if fp4 else moe.quantize_weight_blocks_reference
        w13, s13 = quant(torch.randn(4, 256, 256, generator=g) * 0.2)
        w2, s2 = quant(torch.randn(4, 256, 128, generator=g) * 0.2)
        scale_name = "weight_scale" if fp4 else "weight_scale_inv"
        for name, t in (("w13_weight", w13), ("w2_weight", w2), (f"w13_{scale_name}", s13),
                        (f"w2_{scale_name}", s2)):
            getattr(layer, name).data.copy_(t)
        qm.process_weights_after_loading(layer)
        x = torch.randn(37, 256, generator=g).to(torch.bfloat16)
        ids = torch.rand(37, 4, generator=g).topk(2, 1).indices.to(torch.int32)
        w = torch.rand(37, 2, generator=g)
        kernel = qm.moe_kernel
        report["prepare_finalize"] = type(kernel.prepare_finalize).__name__ if hasattr(kernel, "prepare_finalize") \
            else type(kernel.impl.prepare_finalize).__name__
        for mapped in (False, True):
            emap = torch.tensor([2, -1, 0, 1], dtype=torch.int32) if mapped else None  # global 1 not here
            got = kernel.apply(x, layer.w13_weight, layer.w2_weight, w, ids, activation=MoEActivation.SILU,
                               global_num_experts=4, expert_map=emap, apply_router_weight_on_input=False)
            want = moe.fused_experts_reference(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, swiglu_limit=10.0,
                                               expert_map=emap)
            report[f"max_diff_mapped_{mapped}"] = float((got.float() - want.float()).abs().max())
            report[f"max_abs_mapped_{mapped}"] = float(want.float().abs().max())
report["calls"] = calls
json.dump(report, open(sys.argv[1], "w"))
'''


def _run(tmp_path, moe_switch, fmt="fp8", config="generic"):
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MUSA_ATTN_MOE=moe_switch, VLLM_LOGGING_LEVEL="WARNING")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(out), fmt, config], capture_output=True, text=True, env=env,
                         timeout=900, cwd=ROOT)
    assert run.returncode == 0 and out.exists(), run.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("config", ["generic", "v4"])
@pytest.mark.parametrize("fmt,backend", [("fp8", "Fp8MoeBackend.TRITON"), ("fp4", "Mxfp4MoeBackend.EMULATION")])
def test_vllm_moe_layer_runs_on_our_op(tmp_path, fmt, backend, config):
    """FP8: ``Fp8MoEMethod`` through ``select_fp8_moe_backend``; FP4: ``Mxfp4MoEMethod`` (what V4's FP4 experts
    build) through ``select_deepseek_v4_mxfp4_moe_backend``, the packed weights kept as loaded. ``generic``:
    vLLM's ``Fp8Config`` / ``Mxfp4Config``; ``v4``: ``DeepseekV4FP8Config`` (``deepseek_v4_fp8``, what a V4
    checkpoint loads), which builds those methods by its expert dtype."""
    rep = _run(tmp_path, "on", fmt, config)
    assert rep["quant_config"] == ("DeepseekV4FP8Config" if config == "v4" else
                                   "Mxfp4Config" if fmt == "fp4" else "Fp8Config"), rep
    assert rep["experts_cls"] == "MusaBlockFp8Experts" and rep["backend"] == backend, rep
    assert rep["calls"] == [10.0, 10.0], rep  # both runs went through our op, with V4's clamp
    for mapped in (False, True):  # the same op on the same inputs: identical on the CPU
        assert rep[f"max_diff_mapped_{mapped}"] == 0.0 and rep[f"max_abs_mapped_{mapped}"] > 0.1, rep


def test_vllm_keeps_its_own_experts_when_the_switch_is_off(tmp_path):
    rep = _run(tmp_path, "auto")  # auto: MUSA only; this is a CPU
    assert rep["experts_cls"] != "MusaBlockFp8Experts" and rep["calls"] == [], rep


def test_moe_switch_values():
    from musa_attn_backend import config, platform

    for value, want in (("on", True), ("ON", True), ("off", False), ("auto", False)):  # auto: off on a CPU
        with config.override(moe=value):
            assert platform.moe_experts_enabled() is want, value
    with pytest.raises(config.SettingsError, match="use one of auto, on, off"):
        config.read_environment({"MUSA_ATTN_MOE": "maybe"})
    with pytest.raises(config.SettingsError, match="use one of auto, on, off"), config.override(moe="yes"):
        pass
