"""The vLLM GPU harness (``integration_tests/vllm_gpu_harness/sitecustomize.py``, issue 40's MUSA situation on a
CUDA GPU): its torch forms of vLLM's compiled ops, checked on the CPU against plain formulas before a GPU run
depends on them, in a fresh interpreter (the harness registers ops in torch's ``_C`` and ``_moe_C`` namespaces,
which must stay out of this process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "integration_tests" / "vllm_gpu_harness"

CHECK = r"""
import sitecustomize, torch
assert sitecustomize.MUSA_VLLM_HARNESS
g = torch.Generator().manual_seed(0)
ops, moe = torch.ops._C, torch.ops._moe_C
assert ops.cutlass_scaled_mm_supports_block_fp8(90) is False

x = torch.randn(5, 64, generator=g).bfloat16(); w = torch.rand(64, generator=g).bfloat16() + 0.5
out = torch.empty_like(x); ops.rms_norm(out, x, w, 1e-6)
want = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6) * w.float()
torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
res = torch.randn(5, 64, generator=g).bfloat16(); x2, r2 = x.clone(), res.clone()
ops.fused_add_rms_norm(x2, r2, w, 1e-6)
s = (x.float() + res.float()).bfloat16()
assert torch.equal(r2, s)
torch.testing.assert_close(x2.float(), (s.float() * torch.rsqrt(s.float().square().mean(-1, keepdim=True) + 1e-6)
                                         * w.float()), rtol=1e-2, atol=1e-2)

h = torch.randn(4, 32, generator=g).bfloat16() * 20
y = torch.empty(4, 16, dtype=torch.bfloat16); ops.silu_and_mul_with_clamp(y, h, 10.0)
gate, up = h[:, :16].float().clamp(max=10), h[:, 16:].float().clamp(-10, 10)
torch.testing.assert_close(y.float(), gate * torch.sigmoid(gate) * up, rtol=1e-2, atol=1e-2)

