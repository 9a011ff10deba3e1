"""The model-side TileLang programs (:mod:`musa_attn_backend.kernels.dsv4.model.kernel`) on a GPU against the
float64 formulas of ``test_dsv4_model_ops.py`` (same tolerance, ``close``) and against the ops' torch form on
the same device: q norm + RoPE (1-128 heads, with and without the norm, into bf16 and FP8 outputs), the in-place
RoPE and its inverse on a strided view, the K norm + RoPE, the SWA store's norm + RoPE + FP8 write, the clamped
SwiGLU (widths off the block size). Positions past the table are clamped to its last row, as in the reference.
Outputs start NaN-poisoned where the op writes a given buffer."""

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import model as ops

from test_dsv4_model_ops import close, norm_rope_case, rotate64, tables

pytestmark = pytest.mark.gpu


def _on(dev, *ts):
    return [t.to(dev) for t in ts]


def same_as_torch(got, want):
    """The program against the op's torch form: the same bound as against float64 (``close``). The programs sum
    the squares in another order than torch, so a normed value may round to the neighbouring bf16, and a rotated
    value mixes two of them: a value that nearly cancels can differ by many of its own bf16 steps."""
    close(got.cpu(), want.cpu().double())


@pytest.mark.parametrize("T,H", [(1, 1), (7, 64), (300, 128), (33, 8)])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_q_norm_rope(gpu_device, T, H, eps):
    g = torch.Generator().manual_seed(T * H)
    ang, cos, sin = tables(n=64)
    q = (torch.randn(T, H, 512, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 70, (T,), generator=g)  # some past the 64-row table: clamped
    x = q.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) if eps else x
    want = torch.cat([y[..., :448], rotate64(y[..., 448:], ang, pos.clamp(max=63))], -1)
    qd, cd, sd, pd = _on(gpu_device, q, cos, sin, pos)
    got = ops.q_norm_rope(qd, eps, cd, sd, pd, impl="tilelang")
    close(got.cpu(), want)
    same_as_torch(got, ops.q_norm_rope(qd, eps, cd, sd, pd, impl="reference"))
    out = torch.full((T, H, 512), float("nan"), device=gpu_device).to(torch.float8_e4m3fn)
    assert ops.q_norm_rope(qd, eps, cd, sd, pd, out=out, impl="tilelang") is out
    assert not torch.isnan(out.float()).any()


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_in_place_on_a_strided_view(gpu_device, inverse):
    g = torch.Generator().manual_seed(2)
    ang, cos, sin = tables()
    o = torch.randn(257, 16, 512, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 50, (257,), generator=g)
    od, cd, sd, pd = _on(gpu_device, o, cos, sin, pos)
    ops.rope_(od[..., -64:], cd, sd, pd, inverse, impl="tilelang")
    assert torch.equal(od[..., :448].cpu(), o[..., :448])
    close(od[..., 448:].cpu(), rotate64(o[..., 448:], ang, pos, inverse))
    ref = o.to(gpu_device)
    ops.rope_(ref[..., -64:], cd, sd, pd, inverse, impl="reference")
    same_as_torch(od, ref)


def test_norm_rope_in_place(gpu_device):
    kv, w, cos, sin, pos, want = norm_rope_case(100)
    kd, wd, cd, sd, pd = _on(gpu_device, kv, w, cos, sin, pos)
    close(ops.norm_rope_(kd, wd, 1e-6, cd, sd, pd, impl="tilelang").cpu(), want)


@pytest.mark.parametrize("T", [1, 129])
def test_swa_store_norm_rope_write(gpu_device, T):
    """The SWA store (norm + RoPE program, then the writer) against the same op's torch form: the rows read back
    from both caches within one FP8 step; the page's other rows untouched (NaN-free zeros stay zeros)."""
    g = torch.Generator().manual_seed(T)
    _, cos, sin = tables()
    kv = (torch.randn(T, 512, generator=g) * 2).to(torch.bfloat16)
    w = torch.rand(512, generator=g) + 0.5
    pos = torch.randint(0, 50, (T,), generator=g)
    slots = torch.randperm(512, generator=g)[:T]
    kd, wd, cd, sd, pd, sl = _on(gpu_device, kv, w, cos, sin, pos, slots)
    caches = []
    for impl in ("tilelang", "reference"):
        cache = dsv4.new_kv_cache(2, 256, gpu_device)
        dsv4.norm_rope_write_kv_v4(kd, wd, 1e-6, cd, sd, pd, cache, sl, impl=impl)
        caches.append(dsv4.read_kv_v4(cache, torch.arange(512, device=gpu_device)).float())
    a, b = caches
    written = torch.zeros(512, dtype=torch.bool, device=gpu_device)
    written[sl] = True
    assert torch.equal(a[~written], b[~written])
    torch.testing.assert_close(a[written], b[written], rtol=2 ** -3, atol=1e-2)


