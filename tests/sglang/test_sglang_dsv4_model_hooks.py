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
rope = factory.get_rope_cpu(64, 64, 4096, 10000, False, None, torch.bfloat16, 1.0, "cpu")
assert rope is not None
print("HOOKS OK")
"""


def test_v4_model_kernels_are_ours_on_a_cpu():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "integration_tests" / "sgl_kernel_shim"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "HOOKS OK" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
