"""DeepSeek-V4's model-side ops (:mod:`musa_attn_backend.kernels.dsv4.model`) against float64 formulas written
here: the rotation as complex multiplication (DeepSeek-V4's ``apply_rotary_emb``), the norm as a division by
the root mean square. Tolerance (``close``): two bf16 steps of the value plus one of the row's largest value,
since the ops round to bf16 where the engines' kernels do (also between the norm and the rotation) and the
float64 formulas do not; a wrong sign, pairing or direction misses by far more."""

import pytest
import torch

from musa_attn_backend.kernels.dsv4 import model as ops


def tables(n=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, 32, generator=g, dtype=torch.float64) * 6.3
    return ang, ang.cos().float(), ang.sin().float()


def rotate64(x, ang, pos, inverse=False):
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    f = torch.polar(torch.ones_like(ang[pos]), ang[pos])
    f = f.conj() if inverse else f
    return torch.view_as_real(z * f.view((f.shape[0],) + (1,) * (z.dim() - 2) + (32,))).flatten(-2)


def close(got, want, scale=1.0):
    """Within two bf16 steps of the value plus one step of the row's largest value: the ops round the rotation's
    inputs to bf16, and a rotated value mixes two of them."""
    err = (got.double() - want).abs()
    bound = 2 ** -7 * (want.abs() + want.abs().amax(-1, keepdim=True)) + 1e-6 * scale
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("eps", [1e-6, None])
def test_q_norm_rope(eps):
    g = torch.Generator().manual_seed(1)
    ang, cos, sin = tables()
    q = (torch.randn(7, 5, 512, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 50, (7,), generator=g)
    x = q.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) if eps else x
    want = torch.cat([y[..., :448], rotate64(y[..., 448:], ang, pos)], -1)
    close(ops.q_norm_rope(q, eps, cos, sin, pos), want)
    out = torch.full((7, 5, 512), float("nan")).to(torch.float8_e4m3fn)  # the FP8 output the engine may pass
    assert ops.q_norm_rope(q, eps, cos, sin, pos, out=out) is out and not torch.isnan(out.float()).any()


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_in_place_on_a_strided_view(inverse):
    g = torch.Generator().manual_seed(2)
    ang, cos, sin = tables()
    o = torch.randn(9, 4, 512, generator=g).to(torch.bfloat16)
    before = o.clone()
    pos = torch.randint(0, 50, (9,), generator=g)
    ops.rope_(o[..., -64:], cos, sin, pos, inverse)
    assert torch.equal(o[..., :448], before[..., :448])
    close(o[..., 448:], rotate64(before[..., 448:], ang, pos, inverse))
    ops.rope_(o[..., -64:], cos, sin, pos, not inverse)  # and back
    close(o[..., 448:], before[..., 448:].double())


def norm_rope_case(n: int):
    """``(kv, w, cos, sin, pos, want)``: ``n`` rows, their weights, the RoPE tables and positions, and the RMS norm
    (eps 1e-6) then RoPE of the last 64 values in float64."""
    g = torch.Generator().manual_seed(3)
    ang, cos, sin = tables()
    kv = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
    w = torch.rand(512, generator=g) + 0.5
    pos = torch.randint(0, 50, (n,), generator=g)
    x = kv.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w.double()
    return kv, w, cos, sin, pos, torch.cat([y[:, :448], rotate64(y[:, 448:], ang, pos)], 1)


def test_norm_rope_in_place():
    kv, w, cos, sin, pos, want = norm_rope_case(6)
    close(ops.norm_rope_(kv, w, 1e-6, cos, sin, pos), want)


def test_silu_and_mul_clamp():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(11, 64, generator=g) * 8).to(torch.bfloat16)
    gate, up = x[:, :32].double().clamp(max=10), x[:, 32:].double().clamp(-10, 10)
    want = gate * torch.sigmoid(gate) * up
    out = torch.empty(11, 32, dtype=torch.bfloat16)
    assert ops.silu_and_mul_clamp(x, 10.0, out=out) is out
    close(out, want, scale=100)
    assert (x[:, :32].float() > 10).any() and (x[:, 32:].float().abs() > 10).any()  # the clamps were exercised


