"""SGLang's FP8 block-scaled MoE experts on our op (``musa_attn_backend.sglang.moe``), on a CPU: the fused function
SGLang's ``MoeRunner`` binds for ``("none", "triton")`` is ours after ``install()``; a tiny DeepSeek-V4-like layer
run through a real ``MoeRunner`` (built as ``Fp8MoEMethod.create_moe_runner`` builds it) computes the op's
reference; every call it does not handle reaches SGLang's function with the same arguments. The ``deep_gemm``
runner core: registered (only with the switch on), a real ``MoeRunner("deep_gemm")`` with FP8 block-scaled and FP4
experts in SGLang's storage computes the op's reference, and what it does not run raises naming the case."""

import re

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.moe.moe_runner import runner as sglang_runner  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import FusedOpPool, MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoeQuantInfo, DeepGemmRunnerCore  # noqa: E402
from sglang.srt.layers.moe.moe_runner.runner import MoeRunner  # noqa: E402
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import MoeRunnerBackend  # noqa: E402

from musa_attn_backend.kernels import moe as ops  # noqa: E402
from musa_attn_backend.sglang import moe  # noqa: E402

E, H, I, K, T = 4, 256, 128, 2, 8  # local experts, hidden, intermediate, top-k, tokens


@pytest.fixture(autouse=True)
def runner_cores(monkeypatch):
    """SGLang's registry of custom runner cores, a copy for this test: install() registers ours into it while the
    switch is on, and the registration must not outlive the test."""
    cores = dict(sglang_runner._CUSTOM_RUNNER_CORE_FACTORIES)
    monkeypatch.setattr(sglang_runner, "_CUSTOM_RUNNER_CORE_FACTORIES", cores)
    return cores


def make_layer(**quant):
    """(runner config, quant info, dispatch output) of a tiny V4-like layer: FP8 block weights, top-2 routing
    (one choice of token 0 on another rank: -1), swiglu_limit 10, routed_scaling_factor 1.5."""
    g = torch.Generator().manual_seed(0)
    w13, s13 = ops.quantize_weight_blocks_reference(torch.randn(E, 2 * I, H, generator=g) / 16)
    w2, s2 = ops.quantize_weight_blocks_reference(torch.randn(E, H, I, generator=g) / 16)
    info = TritonMoeQuantInfo(w13_weight=w13, w2_weight=w2, use_fp8_w8a8=True, w13_scale=s13, w2_scale=s2,
                              block_shape=[128, 128], **quant)
    config = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                             top_k=K, num_fused_shared_experts=0, params_dtype=torch.bfloat16, activation="silu",
                             routed_scaling_factor=1.5, swiglu_limit=10.0)
    hidden = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[0, 1] = -1
    weights = torch.rand(T, K, generator=g)
    topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=torch.randn(T, E, generator=g))
    return config, info, StandardDispatchOutput(hidden_states=hidden, hidden_states_scale=None, topk_output=topk)


def test_install_replaces_the_triton_fused_function_once():
    moe.install()
    moe.install()
    assert FusedOpPool.get_fused_func("none", "triton") is moe.fused_experts_none_to_triton
    assert moe.original is not moe.fused_experts_none_to_triton
    assert moe.original.__module__ == "sglang.srt.layers.moe.moe_runner.triton"


