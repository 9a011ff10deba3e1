"""The paired sparse MQA program's arithmetic (:mod:`musa_attn_backend.kernels.dsv4.sparse.paired_kernel`), walked
in float32 on the CPU step by step as its two math groups do it: each group's tile scored, the running maximum
shared, each group's row sum kept apart and added at the end, P rounded to bf16 before ``P V``, both groups' tiles
added to each output half. Against softmax attention in float64 with the sink in the denominator: the division of
the work must not change the result beyond bf16's rounding of P (tolerances as the GPU tests')."""

import math

import pytest
import torch

LOG2E = math.log2(math.e)
BN, D, HD = 64, 512, 256


def paired_walk(q, kv, ok, sink, scale, empty_lse=float("-inf"), shared_max=True):
    """``q [H, 512]``, ``kv [n * 64, 512]`` (V = K), ``ok [n * 64]``: the program's output and LSE for one token
    (``shared_max`` False: each group's P at its own tile's maximum, the exchange left out, to show it matters)."""
    H = q.shape[0]
    n = kv.shape[0] // BN
    pairs = max(-(-n // 2), 1)
    pad = 2 * pairs * BN - kv.shape[0]
    kv = torch.cat([kv, torch.zeros(pad, D)])
    ok = torch.cat([ok, torch.zeros(pad, dtype=torch.bool)])
    s2 = scale * LOG2E
    m = torch.full((H,), float("-inf"))
    l = [torch.zeros(H), torch.zeros(H)]
    o = torch.zeros(H, D)
    for i in range(pairs):
        tiles = [slice((2 * i + w) * BN, (2 * i + w + 1) * BN) for w in (0, 1)]
        scores = [(q @ kv[t].T).masked_fill(~ok[t][None, :], float("-inf")) for t in tiles]
        m_new = torch.maximum(m, torch.maximum(scores[0].amax(1), scores[1].amax(1)))  # the shared maximum
        dead = m_new == float("-inf")
        alpha = torch.where(dead, torch.ones(H), torch.exp2((m - m_new) * s2))
        at = [m_new if shared_max else torch.maximum(m, s.amax(1)) for s in scores]
        p = [torch.where(dead[:, None], torch.zeros_like(s), torch.exp2(s * s2 - a[:, None] * s2))
             for s, a in zip(scores, at)]
        for w in (0, 1):
            l[w] = l[w] * alpha + p[w].sum(1)
        o = o * alpha[:, None]
        pb = [x.to(torch.bfloat16).float() for x in p]  # P in bf16 for the tensor cores
        for half in (slice(0, HD), slice(HD, D)):  # group 0's columns, group 1's: each adds both tiles
            o[:, half] += pb[0] @ kv[tiles[0], half] + pb[1] @ kv[tiles[1], half]
        m = m_new
    total = l[0] + l[1]
    sink_term = torch.where(m == float("-inf"), torch.zeros(H), torch.exp2(sink * LOG2E - m * s2))
    out = torch.where(total[:, None] == 0, torch.zeros(H, D), o / (total + sink_term)[:, None])
    lse = torch.where(total == 0, torch.full((H,), empty_lse), (torch.log2(total) + m * s2) / LOG2E)
    return out, lse


def softmax_attention(q, kv, ok, sink, scale):
    s = (q.double() @ kv.double().T) * scale
    s = s.masked_fill(~ok[None, :], float("-inf"))
    keys_lse = torch.logsumexp(s, dim=1)
    denom = torch.logaddexp(keys_lse, sink.double())
    out = torch.where(ok.any(), torch.exp(s - denom[:, None]) @ kv.double(), torch.zeros(1, dtype=torch.float64))
    return out.float(), keys_lse.float()


@pytest.mark.parametrize("tiles,invalid,seed", [(1, 0.0, 0), (2, 0.1, 1), (3, 0.5, 2), (12, 0.2, 3), (13, 0.9, 4),
                                                (5, 1.0, 5)])
def test_the_paired_walk_is_softmax_attention(tiles, invalid, seed):
    g = torch.Generator().manual_seed(seed)
    H = 16
    q = torch.randn(H, D, generator=g).to(torch.bfloat16).float()
    kv = torch.randn(tiles * BN, D, generator=g).to(torch.bfloat16).float()
    ok = torch.rand(tiles * BN, generator=g) >= invalid
    if tiles > 3:
        ok[BN:2 * BN] = False  # a whole invalid tile (one group's whole share of a pair)
    kv[~ok] = 0  # the producer's zeros for an entry it does not read
    sink = torch.randn(H, generator=g) * 3
    scale = D ** -0.5
    out, lse = paired_walk(q, kv, ok, sink, scale)
    ref, ref_lse = softmax_attention(q, kv, ok, sink, scale)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    if ok.any():
        torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)
    else:
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_a_group_whose_tiles_are_all_invalid_changes_nothing():
    """One valid tile and an odd count: group 1's every tile is invalid (or padding); the other group's maximum
    carries both."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(8, D, generator=g).to(torch.bfloat16).float()
    kv = torch.randn(3 * BN, D, generator=g).to(torch.bfloat16).float()
    ok = torch.zeros(3 * BN, dtype=torch.bool)
    ok[:BN] = True
    ok[2 * BN:] = True
    kv[~ok] = 0
    sink = torch.full((8,), -30.0)
    out, _ = paired_walk(q, kv, ok, sink, D ** -0.5)
    ref, _ = softmax_attention(q, kv, ok, sink, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_the_shared_maximum_is_what_makes_it_right():
    """Left out (each group's P at its own tile's maximum), the walk is wrong: the model can fail."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(16, D, generator=g).to(torch.bfloat16).float()
    kv = torch.randn(4 * BN, D, generator=g).to(torch.bfloat16).float()
    ok = torch.ones(4 * BN, dtype=torch.bool)
    sink = torch.zeros(16)
    ref, _ = softmax_attention(q, kv, ok, sink, D ** -0.5)
    out, _ = paired_walk(q, kv, ok, sink, D ** -0.5, shared_max=False)
    assert (out - ref).abs().max() > 0.1
