"""DeepSeek-V4's model-side kernels in SGLang on a CPU: after SGLang loads our plugin, the names its V4 model
calls (imported by name into ``models/deepseek_v4.py`` and the shared expert's module) are this package's ops, and
compute what they compute; the CPU RoPE factory builds the plain RoPE of V4's uncompressed layers instead of
asserting. In a fresh interpreter, as SGLang's processes load plugins."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.models.deepseek_v4 as model
import sglang.srt.models.deepseek_v2 as v2
from sglang.srt.layers.rotary_embedding import factory
from musa_attn_backend.kernels.dsv4 import model as ops

g = torch.Generator().manual_seed(0)
ang = torch.rand(20, 32, generator=g)
freqs = torch.polar(torch.ones(20, 32), ang)
q = torch.randn(3, 4, 512, generator=g).to(torch.bfloat16)
pos = torch.tensor([0, 7, 19])
out = torch.empty_like(q)
model.fused_q_norm_rope(q, out, 1e-6, freqs, pos)
assert torch.equal(out, ops.q_norm_rope(q, 1e-6, ang.cos(), ang.sin(), pos)), "q norm + rope"
o = q.clone()
model.fused_rope_inplace(o[..., -64:], None, freqs, pos, inverse=True)
want = q.clone()
ops.rope_(want[..., -64:], ang.cos(), ang.sin(), pos, True)
assert torch.equal(o, want), "inverse rope"
x = torch.randn(5, 64, generator=g).to(torch.bfloat16) * 20
y = torch.empty(5, 32, dtype=torch.bfloat16)
v2.silu_and_mul_clamp(x, y, 10.0)
assert torch.equal(y, ops.silu_and_mul_clamp(x, 10.0)), "clamped swiglu"
from sglang.kernels.ops.layernorm import mhc, mhc_head
R = torch.randn(5, 4, 64, generator=g).to(torch.bfloat16)
fn = torch.randn(24, 256, generator=g) * 0.05
sc, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.1
ours = mhc.mhc_pre(R, fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
theirs = mhc._mhc_pre_torch(R, fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0, 20)  # SGLang's own torch mHC pre
assert all(torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-6) for a, b in zip(ours, theirs)), "mhc pre"
head = mhc_head.fused_hc_head(R, fn[:4], sc[:1], base[:4], 1e-6, 1e-6)
assert torch.allclose(head.float(), model.hc_head_torch(R, fn[:4], sc[:1], base[:4], norm_eps=1e-6,
                                                        hc_eps=1e-6).float(), rtol=1e-6, atol=1e-6), "hc head"
streams, post, comb, y = mhc.mhc_fused_post_pre(q[:, 0, :64].contiguous()[:3].repeat(2, 1)[:5], R, ours[0], ours[1],
                                                fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
assert streams.shape == R.shape and y.shape == (5, 64), "fused post + pre"
rope = factory.get_rope_cpu(64, 64, 4096, 10000, False, None, torch.bfloat16, 1.0, "cpu")
assert rope is not None
# speculative decoding's allocation: the last KV location per request, in torch for our backend off CUDA
from sglang.srt.mem_cache import allocation
import sglang.srt.runtime_context as rc
r2t = torch.randint(0, 1000, (4, 50), dtype=torch.int32, generator=g)
idx, lens = torch.tensor([2, 0, 3]), torch.tensor([5, 0, 50])
real = rc.attention_backends
rc.attention_backends = lambda: ("tilelang_musa", "tilelang_musa")
try:
    assert torch.equal(allocation.get_last_loc(r2t, idx, lens), allocation.get_last_loc_torch(r2t, idx, lens))
finally:
    rc.attention_backends = real
# the MTP draft shares the target's embedding and head: swapped without a device synchronisation
m = torch.nn.Module(); m.model = torch.nn.Module()
m.model.embed_tokens, m.lm_head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
e, h = torch.nn.Parameter(torch.ones(8, 4)), torch.nn.Parameter(torch.zeros(8, 4))
model.DeepseekV4ForCausalLM.set_embed_and_head(m, e, h)
assert m.model.embed_tokens.weight is e and m.lm_head.weight is h
print("HOOKS OK")
"""


def test_v4_model_kernels_are_ours_on_a_cpu():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "integration_tests" / "sgl_kernel_shim"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "HOOKS OK" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])


OFF_CHECK = """
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.models.deepseek_v2 as v2
from musa_attn_backend.kernels.dsv4 import model as ops
x = torch.randn(5, 64).to(torch.bfloat16) * 20
y = torch.full((5, 32), float("nan"), dtype=torch.bfloat16)
try:
    v2.silu_and_mul_clamp(x, y, 10.0)  # SGLang's own is a JIT CUDA kernel: it cannot run on a CPU
except Exception as e:
    print("RAISED", type(e).__name__)
print("OURS", torch.equal(y, ops.silu_and_mul_clamp(x, 10.0)))
"""


@pytest.mark.parametrize("value", ["off", "on"])
def test_the_switch_decides_whose_model_kernels_run(value):
    """``MUSA_ATTN_MODEL_KERNELS=off``: SGLang's V4 model keeps its own functions (on a CPU, SGLang's JIT CUDA
    kernels, which fail there); ``on`` installs ours as ``auto`` does on a CPU (on CUDA it is what makes the MUSA
    situation there)."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", MUSA_ATTN_MODEL_KERNELS=value,
               PYTHONPATH=os.pathsep.join([str(ROOT / "integration_tests" / "sgl_kernel_shim"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", OFF_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    if value == "off":
        assert "RAISED" in out.stdout and "OURS False" in out.stdout, out.stdout
    else:
        assert "RAISED" not in out.stdout and "OURS True" in out.stdout, out.stdout


def test_unquantised_v4_experts_take_the_routed_scale_where_sglangs_model_leaves_it_to_them():
    """SGLang's ``DeepseekV2MoE`` multiplies the experts' output by ``routed_scaling_factor`` only off CUDA, MUSA
    and XPU (there its own experts scale in their top-k sum): our replacement of the unquantised experts' forward
    scales exactly where the model does not, so the factor is applied once on every device."""
    import torch
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    from musa_attn_backend.sglang import model_hooks

    g = torch.Generator().manual_seed(3)
    E, HID, I, K, T = 4, 128, 64, 2, 5
    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    method.moe_runner_config = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=HID,
                                               intermediate_size_per_partition=I, top_k=K, num_fused_shared_experts=0,
                                               params_dtype=torch.bfloat16, activation="silu", swiglu_limit=10.0,
                                               routed_scaling_factor=1.5)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter((torch.randn(E, 2 * I, HID, generator=g) * 0.1).bfloat16(), False)
    layer.w2_weight = torch.nn.Parameter((torch.randn(E, HID, I, generator=g) * 0.1).bfloat16(), False)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(torch.int32)
    d = StandardDispatchOutput(hidden_states=torch.randn(T, HID, generator=g).bfloat16(), hidden_states_scale=None,
                               topk_output=StandardTopKOutput(topk_weights=torch.rand(T, K, generator=g), topk_ids=ids,
                                                              router_logits=torch.zeros(T, E)))
    unscaled = model_hooks._experts(None, False)(method, layer, d).hidden_states.float()
    scaled = model_hooks._experts(None, True)(method, layer, d).hidden_states.float()
    assert unscaled.abs().max() > 0.1
    torch.testing.assert_close(scaled, unscaled * 1.5, rtol=1e-2, atol=1e-2)  # bf16 outputs, one rounding each
