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


def test_harness_stand_ins_compute_what_vllms_ops_compute():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HARNESS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "HARNESS OK" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