@pytest.mark.parametrize("call,match", [
    (lambda: ops.q_norm_rope(torch.zeros(3, 512), 1e-6, torch.ones(4, 32), torch.ones(4, 32), torch.arange(3)),
     r"q must be \[T, heads, head_dim\]"),
    (lambda: ops.rope_(torch.zeros(3, 2, 64), torch.ones(4, 16), torch.ones(4, 32), torch.arange(3)),
     r"cos must be a floating \[max_pos, 32\]"),
    (lambda: ops.rope_(torch.zeros(3, 2, 64), torch.ones(4, 32), torch.ones(4, 32), torch.arange(2)),
     r"positions must be an integer \[3\]"),
    (lambda: ops.silu_and_mul_clamp(torch.zeros(3, 5), 10.0), r"x must be a floating \[M, 2 \* I\]"),
    (lambda: ops.silu_and_mul_clamp(torch.zeros(3, 4), 0.0), r"limit must be positive"),
])
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def mhc_inputs(T=6, n=4, H=64, seed=5):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(T, n, H, generator=g).to(torch.bfloat16)
    fn = torch.randn(n * (n + 2), n * H, generator=g) * 0.05
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(n * (n + 2), generator=g) * 0.1
    return g, R, fn, scale, base


def test_mhc_pre_and_sinkhorn_against_float64():
    """mHC before a sublayer (DeepSeek-V4's ``Block.hc_pre``), written here in float64: the Sinkhorn result is
    doubly stochastic to within its epsilons, and the layer input is the ``pre``-weighted sum."""
    g, R, fn, scale, base = mhc_inputs()
    post, comb, y = ops.mhc_pre(R, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    x = R.flatten(1).double()
    m = (x @ fn.double().T) / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(m[:, :4] * scale[0].double() + base[:4].double()) + 1e-6
    assert torch.allclose(post[..., 0].double(), 2 * torch.sigmoid(m[:, 4:8] * scale[1].double()
                                                                   + base[4:8].double()), rtol=1e-5, atol=1e-6)
    assert torch.allclose(comb.sum(-1).double(), torch.ones(6, 4, dtype=torch.float64), atol=1e-3)
    assert torch.allclose(comb.sum(-2).double(), torch.ones(6, 4, dtype=torch.float64), atol=1e-3)
    close(y, (pre.unsqueeze(-1) * R.double()).sum(1))
    # with the sublayer's norm fused: RMSNorm of the sum
    w = torch.rand(64, generator=g) + 0.5
    _, _, yn = ops.mhc_pre(R, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20, norm_weight=w, norm_eps=1e-6)
    s = (pre.unsqueeze(-1) * R.double()).sum(1)
    close(yn, s / torch.sqrt(s.square().mean(-1, keepdim=True) + 1e-6) * w.double())


def test_mhc_post_and_head_against_float64():
    g, R, fn, scale, base = mhc_inputs()
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    post = torch.rand(6, 4, generator=g) * 2
    comb = torch.rand(6, 4, 4, generator=g)
    want = post.double().unsqueeze(-1) * x.double().unsqueeze(1) + torch.einsum("tji,tjh->tih", comb.double(),
                                                                                R.double())
    close(ops.mhc_post(x, R, post, comb), want)
    close(ops.mhc_post(x, R, post.unsqueeze(-1), comb), want)  # post as [T, n, 1] too
    fh, sh, bh = fn[:4], scale[:1], base[:4]
    xf = R.flatten(1).double()
    m = (xf @ fh.double().T) / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(m * sh.double() + bh.double()) + 1e-6
    close(ops.hc_head(R, fh, sh, bh, 1e-6, 1e-6), (pre.unsqueeze(-1) * R.double()).sum(1))


@pytest.mark.parametrize("capturing", [False, True], ids=["grouped", "under_capture"])
def test_moe_swiglu_experts_against_float64(monkeypatch, capturing):
    """Both forms: tokens grouped by expert (one host read), and, while a graph is captured, every expert over
    every choice (no host read: the stand-in sees itself captured through ``stream_capturing``)."""
    import musa_attn_backend.kernels.dsv4.model as mod

    monkeypatch.setattr(mod, "stream_capturing", lambda device: capturing)
    if capturing:  # a host read here would break a capture: make one fail the test
        monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("host read under capture"))
    g = torch.Generator().manual_seed(6)
    T, H, I, E, K = 9, 32, 16, 5, 2
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.8).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.3).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[0, 1] = -1  # an expert this rank does not hold
    w = torch.rand(T, K, generator=g)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = x[t].double() @ w13[e].double().T
            gate, up = gu[:I].clamp(max=10), gu[I:].clamp(-10, 10)
            want[t] += w[t, k].double() * ((gate * torch.sigmoid(gate) * up) @ w2[e].double().T)
    got = ops.moe_swiglu_experts(x, w13, w2, w, ids, 10.0)
    err = (got.double() - want).abs()
    assert (err <= 0.02 * want.abs().amax(-1, keepdim=True) + 1e-3).all(), err.max()  # bf16 products and sums