@pytest.mark.parametrize("I,dtype", [(2048, torch.bfloat16), (300, torch.bfloat16), (128, torch.float32)])
def test_silu_and_mul_clamp(gpu_device, I, dtype):
    g = torch.Generator().manual_seed(I)
    x = (torch.randn(37, 2 * I, generator=g) * 8).to(dtype)
    gate, up = x[:, :I].double().clamp(max=10), x[:, I:].double().clamp(-10, 10)
    want = gate * torch.sigmoid(gate) * up
    xd = x.to(gpu_device)
    out = torch.full((37, I), float("nan"), dtype=dtype, device=gpu_device)
    assert ops.silu_and_mul_clamp(xd, 10.0, out=out, impl="tilelang") is out
    close(out.cpu(), want, scale=100)
    same_as_torch(out, ops.silu_and_mul_clamp(xd, 10.0, impl="reference"))


@pytest.mark.parametrize("T,H", [(6, 64), (77, 4096), (1, 7168), (3, 300)])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_mhc_pre(gpu_device, T, H, fused_norm):
    """mHC before a sublayer: the TileLang program (after torch's GEMM for the mixes) against the op's torch form
    on the same device: ``post`` and ``comb`` to float32 rounding, the layer input within ``close``."""
    from test_dsv4_model_ops import mhc_inputs

    g, R, fn, scale, base = mhc_inputs(T=T, H=H, seed=T + H)
    w = torch.rand(H, generator=g) + 0.5 if fused_norm else None
    Rd, fd, sd, bd = _on(gpu_device, R, fn, scale, base)
    wd = w.to(gpu_device) if fused_norm else None
    args = (Rd, fd, sd, bd, 1e-6, 1e-6, 1e-6, 2.0, 20)
    kw = dict(norm_weight=wd, norm_eps=1e-6 if fused_norm else None)
    post, comb, y = ops.mhc_pre(*args, **kw, impl="tilelang")
    rpost, rcomb, ry = ops.mhc_pre(*args, **kw, impl="reference")
    torch.testing.assert_close(post, rpost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, rcomb, rtol=1e-4, atol=1e-5)
    if H == 64:  # well-conditioned mixes (as on the CPU): 20 Sinkhorn steps reach doubly stochastic rows
        assert torch.allclose(comb.sum(-1).double(), torch.ones(T, 4, dtype=torch.float64, device=gpu_device),
                              atol=1e-3)
    close(y.cpu(), ry.cpu().double())


@pytest.mark.parametrize("T,H", [(6, 64), (129, 4096), (2, 300)])
def test_mhc_post_and_head(gpu_device, T, H):
    from test_dsv4_model_ops import mhc_inputs

    g, R, fn, scale, base = mhc_inputs(T=T, H=H, seed=7 * T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    post = torch.rand(T, 4, 1, generator=g) * 2
    comb = torch.rand(T, 4, 4, generator=g)
    xd, Rd, pd, cd = _on(gpu_device, x, R, post, comb)
    want = post[..., 0].double().unsqueeze(-1) * x.double().unsqueeze(1) + torch.einsum(
        "tji,tjh->tih", comb.double(), R.double())
    got = ops.mhc_post(xd, Rd, pd, cd, impl="tilelang")
    close(got.cpu(), want)
    close(got.cpu(), ops.mhc_post(xd, Rd, pd, cd, impl="reference").cpu().double())
    fh, sh, bh = _on(gpu_device, fn[:4], scale[:1], base[:4])
    close(ops.hc_head(Rd, fh, sh, bh, 1e-6, 1e-6, impl="tilelang").cpu(),
          ops.hc_head(Rd, fh, sh, bh, 1e-6, 1e-6, impl="reference").cpu().double())