# moe_align_block_size: every (token, choice) of an expert in that expert's padded blocks, in order; pads = numel
T, K, E, B = 7, 2, 4, 4
ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32); ids[0, 1] = -1
cap = T * K + E * (B - 1)
sorted_ids = torch.empty(cap, dtype=torch.int32); expert_ids = torch.empty(cap // B, dtype=torch.int32)
ntpp = torch.empty(1, dtype=torch.int32)
moe.moe_align_block_size(ids, E, B, sorted_ids, expert_ids, ntpp, None)
n = int(ntpp)
assert n % B == 0 and n <= cap
flat = ids.flatten().tolist()
for blk in range(n // B):
    e = int(expert_ids[blk])
    for s_ in sorted_ids[blk * B:(blk + 1) * B].tolist():
        assert s_ == T * K or flat[s_] == e, (blk, e, s_)
got = sorted(s_ for s_ in sorted_ids[:n].tolist() if s_ != T * K)
assert got == [i for i, e in enumerate(flat) if 0 <= e < E], got

inp = torch.randn(3, 2, 8, generator=g); o = torch.empty(3, 8); moe.moe_sum(inp, o)
torch.testing.assert_close(o, inp.sum(1))

# the V4 router: sqrt(softplus) scores, top-k on the biased scores, the unbiased scores renormalised and scaled
logits = torch.randn(3, 8, generator=g); bias = torch.randn(8, generator=g)
tw, ti, te = torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int32), torch.empty(3, 2, dtype=torch.int32)
moe.topk_softplus_sqrt(tw, ti, te, logits, True, 1.5, bias, None, None, None)
sc = torch.nn.functional.softplus(logits).sqrt()
want_i = torch.topk(sc + bias, 2, dim=-1).indices
assert torch.equal(ti.long(), want_i)
ww = sc.gather(1, want_i); ww = ww / ww.sum(-1, keepdim=True) * 1.5
torch.testing.assert_close(tw, ww)

import vllm.vllm_flash_attn as fa  # imports without the flash-attention extensions
assert callable(fa.flash_attn_varlen_func) and fa.FA3_AVAILABLE in (True, False)
print("HARNESS OK")
"""


# What an FP8 block-scaled V4 (benchmarks/bench_serve_dsv4.py) adds: the 1 x 128 activation quantisation of every FP8
# linear, DeepGEMM's mHC pre-norm GEMM, vLLM's FP8 Marlin linear kernel taken off its list
CHECK_FP8 = r"""
import math, os, sitecustomize, torch
g = torch.Generator().manual_seed(1)
ops = torch.ops._C
FMAX = 448.0


def reference(x, gs, eps, ue8m0):
    # per group, one value at a time: the scale from the group's largest magnitude (NaN skipped), the codes clamped
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    q, s = [], []
    for row in rows:
        qr, sr = [], []
        for j in range(0, len(row), gs):
            grp = row[j:j + gs]
            amax = max([eps] + [abs(v) for v in grp if v == v])
            sc = torch.tensor(amax, dtype=torch.float32) / FMAX  # float32 division, as the kernel's
            if ue8m0:
                sc = torch.tensor(2.0 ** math.ceil(math.log2(max(float(sc), 1e-10))), dtype=torch.float32)
            for v in grp:
                y = torch.tensor(v, dtype=torch.float32) / sc
                y = -FMAX if y != y else min(max(float(y), -FMAX), FMAX)
                qr.append(y)
            sr.append(float(sc))
        q.append(qr)
        s.append(sr)
    q = torch.tensor(q, dtype=torch.float32).to(torch.float8_e4m3fn).view(x.shape)
    return q, torch.tensor(s, dtype=torch.float32)


T, K, GS = 6, 512, 128
x = (torch.randn(T, K, generator=g) * torch.logspace(-3, 2, T)[:, None]).bfloat16()
x[1, 5] = float("nan")          # ignored by the group's max; its code is fp8_min (fmax/fmin of NaN)
x[2, 130:258] = 0               # a group of zeros: scale eps / 448
x[3, 0] = 3e5                   # one large value: the others of its group round to small codes
for ue8m0 in (False, True):
    q = torch.empty(T, K, dtype=torch.float8_e4m3fn); s = torch.empty(T, K // GS)
    ops.per_token_group_fp8_quant(x, q, s, GS, 1e-10, -FMAX, FMAX, ue8m0, False, False)
    want_q, want_s = reference(x, GS, 1e-10, ue8m0)
    assert torch.equal(s, want_s), (ue8m0, s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), ue8m0
    if ue8m0:
        assert bool(((s.log2() == s.log2().round()) & (s >= want_s)).all())
# column-major and TMA-aligned scale layouts: the same values, written through the strides
sc = torch.empty(K // GS, T).t(); q = torch.empty(T, K, dtype=torch.float8_e4m3fn)
ops.per_token_group_fp8_quant(x, q, sc, GS, 1e-10, -FMAX, FMAX, False, True, False)
assert sc.stride() == (1, T) and torch.equal(sc, reference(x, GS, 1e-10, False)[1])
st = torch.empty_strided((T, K // GS), (1, 8)).fill_(-1.0)
ops.per_token_group_fp8_quant(x, q, st, GS, 1e-10, -FMAX, FMAX, False, True, True)
assert torch.equal(st, reference(x, GS, 1e-10, False)[1])
# vLLM's own caller (QuantFP8.forward_cuda -> per_token_group_quant_fp8) gets the same codes as its native form
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
y = torch.randn(4, 256, generator=g).bfloat16()
qy = torch.empty(4, 256, dtype=torch.float8_e4m3fn); sy = torch.empty(4, 2)
ops.per_token_group_fp8_quant(y, qy, sy, 128, 1e-10, -FMAX, FMAX, False, False, False)
ref = QuantFP8.__new__(QuantFP8)  # its torch form, without a vLLM config
ref.group_size, ref.use_ue8m0, ref.column_major_scales = 128, False, False
nq, ns = QuantFP8._quantize_group_native(ref, y)
assert torch.equal(sy, ns) and torch.equal(qy.view(torch.uint8), nq.view(torch.uint8))

# DeepGEMM's mHC pre-norm GEMM: split partial sums that add up to x @ fn.T and the rows' sums of squares
import vllm.utils.deep_gemm as dg
assert dg.tf32_hc_prenorm_gemm is sitecustomize.tf32_hc_prenorm_gemm
xb = torch.randn(5, 256, generator=g).bfloat16(); fn = torch.randn(24, 256, generator=g)
out = torch.full((3, 5, 24), 7.0); sq = torch.full((3, 5), 7.0)
dg.tf32_hc_prenorm_gemm(xb, fn, out, sq, 3)
torch.testing.assert_close(out.sum(0), xb.float() @ fn.t(), rtol=1e-5, atol=1e-4)
torch.testing.assert_close(sq.sum(0), xb.float().square().sum(-1), rtol=1e-5, atol=1e-4)
from vllm.model_executor.kernels.mhc import tilelang as mhc  # imports the function from the module at call time
assert "from vllm.utils.deep_gemm import" in open(mhc.__file__).read()

# vLLM's FP8 block-linear selection: Marlin refused by name, the Triton kernel left
import vllm.envs as envs
from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS, is_supported_and_can_implement_kernel
from vllm.platforms.interface import PlatformEnum
names = [k.__name__ for k in _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA]]
assert names.index("MarlinFP8ScaledMMLinearKernel") < names.index("TritonFp8BlockScaledMMKernel"), names
assert "MarlinFP8ScaledMMLinearKernel" in envs.VLLM_DISABLED_KERNELS
marlin = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA][names.index("MarlinFP8ScaledMMLinearKernel")]
ok, why = is_supported_and_can_implement_kernel(marlin, None, 90)
assert not ok and "disabled" in why, why
print("HARNESS FP8 OK")
"""


def _run(script: str, extra_env: dict | None = None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HARNESS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_harness_stand_ins_compute_what_vllms_ops_compute():
    out = _run(CHECK)
    assert out.returncode == 0 and "HARNESS OK" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])


def test_harness_fp8_stand_ins_and_kernel_choice():
    # a kernel the caller disabled stays disabled beside Marlin
    out = _run(CHECK_FP8 + "\nassert 'SomeOtherKernel' in envs.VLLM_DISABLED_KERNELS\n",
               {"VLLM_DISABLED_KERNELS": "SomeOtherKernel"})
    assert out.returncode == 0 and "HARNESS FP8 OK" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
