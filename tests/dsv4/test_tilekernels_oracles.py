"""DeepSeek's TileKernels (``tile-kernels`` 2.1.0) as an independent oracle for the V4 model-side math: its torch
references (``tile_kernels.torch``) against our references (the CPU path and the ground truth of the GPU tests)
and the independent V4 forward the engine tests check served tokens with (``integration_tests/dsv4_reference``).

tile-kernels 2.1.0 needs TileLang >= 0.1.15, which the engines' pin (0.1.12) rules out in the test environment,
so ``scripts/setup_env.sh`` stages it in ``.venv/oracles`` and ``make test`` runs this module a second time with
that folder on ``PYTHONPATH`` (``make test-oracles``); in the main run it skips and says so.

Tolerances: float32 against float32 of the same formula in another order: 2e-6 relative (a few ulps); results
rounded to bf16 on both sides: one bf16 ulp (2^-8 relative); routing: the same experts in the same order, weights
to 1e-6.
"""

import sys
from pathlib import Path

import pytest
import torch

from musa_attn_backend.kernels.dsv4 import model as M
from musa_attn_backend.kernels.moe.layer import swiglu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integration_tests"))
import dsv4_reference as R  # noqa: E402

pytestmark = pytest.mark.tilekernels

try:
    import tile_kernels.torch as tk
    _WHY = None
except Exception as e:  # ImportError, or TileLang 0.1.12's missing modules (tilelang.cuda.language ...)
    tk, _WHY = None, f"{type(e).__name__}: {e}"

needs_tk = pytest.mark.skipif(tk is None, reason=f"tile-kernels 2.1.0 does not import here ({_WHY}); "
                                                 "`make test-oracles` runs these with .venv/oracles")
BF16_ULP = 2.0 ** -8


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@needs_tk
@pytest.mark.parametrize("M_rows, inter, limit", [(1, 64, 7.0), (37, 256, 10.0), (128, 96, 0.5)])
def test_clamped_swiglu_matches_tilekernels(M_rows, inter, limit):
    g = _gen(M_rows * inter)
    # values spread past the limit on both sides, so both clamps act on a good share of the entries
    x = (torch.randn(M_rows, 2 * inter, generator=g) * 2 * limit).to(torch.bfloat16)
    want = tk.swiglu_forward(x.contiguous(), clamp_value=limit)  # float32
    assert (x[:, :inter].float() > limit).any() and (x[:, inter:].float().abs() > limit).any()
    torch.testing.assert_close(swiglu(x, limit), want, rtol=2e-6, atol=1e-6)  # the MoE path, float32
    ours = M.silu_and_mul_clamp(x, limit, impl="reference")  # the dense path, rounded to bf16
    torch.testing.assert_close(ours.float(), want.to(torch.bfloat16).float(), rtol=BF16_ULP, atol=1e-5)
    # and the independent V4 forward's expert, its gate and up projections picking x's two halves
    eye, zero = torch.eye(inter), torch.zeros(inter, inter)
    ref = R.Reference({"swiglu_limit": limit, "rms_norm_eps": 1e-6},
                      {"e.w1.weight": torch.cat([eye, zero], 1), "e.w3.weight": torch.cat([zero, eye], 1)})
    torch.testing.assert_close(ref._expert(x.float(), "e."), want, rtol=2e-6, atol=1e-6)