@pytest.mark.parametrize("scale_in_experts", [True, False])  # CUDA/MUSA: the experts scale; a CPU: the model
def test_runner_runs_our_op(use_settings, monkeypatch, scale_in_experts):
    use_settings(moe="on")
    moe.install()
    monkeypatch.setattr(moe, "ROUTED_SCALE_IN_EXPERTS", scale_in_experts)
    calls = []
    real = ops.fused_experts
    monkeypatch.setattr(ops, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    config, info, dispatch = make_layer()
    runner = MoeRunner(MoeRunnerBackend.TRITON, config)  # as Fp8MoEMethod.create_moe_runner does for "triton"
    assert runner.fused_func is moe.fused_experts_none_to_triton
    hidden = dispatch.hidden_states.clone()
    out = runner.run(dispatch, info).hidden_states
    assert calls == [1]
    assert out is dispatch.hidden_states  # config.inplace: written into hidden_states, as SGLang's path does
    want = ops.fused_experts_reference(hidden, info.w13_weight, info.w2_weight, *dispatch.topk_output[:2],
                                       w13_scale=info.w13_scale, w2_scale=info.w2_scale, swiglu_limit=10.0)
    want = want.float() * (1.5 if scale_in_experts else 1.0)
    # the op's layouts batch the GEMMs differently from the per-expert reference and fold the 1.5 into the
    # weights, so a bf16 rounding step (2**-8 relative) may differ
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("switch, quant, cfg", [("off", {}, {}), ("on", {"use_fp8_w8a8": False}, {}),
                                                ("on", {"block_shape": [64, 64]}, {}),
                                                ("on", {"a13_scale": torch.ones(1)}, {}),
                                                ("on", {}, {"gemm1_beta": 1.0})])
def test_other_calls_reach_sglang(use_settings, monkeypatch, switch, quant, cfg):
    """Calls the op does not compute go to SGLang's function, among them the runner configs the deep_gemm core
    refuses (one list, ``unsupported_runner_config``)."""
    use_settings(moe=switch)
    moe.install()
    seen = []
    monkeypatch.setattr(moe, "original", lambda *args: seen.append(args) or "sglang")
    monkeypatch.setattr(ops, "fused_experts", lambda *a, **k: pytest.fail("our op ran"))
    config, info, dispatch = make_layer()
    for field, value in quant.items():
        setattr(info, field, value)
    for field, value in cfg.items():
        setattr(config, field, value)
    runner = MoeRunner(MoeRunnerBackend.TRITON, config)
    assert runner.run(dispatch, info) == "sglang"
    assert len(seen) == 1 and all(a is b for a, b in zip(seen[0], (dispatch, info, config)))


def make_deep_gemm_layer(fp4: bool):
    """(runner config, DeepGemmMoeQuantInfo, dispatch output) of :func:`make_layer`'s layer for ``deep_gemm``, as
    ``Fp8MoEMethod.apply`` builds the quant info: FP8 128 x 128 block weights, or FP4 experts in SGLang's storage
    (int8-packed E2M1, float32 power-of-two scales, as a UE8M0 checkpoint loads into them)."""
    config, info, dispatch = make_layer()
    if not fp4:
        return config, DeepGemmMoeQuantInfo(w13_weight=info.w13_weight, w2_weight=info.w2_weight, use_fp8=True,
                                            w13_scale=info.w13_scale, w2_scale=info.w2_scale,
                                            block_shape=[128, 128]), dispatch
    g = torch.Generator().manual_seed(1)
    w13, s13 = ops.quantize_fp4_reference(torch.randn(E, 2 * I, H, generator=g) / 16)
    w2, s2 = ops.quantize_fp4_reference(torch.randn(E, H, I, generator=g) / 16)
    sglang_scale = lambda s: s.view(torch.float8_e8m0fnu).float()  # noqa: E731
    return config, DeepGemmMoeQuantInfo(w13_weight=w13.view(torch.int8), w2_weight=w2.view(torch.int8),
                                        use_fp8=True, w13_scale=sglang_scale(s13), w2_scale=sglang_scale(s2),
                                        block_shape=[128, 128], is_fp4_experts=True), dispatch


def test_install_registers_the_deep_gemm_core_once(use_settings, runner_cores):
    use_settings(moe="on")
    moe.install()
    moe.install()
    assert runner_cores["deep_gemm"] is moe.create_deep_gemm_core


def test_deep_gemm_core_is_not_registered_with_the_switch_off(use_settings, runner_cores):
    use_settings(moe="off")
    moe.install()
    assert "deep_gemm" not in runner_cores
    config, _, _ = make_layer()
    assert type(MoeRunner(MoeRunnerBackend.DEEP_GEMM, config).runner_core) is DeepGemmRunnerCore
    # registered while on, then switched off: layers built from then on get SGLang's core
    use_settings(moe="on")
    moe.install()
    use_settings(moe="off")
    assert type(MoeRunner(MoeRunnerBackend.DEEP_GEMM, config).runner_core) is DeepGemmRunnerCore


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
@pytest.mark.parametrize("scale_in_experts", [True, False])
def test_deep_gemm_runner_runs_our_op(use_settings, monkeypatch, fp4, scale_in_experts):
    use_settings(moe="on")
    moe.install()
    monkeypatch.setattr(moe, "ROUTED_SCALE_IN_EXPERTS", scale_in_experts)
    calls = []
    real = ops.fused_experts
    monkeypatch.setattr(ops, "fused_experts", lambda *a, **k: calls.append(k) or real(*a, **k))
    config, info, dispatch = make_deep_gemm_layer(fp4)
    runner = MoeRunner(MoeRunnerBackend.DEEP_GEMM, config)  # as Fp8MoEMethod.create_moe_runner does
    assert isinstance(runner.runner_core, moe.DeepGemmCore) and runner.fused_func is None
    hidden = dispatch.hidden_states.clone()
    out = runner.run(dispatch, info).hidden_states
    out2 = runner.run(dispatch, info).hidden_states
    assert len(calls) == 2
    assert out is not dispatch.hidden_states and torch.equal(dispatch.hidden_states, hidden)  # input untouched
    w13, w2, s13, s2 = info.w13_weight, info.w2_weight, info.w13_scale, info.w2_scale
    if fp4:  # the op's storage: the same bytes (a view), SGLang's float32 scales themselves (no copy)
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
        assert calls[0]["w13_scale"] is s13 and calls[0]["w2_scale"] is s2
    # routed_scaling_factor 1.5, where the experts apply it, is folded into the router weights
    weights, ids = dispatch.topk_output.topk_weights, dispatch.topk_output.topk_ids
    weights = weights.float() * 1.5 if scale_in_experts else weights
    want = ops.fused_experts_reference(hidden, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, swiglu_limit=10.0)
    # exact: on a CPU the op runs the float32 reference GEMMs, summing each token's choices in the same order
    assert torch.equal(out, want) and torch.equal(out2, want)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_fp8_moe_method_apply_reaches_our_core(use_settings, monkeypatch, fp4):
    """``Fp8MoEMethod.apply``'s deep_gemm branch builds the quant info from the layer's parameters (here set by
    hand, as loading leaves them: no DeepGEMM, so no UE8M0 requantisation) and runs it on our core."""
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    use_settings(moe="on")
    moe.install()
    monkeypatch.setattr(moe, "ROUTED_SCALE_IN_EXPERTS", False)  # the model applies the 1.5 (a CPU's way)
    config, info, dispatch = make_deep_gemm_layer(fp4)
    method = Fp8MoEMethod.__new__(Fp8MoEMethod)  # only what apply reads; __init__ needs a full Fp8Config
    method.quant_config = type("Config", (), {"weight_block_size": [128, 128]})()
    method.block_quant, method.is_fp4_expert, method.use_mxfp8 = True, fp4, False
    method.moe_runner_config, method.runner = config, MoeRunner(MoeRunnerBackend.DEEP_GEMM, config)
    layer = torch.nn.Module()
    for name, t in (("w13_weight", info.w13_weight), ("w2_weight", info.w2_weight),
                    ("w13_weight_scale_inv", info.w13_scale), ("w2_weight_scale_inv", info.w2_scale)):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    w13, s13, w2, s2 = method.runner.runner_core.expert_weights(info)
    want = ops.fused_experts_reference(dispatch.hidden_states, w13, w2, *dispatch.topk_output[:2], w13_scale=s13,
                                       w2_scale=s2, swiglu_limit=10.0)
    assert torch.equal(method.apply(layer, dispatch).hidden_states, want)


@pytest.mark.parametrize("where, change, message", [
    ("config", {"activation": "gelu"}, "activation 'gelu'"),
    ("config", {"gemm1_alpha": 1.702}, "gemm1_alpha"),
    ("config", {"no_combine": True}, "no_combine"),
    ("quant", {"use_mxfp8": True}, "MXFP8"),
    ("quant", {"block_shape": [64, 64]}, "block_shape [64, 64]"),
    ("quant", {"w13_weight": torch.zeros(E, 2 * I, H, dtype=torch.bfloat16)}, "dtype torch.bfloat16"),
    ("quant", {"w13_scale": torch.zeros(E, 2 * I // 128, H // 128, dtype=torch.int32)}, "dtype torch.int32"),
    ("fp4", {"w13_scale": torch.zeros(E, 2 * I, H // 32, dtype=torch.int32)}, "packed layout"),
])
def test_deep_gemm_core_raises_on_what_it_does_not_run(use_settings, monkeypatch, where, change, message):
    use_settings(moe="on")
    moe.install()
    monkeypatch.setattr(ops, "fused_experts", lambda *a, **k: pytest.fail("our op ran"))
    config, info, dispatch = make_deep_gemm_layer(fp4=where == "fp4")
    for field, value in change.items():
        setattr(config if where == "config" else info, field, value)
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        MoeRunner(MoeRunnerBackend.DEEP_GEMM, config).run(dispatch, info)


def test_deep_gemm_config_it_does_not_run_goes_to_sglangs_core_where_deep_gemm_runs(use_settings, monkeypatch):
    use_settings(moe="on")
    moe.install()
    monkeypatch.setattr(moe, "_sglang_deep_gemm_usable", lambda: True)
    config, _, _ = make_layer()
    config.activation, config.gemm1_alpha, config.gemm1_clamp_limit = "situ", 1.0, 1.0  # Kimi K3's activation
    assert type(MoeRunner(MoeRunnerBackend.DEEP_GEMM, config).runner_core) is DeepGemmRunnerCore


def test_fp4_scales_are_sglangs_tensors_without_a_copy():
    """float32 (SGLang's storage) as it is; ``float8_e8m0fnu`` as its bytes, the same storage; uint8 as it is;
    int32 (DeepGEMM's packed layout) and non-contiguous tensors refused naming the scale."""
    codes = torch.tensor([[[0, 1, 100, 127, 200, 254]]], dtype=torch.uint8)
    f32 = codes.view(torch.float8_e8m0fnu).float()
    assert moe.fp4_scales(f32, "s") is f32 and moe.fp4_scales(codes, "s") is codes
    e8 = codes.view(torch.float8_e8m0fnu)
    assert torch.equal(moe.fp4_scales(e8, "s"), codes) and moe.fp4_scales(e8, "s").data_ptr() == e8.data_ptr()
    with pytest.raises(NotImplementedError, match="scales s of dtype torch.int32"):
        moe.fp4_scales(torch.zeros(1, 2, 3, dtype=torch.int32), "s")
    with pytest.raises(NotImplementedError, match="non-contiguous FP4 expert scales s"):
        moe.fp4_scales(torch.zeros(1, 4, 3).transpose(1, 2), "s")
