"""SGLang's FP8 block-scaled MoE experts on our op (``musa_attn_backend.sglang.moe``), on a CPU: the fused function
SGLang's ``MoeRunner`` binds for ``("none", "triton")`` is ours after ``install()``; a tiny DeepSeek-V4-like layer
run through a real ``MoeRunner`` (built as ``Fp8MoEMethod.create_moe_runner`` builds it) computes the op's
reference; every call it does not handle reaches SGLang's function with the same arguments."""

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.moe.moe_runner.base import FusedOpPool, MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.moe_runner.runner import MoeRunner  # noqa: E402
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import MoeRunnerBackend  # noqa: E402

from musa_attn_backend.kernels import moe as ops  # noqa: E402
from musa_attn_backend.sglang import moe  # noqa: E402

E, H, I, K, T = 4, 256, 128, 2, 8  # local experts, hidden, intermediate, top-k, tokens


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


@pytest.mark.parametrize("switch, quant", [("off", {}), ("on", {"use_fp8_w8a8": False}),
                                           ("on", {"block_shape": [64, 64]}),
                                           ("on", {"a13_scale": torch.ones(1)})])
def test_other_calls_reach_sglang(use_settings, monkeypatch, switch, quant):
    use_settings(moe=switch)
    moe.install()
    seen = []
    monkeypatch.setattr(moe, "original", lambda *args: seen.append(args) or "sglang")
    monkeypatch.setattr(ops, "fused_experts", lambda *a, **k: pytest.fail("our op ran"))
    config, info, dispatch = make_layer()
    for field, value in quant.items():
        setattr(info, field, value)
    runner = MoeRunner(MoeRunnerBackend.TRITON, config)
    assert runner.run(dispatch, info) == "sglang"
    assert len(seen) == 1 and all(a is b for a, b in zip(seen[0], (dispatch, info, config)))