@needs_tk
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("T, heads", [(1, 1), (19, 8), (64, 3)])
def test_rope_and_its_inverse_match_tilekernels(T, heads, inverse):
    g = _gen(T * 131 + heads)
    max_pos = 4096
    angles = torch.rand(max_pos, 32, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (T,), generator=g)
    x = torch.randn(T, heads, 64, generator=g)
    want = tk.rotary_embedding_ref(x, cos, sin, positions, interleaved=True, conjugate=inverse)  # GPT-J pairs
    ours = M.rope_(x.clone(), cos, sin, positions, inverse=inverse, impl="reference")
    torch.testing.assert_close(ours, want, rtol=2e-6, atol=2e-6)
    # the independent V4 forward's rotation (from the angles, not the tables)
    torch.testing.assert_close(R.rotate(x, angles[positions].unsqueeze(1), inverse=inverse), want,
                               rtol=2e-6, atol=2e-6)
    # the inverse undoes the rotation
    back = M.rope_(ours.clone(), cos, sin, positions, inverse=not inverse, impl="reference")
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@needs_tk
@pytest.mark.parametrize("T, n, iters", [(1, 4, 20), (33, 4, 20), (7, 2, 3), (16, 8, 1)])
def test_mhc_split_and_sinkhorn_match_tilekernels(T, n, iters):
    g = _gen(T * 7 + n * 3 + iters)
    mixes = torch.randn(T, n * (n + 2), generator=g) * 3
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(n * (n + 2), generator=g)
    pre_eps, eps, post_mult = 1e-2, 1e-6, 2.0
    pre_w, post_w, comb_logits = tk.mhc_pre_split_mixes_ref(mixes.unsqueeze(0), scale, base, n, post_mult, pre_eps)
    comb_w = tk.sinkhorn_normalize_ref(comb_logits, repeat=iters, eps=eps)
    pre, post, comb = M.hc_split_sinkhorn(mixes, scale, base, n, iters, eps, post_mult, pre_eps)
    torch.testing.assert_close(pre, pre_w[0, ..., 0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(post, post_w[0, ..., 0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(comb, comb_w[0], rtol=2e-6, atol=1e-6)
    if post_mult == 2.0:  # the independent V4 forward (pre_eps = eps there)
        rp, rpost, rcomb = R.sinkhorn_split(mixes, scale, base, n, iters, eps)
        tp, _, _ = tk.mhc_pre_split_mixes_ref(mixes.unsqueeze(0), scale, base, n, post_mult, eps)
        torch.testing.assert_close(rp, tp[0, ..., 0], rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(rpost, post_w[0, ..., 0], rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(rcomb, comb_w[0], rtol=2e-6, atol=1e-6)


@needs_tk
@pytest.mark.parametrize("T, n, H", [(1, 4, 64), (21, 4, 128)])
def test_mhc_post_and_the_pre_mix_match_tilekernels(T, n, H):
    g = _gen(T + n + H)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    residual = torch.randn(T, n, H, generator=g).to(torch.bfloat16)
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.rand(T, n, n, generator=g)
    want = tk.mhc_post_ref(x.unsqueeze(0), residual.unsqueeze(0), post.view(1, T, n, 1), comb.unsqueeze(0))[0]
    ours = M.mhc_post(x, residual, post, comb, impl="reference")
    torch.testing.assert_close(ours.float(), want.float(), rtol=BF16_ULP, atol=1e-2 * BF16_ULP)
    pre = torch.rand(T, n, generator=g)
    want_mix = tk.mhc_pre_apply_mix_ref(residual.float(), pre.unsqueeze(-1))
    torch.testing.assert_close(M.hc_combine(residual, pre).float(), want_mix.float(), rtol=BF16_ULP, atol=1e-5)


@needs_tk
@pytest.mark.parametrize("T, E, k", [(1, 16, 6), (40, 256, 6), (9, 8, 8), (5, 64, 1)])
def test_v4_routing_matches_tilekernels_gate(T, E, k):
    g = _gen(T * E + k)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.1
    scaling = 1.5
    chosen, weight, margin = R.route(logits, bias, k, scaling)
    idx, w = tk.moe_topk_gate_forward(logits, k, False, 0, scaling, 0, "sqrtsoftplus", bias=bias)
    assert torch.equal(chosen, idx)  # the same experts, in the same (descending biased score) order
    torch.testing.assert_close(weight, w, rtol=1e-6, atol=1e-7)
    assert (margin > 0).all() if k < E else torch.isinf(margin).all()
