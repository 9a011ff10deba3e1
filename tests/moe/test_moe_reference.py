"""The MoE grouped-GEMM references (:mod:`musa_attn_backend.kernels.moe.reference`) against an independent float64
computation written from the formats' definitions (per row, per element: no shared helper), the FP4 and UE8M0
decoding exactly, the quantisers, and the public ops' refusals of bad input."""

import pytest
import torch

from musa_attn_backend.kernels import moe
from musa_attn_backend.kernels.moe import reference as R


def e2m1_from_bits(nibble: int) -> float:
    """E2M1 from its bits: sign, 2-bit exponent (bias 1), 1-bit mantissa; exponent 0 is subnormal (m * 0.5)."""
    s, e, m = nibble >> 3, (nibble >> 1) & 3, nibble & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


def test_fp4_and_ue8m0_decoding_is_exact():
    b = torch.arange(256, dtype=torch.uint8).view(1, 1, 256)
    scale = torch.full((1, 1, 16), 127, dtype=torch.uint8)  # 2^0
    got = R.dequantize_fp4(b, scale).view(256, 2)
    for byte in range(256):
        assert got[byte, 0].item() == e2m1_from_bits(byte & 15) and got[byte, 1].item() == e2m1_from_bits(byte >> 4)
    s = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    want = [2.0 ** (int(x) - 127) for x in s[:-1]]
    got = R.ue8m0_to_float(s)
    assert got[:-1].tolist() == want and torch.isnan(got[-1])


def test_fp4_quantiser_round_trips_representable_values():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 64, 256), generator=g)
    exps = torch.randint(-20, 20, (3, 64, 8), generator=g)
    vals = torch.tensor(R.E2M1_VALUES)[codes] * torch.exp2(exps.float()).repeat_interleave(32, -1)
    vals[..., ::32] = 6.0 * torch.exp2(exps.float())  # each group's amax is 6 * its scale
    packed, scale = R.quantize_fp4_reference(vals)
    assert packed.shape == (3, 64, 128) and scale.shape == (3, 64, 8)
    assert torch.equal(R.dequantize_fp4(packed, scale), vals)


@pytest.mark.parametrize("pow2", [False, True])
def test_group_quantiser(pow2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 384, generator=g) * torch.logspace(-3, 3, 7).view(-1, 1)
    x[3, 128:256] = 0  # an all-zero group: scale from the 1e-4 floor
    q, s = moe.quantize_groups(x, pow2=pow2)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, 3)
    amax = x.view(7, 3, 128).abs().amax(-1).clamp(min=1e-4)
    if pow2:
        assert torch.equal(torch.log2(s), torch.log2(s).round()) and (s >= amax / 448).all() and (s < amax / 224).all()
    else:
        assert torch.allclose(s, amax / 448, rtol=1e-6)
    back = R.dequantize_groups(q, s)
    assert ((back - x).abs() <= 2 ** -4 * x.abs() + s.repeat_interleave(128, -1) * 2 ** -9).all()


def _fp8_weights(g, E, N, K):
    w = torch.randn(E, N, K, generator=g) * torch.rand(E, N // 128, 1, K // 128, 1, generator=g).mul(4).add(0.1) \
        .expand(E, N // 128, 128, K // 128, 128).reshape(E, N, K)
    return R.quantize_weight_blocks_reference(w)


def _row64(a, sa, b, sb, e):
    """One output row in float64 from the definitions: ``sum_k a[k] sa[k // 128] b[e, n, k] sb[e, n // 128, k // 128]``.
    The bounds on it: bf16's rounding (2^-9 relative, 2^-8 allowed) plus float32 accumulation error (relative
    to the row's largest value: a cancelling sum can come out far smaller than its terms)."""
    K = a.shape[-1]
    av = a.double() * sa.double()[torch.arange(K) // 128]
    bv = b[e].double() * sb[e].double()[torch.arange(b.shape[1]) // 128][:, torch.arange(K) // 128]
    return bv @ av


@pytest.mark.parametrize("seed", range(3))
def test_contiguous_reference_against_float64(seed):
    g = torch.Generator().manual_seed(seed)
    E, N, K = 5, 256, 384
    b, sb = _fp8_weights(g, E, N, K)
    sizes = [int(x) for x in torch.randint(0, 200, (E,), generator=g)]
    sizes[1] = 0  # an empty expert
    layout = []
    for e, n in enumerate(sizes):
        layout += [e] * n + [-1] * (-n % 128)
    layout += [-1] * 128  # a whole padding tile
    M = len(layout)
    layout = torch.tensor(layout, dtype=torch.int32)
    a, sa = moe.quantize_groups(torch.randn(M, K, generator=g))
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, b, sb, layout, out)
    for m in range(M):
        if layout[m] < 0:
            assert torch.isnan(out[m]).all()  # not written
            continue
        want = _row64(a[m], sa[m], b, sb, int(layout[m]))
        err = (out[m].double() - want).abs()
        assert (err <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all(), (m, float(err.max()))


def test_contiguous_malformed_layout_is_nan_not_silent():
    g = torch.Generator().manual_seed(4)
    E, N, K = 3, 128, 128
    b, sb = _fp8_weights(g, E, N, K)
    layout = torch.full((384,), -1, dtype=torch.int32)
    layout[:10] = 0
    layout[10:20] = 1  # a second expert inside tile 0
    layout[129:140] = 2  # tile 1 starts with padding: its expert is -1
    layout[256:300] = 7  # an expert past E
    a, sa = moe.quantize_groups(torch.randn(384, K, generator=g))
    out = torch.zeros(384, N, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, b, sb, layout, out)
    nan_rows = torch.isnan(out).all(1)
    assert not nan_rows[:10].any() and nan_rows[10:20].all() and nan_rows[129:140].all() and nan_rows[256:300].all()
    assert (out[20:129] == 0).all() and (out[140:256] == 0).all() and (out[300:] == 0).all()


def test_masked_reference_against_float64():
    g = torch.Generator().manual_seed(5)
    E, MM, N, K = 4, 9, 128, 256
    b, sb = _fp8_weights(g, E, N, K)
    a, sa = moe.quantize_groups(torch.randn(E, MM, K, generator=g))
    masked = torch.tensor([3, 0, 9, 40], dtype=torch.int32)  # 40: clamped to max_m
    out = torch.full((E, MM, N), float("nan"), dtype=torch.bfloat16)
    moe.grouped_gemm_fp8_masked(a, sa, b, sb, masked, out)
    for e in range(E):
        m = min(int(masked[e]), MM)
        assert torch.isnan(out[e, m:]).all()
        for r in range(m):
            want = _row64(a[e, r], sa[e, r], b, sb, e)
            assert ((out[e, r].double() - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all()


def test_fp4_weights_in_the_reference():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(2, 128, 256, generator=g)
    packed, scale = R.quantize_fp4_reference(w)
    a, sa = moe.quantize_groups(torch.randn(130, 256, generator=g))
    layout = torch.tensor([1] * 130, dtype=torch.int32)
    out = R.grouped_gemm_contiguous_reference(a, sa, packed, scale, layout)
    want = R.dequantize_groups(a, sa).double() @ R.dequantize_fp4(packed, scale)[1].double().T
    assert torch.allclose(out.double(), want, rtol=2 ** -8, atol=1e-5)


def test_bad_input_is_refused_naming_the_argument():
    E, N, K, M = 2, 128, 256, 5
    b = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
    sb = torch.ones(E, 1, 2)
    a = torch.zeros(M, K, dtype=torch.float8_e4m3fn)
    sa = torch.ones(M, 2)
    lay = torch.zeros(M, dtype=torch.int32)
    f = moe.grouped_gemm_fp8
    cases = [
        (lambda: f(a, sa, b.view(torch.int8), sb, lay), "b must be float8_e4m3fn"),
        (lambda: f(a, sa, b.view(torch.uint8), sb, lay), r"b_scale must have shape"),  # read as packed FP4
        (lambda: f(a, sa, torch.zeros(E, 100, K, dtype=b.dtype), sb, lay), "multiples of 128"),
        (lambda: f(a, sa, b, torch.ones(E, 1, 3), lay), "b_scale must have shape"),
        (lambda: f(a, sa, b, sb.double(), lay), "b_scale must be torch.float32"),
        (lambda: f(a.float(), sa, b, sb, lay), "a must be torch.float8_e4m3fn"),
        (lambda: f(a[:, :128], sa, b, sb, lay), "a must have shape"),
        (lambda: f(a, sa[:, :1], b, sb, lay), "a_scale must have shape"),
        (lambda: f(a, sa, b, sb, lay.long()), "grouped_layout must be torch.int32"),
        (lambda: f(a, sa, b, sb, lay[:4]), "grouped_layout must have shape"),
        (lambda: f(a, sa, b, sb, lay, torch.zeros(M, N)), "out must be torch.bfloat16"),
        (lambda: f(a, sa, b, sb, lay, torch.zeros(N, M, dtype=torch.bfloat16).T), "out must be contiguous"),
        (lambda: f(a, sa, b, sb, lay, impl="triton"), "impl must be one of"),
        (lambda: f(a, sa, b, sb, lay, impl="tilelang"), "needs the tensors on a CUDA or MUSA device"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    g = moe.grouped_gemm_fp8_masked
    a3, sa3 = a.view(1, M, K).expand(E, M, K).contiguous(), sa.view(1, M, 2).expand(E, M, 2).contiguous()
    for call, msg in [(lambda: g(a3, sa3, b, sb, torch.zeros(3, dtype=torch.int32)), "masked_m must have shape"),
                      (lambda: g(a3[:1], sa3, b, sb, lay[:2]), "a must have shape"),
                      (lambda: g(a3, sa3, b, sb, lay[:2].float()), "masked_m must be torch.int32")]:
        with pytest.raises(ValueError, match=msg):
            call()
    with pytest.raises(ValueError, match="multiple of 128"):
        moe.quantize_groups(torch.zeros(3, 100))


@pytest.mark.parametrize("T,k,E,mapped", [(1, 6, 256, False), (37, 6, 16, False), (300, 2, 5, True), (0, 6, 8, False)])
def test_align_routing_against_a_loop(T, k, E, mapped):
    g = torch.Generator().manual_seed(T)
    n_global = 2 * E if mapped else E
    ids = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    emap = None
    if mapped:  # half the experts on this rank, in a shuffled local order
        emap = torch.full((n_global,), -1, dtype=torch.int32)
        emap[torch.randperm(n_global, generator=g)[:E]] = torch.randperm(E, generator=g).to(torch.int32)
    if T:
        ids[0, 0] = -1  # a dropped choice
    row_src, layout = moe.align_routing(ids.to(torch.int32), E, emap)
    M = -(-(T * k + E * 127) // 128) * 128
    assert row_src.shape == layout.shape == (M,) and row_src.dtype == layout.dtype == torch.int32
    # the loop: each expert's choices in flat order, segments padded to 128
    want_src, want_lay = [], []
    flat = ids.reshape(-1).tolist()
    for e in range(E):
        mine = [i for i, x in enumerate(flat) if x >= 0 and (int(emap[x]) if mapped else x) == e]
        want_src += mine + [-1] * (-len(mine) % 128)
        want_lay += [e] * len(mine) + [-1] * (-len(mine) % 128)
    n = len(want_src)
    assert row_src[:n].tolist() == want_src and layout[:n].tolist() == want_lay
    assert (row_src[n:] == -1).all() and (layout[n:] == -1).all()


def test_masked_fp4_weights_against_float64():
    g = torch.Generator().manual_seed(7)
    E, MM, N, K = 3, 5, 128, 256
    packed, scale = R.quantize_fp4_reference(torch.randn(E, N, K, generator=g))
    a, sa = moe.quantize_groups(torch.randn(E, MM, K, generator=g))
    masked = torch.tensor([5, 2, 0], dtype=torch.int32)
    out = torch.full((E, MM, N), float("nan"), dtype=torch.bfloat16)
    moe.grouped_gemm_fp8_masked(a, sa, packed, scale, masked, out)
    table = [e2m1_from_bits(n) for n in range(16)]
    for e in range(E):
        w = torch.tensor([[table[int(packed[e, n, j // 2]) >> (4 * (j % 2)) & 15] for j in range(K)] for n in range(N)],
                         dtype=torch.float64) * (2.0 ** (scale[e].double() - 127)).repeat_interleave(32, -1)
        for r in range(MM):
            if r >= masked[e]:
                assert torch.isnan(out[e, r]).all()
                continue
            want = w @ (a[e, r].double() * sa[e, r].double().repeat_interleave(128))
            assert ((out[e, r].double() - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all()


def test_fp4_weights_with_bad_scales_are_refused():
    packed = torch.zeros(2, 128, 128, dtype=torch.uint8)
    a, sa = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"b_scale must have shape \(2, 128, 8\)"):
        moe.grouped_gemm_fp8(a, sa, packed, torch.zeros(2, 128, 4, dtype=torch.uint8), torch.zeros(4, dtype=torch.int32))
    a3, sa3 = torch.zeros(2, 4, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 4, 2)
    with pytest.raises(ValueError, match=r"b_scale of FP4 weights must be uint8 .UE8M0 bytes. or float32"):
        moe.grouped_gemm_fp8_masked(a3, sa3, packed, torch.zeros(2, 128, 8, dtype=torch.float16),
                                    torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"b must be float8_e4m3fn .* or uint8 .packed MXFP4., got torch.int8"):
        moe.grouped_gemm_fp8_masked(a3, sa3, packed.view(torch.int8), torch.zeros(2, 128, 8, dtype=torch.uint8),
                                    torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_fused_experts_with_fp4_experts_against_float64(layout):
    """The layer op with MXFP4 experts against a float64 per-choice computation from the definitions (same
    activation quantisation): relative L2 error below 1e-2."""
    g = torch.Generator().manual_seed(8)
    E, H, I, T, k = 4, 256, 128, 40, 2
    w13, s13 = R.quantize_fp4_reference(torch.randn(E, 2 * I, H, generator=g) * 0.1)
    w2, s2 = R.quantize_fp4_reference(torch.randn(E, H, I, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, 1).indices.to(torch.int32)
    w = torch.rand(T, k, generator=g)
    out = moe.fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, swiglu_limit=10.0, layout=layout)
    W13 = R.dequantize_fp4(w13, s13).double()
    W2 = R.dequantize_fp4(w2, s2).double()
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        a = R.dequantize_groups(*moe.quantize_groups(x[t:t + 1])).double()[0]
        for j in range(k):
            h = (W13[int(ids[t, j])] @ a).to(torch.bfloat16).double()
            gate, up = h[:I].clamp(max=10.0), h[I:].clamp(-10.0, 10.0)
            act = R.dequantize_groups(*moe.quantize_groups((torch.nn.functional.silu(gate) * up).float().view(1, -1)))
            want[t] += float(w[t, j]) * (W2[int(ids[t, j])] @ act.double()[0]).to(torch.bfloat16).double()
    rel = float((out.double() - want).norm() / want.norm())
    assert rel < 1e-2, rel


def test_fused_experts_layouts_agree_with_the_reference_on_dropped_choices():
    """Choices of experts on another rank (``expert_map`` -1), ids out of range and ``-1`` ids take no row, on
    both layouts: each equals the reference exactly (the same quantisation and products on the CPU)."""
    g = torch.Generator().manual_seed(9)
    E, H, I, T, k = 3, 256, 128, 50, 3
    w13, s13 = R.quantize_weight_blocks_reference(torch.randn(E, 2 * I, H, generator=g) * 0.1)
    w2, s2 = R.quantize_weight_blocks_reference(torch.randn(E, H, I, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, 8, generator=g).topk(k, 1).indices.to(torch.int32)  # 8 global experts
    ids[0, 0], ids[1, 1] = -1, 99
    emap = torch.tensor([2, -1, 0, -1, 1, -1, -1, -1], dtype=torch.int32)
    w = torch.rand(T, k, generator=g)
    kw = dict(w13_scale=s13, w2_scale=s2, swiglu_limit=10.0, expert_map=emap)
    want = moe.fused_experts_reference(x, w13, w2, w, ids, **kw)
    assert (want.float().abs().sum(1) > 0).sum() > T // 2  # most tokens reach a local expert
    for layout in ("masked", "contiguous"):
        assert torch.equal(moe.fused_experts(x, w13, w2, w, ids, layout=layout, **kw), want), layout


def test_swiglu_quant_against_float64_from_the_definition():
    """``swiglu_quant`` (the reference path) against V4's clamped SwiGLU and the 1 x 128 rule written in float64:
    named rows quantised (dequantised within half an e4m3 step of the float64 value), indices outside ``[0, R)``
    skipped, rows no index names left as they were (NaN bytes and NaN scales)."""
    g = torch.Generator().manual_seed(5)
    R, I, L = 9, 256, 10.0
    h = (torch.randn(R, 2 * I, generator=g) * 6).to(torch.bfloat16)
    rows = torch.tensor([4, 0, 9, -1, 7, 4, 100], dtype=torch.int32)
    q = torch.full((R, I), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((R, I // 128), float("nan"))
    moe.swiglu_quant(h, rows, L, out=(q, s))
    named = [0, 4, 7]
    x = h[named].double()
    gate, up = x[:, :I].clamp(max=L), x[:, I:].clamp(-L, L)
    act = gate / (1 + torch.exp(-gate)) * up
    amax = act.unflatten(-1, (I // 128, 128)).abs().amax(-1).clamp(min=1e-4)
    torch.testing.assert_close(s[named].double(), amax / 448, rtol=2 ** -22, atol=0)
    scale = (amax / 448).repeat_interleave(128, -1)
    v = act / scale  # the e4m3 domain: 3 mantissa bits, normal from 2^-6 (below it the step stays 2^-9)
    step = 2.0 ** (torch.floor(torch.log2(v.abs().clamp(min=2 ** -6))) - 3) * scale
    err = (q[named].double() * s[named].double().repeat_interleave(128, -1) - act).abs()
    assert (err <= 0.5 * step * (1 + 2 ** -20)).all()
    others = [r for r in range(R) if r not in named]
    assert (q[others].view(torch.uint8) == 0x7F).all() and torch.isnan(s[others]).all()


def test_swiglu_quant_refuses_bad_input_naming_the_argument():
    h = torch.zeros(4, 512, dtype=torch.bfloat16)
    rows = torch.arange(4)
    with pytest.raises(ValueError, match="h must be a .R, 2I. tensor with I a multiple of 128"):
        moe.swiglu_quant(torch.zeros(4, 300, dtype=torch.bfloat16), rows)
    with pytest.raises(ValueError, match="h must be torch.bfloat16"):
        moe.swiglu_quant(h.float(), rows)
    with pytest.raises(ValueError, match="rows must be a 1-D int32 or int64"):
        moe.swiglu_quant(h, rows.float())
    with pytest.raises(ValueError, match="swiglu_limit must be a positive number"):
        moe.swiglu_quant(h, rows, -1.0)
    with pytest.raises(ValueError, match=r"out\[1\] must have shape \(4, 2\)"):
        moe.swiglu_quant(h, rows, out=(torch.empty(4, 256, dtype=torch.float8_e4m3fn), torch.empty(4, 3)))


def test_grouped_gemm_swiglu_is_the_gemm_then_swiglu_quant_with_the_layout_rules():
    """``grouped_gemm_swiglu_fp8`` (reference path): byte for byte GEMM1 then ``swiglu_quant`` on every row with an
    id; on a malformed layout NaN codes and scales exactly where the plain GEMM gives NaN rows; ``-1`` rows
    untouched."""
    g = torch.Generator().manual_seed(11)
    E, I, K = 3, 256, 256
    w13, s13 = moe.quantize_weight_blocks_reference(torch.randn(E, 2 * I, K, generator=g))
    layout = torch.full((512,), -1, dtype=torch.int32)
    layout[:10], layout[10:20], layout[129:140], layout[256:300], layout[384:390] = 0, 1, 2, 7, 2
    a, sa = moe.quantize_groups(torch.randn(512, K, generator=g))
    q = torch.full((512, I), 0x11, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((512, I // 128), -3.0)
    moe.grouped_gemm_swiglu_fp8(a, sa, w13, s13, layout, 10.0, out=(q, s))
    h = moe.grouped_gemm_fp8(a, sa, w13, s13, layout)
    nan_rows = torch.isnan(h).all(1) & (layout >= 0)
    # rows 10-19 (another expert than their tile's), 129-139 (a tile whose first row is -1), the tile of expert 7
    assert int(nan_rows.sum()) == 10 + 11 + 44
    assert torch.isnan(q[nan_rows].float()).all() and torch.isnan(s[nan_rows]).all()
    ok = (layout >= 0) & ~nan_rows
    rq, rs = moe.swiglu_quant(h, torch.nonzero(ok).flatten(), 10.0)
    assert torch.equal(q[ok].view(torch.uint8), rq[ok].view(torch.uint8)) and torch.equal(s[ok], rs[ok])
    assert (q[layout < 0].view(torch.uint8) == 0x11).all() and (s[layout < 0] == -3).all()


def test_grouped_gemm_swiglu_refuses_bad_input_naming_the_argument():
    w13, s13 = torch.zeros(2, 512, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 4, 2)
    a, sa, lay = torch.zeros(8, 256, dtype=torch.float8_e4m3fn), torch.ones(8, 2), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w13's rows \(2 x intermediate\) must be a multiple of 256"):
        moe.grouped_gemm_swiglu_fp8(a, sa, torch.zeros(2, 384, 256, dtype=torch.float8_e4m3fn),
                                    torch.ones(2, 3, 2), lay)
    with pytest.raises(ValueError, match="grouped_layout must be torch.int32"):
        moe.grouped_gemm_swiglu_fp8(a, sa, w13, s13, lay.long())
    with pytest.raises(ValueError, match=r"a_scale must have shape \(8, 2\)"):
        moe.grouped_gemm_swiglu_fp8(a, torch.ones(8, 3), w13, s13, lay)
    with pytest.raises(ValueError, match=r"out\[0\] must have shape \(8, 256\)"):
        moe.grouped_gemm_swiglu_fp8(a, sa, w13, s13, lay, out=(torch.empty(8, 512, dtype=torch.float8_e4m3fn),
                                                               torch.empty(8, 2)))
    with pytest.raises(ValueError, match="w13 must be float8_e4m3fn"):
        moe.grouped_gemm_swiglu_fp8(a, sa, torch.zeros(2, 512, 128, dtype=torch.uint8), torch.zeros(2, 512, 8,
                                                                                                      dtype=torch.uint8),
                                    lay)


def test_grouped_gemm_swiglu_masked_is_the_gemm_then_swiglu_quant():
    """``grouped_gemm_swiglu_fp8_masked`` (reference path): byte for byte the masked GEMM then ``swiglu_quant`` for
    the rows below each clamped count; other rows untouched; refusals name the argument."""
    g = torch.Generator().manual_seed(12)
    E, I, K, MM = 4, 256, 384, 9
    w13, s13 = moe.quantize_weight_blocks_reference(torch.randn(E, 2 * I, K, generator=g))
    a, sa = moe.quantize_groups(torch.randn(E, MM, K, generator=g))
    m = torch.tensor([3, 0, 12, -2], dtype=torch.int32)
    q = torch.full((E, MM, I), 0x11, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((E, MM, I // 128), -3.0)
    moe.grouped_gemm_swiglu_fp8_masked(a, sa, w13, s13, m, 10.0, out=(q, s))
    h = moe.grouped_gemm_fp8_masked(a, sa, w13, s13, m)
    rows = torch.arange(MM) < m.clamp(0, MM).unsqueeze(1)
    assert int(rows.sum()) == 3 + MM
    rq, rs = moe.swiglu_quant(h.view(E * MM, -1), torch.nonzero(rows.flatten()).flatten(), 10.0)
    assert torch.equal(q[rows].view(torch.uint8), rq.view(E, MM, -1)[rows].view(torch.uint8))
    assert torch.equal(s[rows], rs.view(E, MM, -1)[rows])
    assert (q[~rows].view(torch.uint8) == 0x11).all() and (s[~rows] == -3).all()
    with pytest.raises(ValueError, match="masked_m must be torch.int32"):
        moe.grouped_gemm_swiglu_fp8_masked(a, sa, w13, s13, m.long())
    with pytest.raises(ValueError, match=r"out\[1\] must have shape \(4, 9, 2\)"):
        moe.grouped_gemm_swiglu_fp8_masked(a, sa, w13, s13, m, out=(q, torch.empty(4, 9, 3)))



@pytest.mark.parametrize("path", ["torch", "pass", "fused"])
@pytest.mark.parametrize("fp4", [False, True])
def test_fused_experts_between_gemm_paths_agree_exactly(path, fp4, monkeypatch):
    """Each ``layer.SWIGLU_PATH`` (torch ops, one ``swiglu_quant`` pass, the epilogue-fused GEMM1; FP4 weights take
    the pass for "fused") gives exactly ``fused_experts_reference`` on the CPU path, both layouts, with a dropped
    choice and an expert map; a path name outside the list is refused."""
    from musa_attn_backend.kernels.moe import layer

    monkeypatch.setattr(layer, "SWIGLU_PATH", path)
    g = torch.Generator().manual_seed(21)
    E, H, I, T, k = 6, 256, 256, 23, 3
    quant = moe.quantize_fp4_reference if fp4 else moe.quantize_weight_blocks_reference
    w13, s13 = quant(torch.randn(E, 2 * I, H, generator=g) * 0.2)
    w2, s2 = quant(torch.randn(E, H, I, generator=g) * 0.2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, 8, generator=g).topk(k, 1).indices.to(torch.int32)
    ids[4, 1] = -1
    emap = torch.tensor([0, 1, -1, 2, 3, 4, -1, 5], dtype=torch.int32)
    w = torch.rand(T, k, generator=g)
    kw = dict(w13_scale=s13, w2_scale=s2, swiglu_limit=10.0, expert_map=emap)
    ref = moe.fused_experts_reference(x, w13, w2, w, ids, **kw)
    for lay in ("masked", "contiguous"):
        assert torch.equal(moe.fused_experts(x, w13, w2, w, ids, **kw, layout=lay), ref), lay
    monkeypatch.setattr(layer, "SWIGLU_PATH", "triton")
    with pytest.raises(ValueError, match="SWIGLU_PATH must be one of"):
        moe.fused_experts(x, w13, w2, w, ids, **kw)



def test_fp4_scales_as_float32_powers_of_two_are_the_ue8m0_bytes():
    """FP4 scales as float32 (SGLang's storage of the same powers of two) give exactly what their UE8M0 bytes give,
    in the dequantisation and in both layouts; other scale dtypes are refused naming the argument."""
    g = torch.Generator().manual_seed(13)
    E, N, K = 3, 256, 256
    packed, scale = moe.quantize_fp4_reference(torch.randn(E, N, K, generator=g))
    f32 = R.ue8m0_to_float(scale)
    assert torch.equal(R.dequantize_fp4(packed, scale), R.dequantize_fp4(packed, f32))
    a, sa = moe.quantize_groups(torch.randn(E, 7, K, generator=g))
    m = torch.tensor([7, 0, 3], dtype=torch.int32)
    outs = [moe.grouped_gemm_fp8_masked(a, sa, packed, s, m, torch.zeros(E, 7, N, dtype=torch.bfloat16))
            for s in (scale, f32)]
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().max() > 0
    layout = torch.tensor([0] * 100 + [-1] * 28 + [2] * 128, dtype=torch.int32)
    a, sa = moe.quantize_groups(torch.randn(256, K, generator=g))
    outs = [moe.grouped_gemm_fp8(a, sa, packed, s, layout, torch.zeros(256, N, dtype=torch.bfloat16))
            for s in (scale, f32)]
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="b_scale of FP4 weights must be uint8 .UE8M0 bytes. or float32"):
        moe.grouped_gemm_fp8(a, sa, packed, f32.double(), layout)


def test_combine_experts_against_float64_with_dropped_choices_and_unread_nan_rows():
    """``combine_experts`` (the reference on a CPU) against a float64 loop: each token's weighted sum of its named
    rows; a row index of -1 or past ``R`` adds nothing; the rows no choice names hold NaN and must not leak."""
    g = torch.Generator().manual_seed(11)
    R, H, T, k = 50, 256, 9, 4
    y = torch.randn(R, H, generator=g).to(torch.bfloat16)
    rows = torch.randint(0, R, (T, k), generator=g)
    rows[0, 1], rows[3, 0], rows[5, 3] = -1, R, R + 7
    named = torch.zeros(R, dtype=torch.bool)
    named[rows[(rows >= 0) & (rows < R)]] = True
    y[~named] = float("nan")
    w = torch.rand(T, k, generator=g)
    out = moe.combine_experts(y, rows.to(torch.int32), w)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            r = int(rows[t, j])
            if 0 <= r < R:
                want[t] += float(w[t, j]) * y[r].double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6)
    assert torch.equal(moe.combine_experts(y, rows, w.double()), out)  # int64 rows, float64 weights: the same


def test_combine_experts_refuses_bad_input_naming_the_argument():
    y = torch.zeros(10, 256, dtype=torch.bfloat16)
    rows, w = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    with pytest.raises(ValueError, match="y must be a .R, H. tensor with H a multiple of 128"):
        moe.combine_experts(torch.zeros(10, 200, dtype=torch.bfloat16), rows, w)
    with pytest.raises(ValueError, match="y must be torch.bfloat16"):
        moe.combine_experts(y.float(), rows, w)
    with pytest.raises(ValueError, match="rows must be a 2-D int32 or int64"):
        moe.combine_experts(y, rows.float(), w)
    with pytest.raises(ValueError, match=r"weights must be a floating \[3, 2\] tensor"):
        moe.combine_experts(y, rows, torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"out must have shape \(3, 256\)"):
        moe.combine_experts(y, rows, w, out=torch.empty(4, 256, dtype=torch.bfloat16))


def test_quantize_scatter_writes_each_tokens_quantised_row_to_its_choices():
    """``quantize_scatter`` (the reference on a CPU): every named row holds its token's ``quantize_groups`` row,
    codes and scales bit for bit; destinations of -1 or past ``rows`` are skipped; a token with every choice
    dropped writes nothing."""
    g = torch.Generator().manual_seed(12)
    T, H, k, rows = 7, 384, 3, 40
    x = (torch.randn(T, H, generator=g) * 5).to(torch.bfloat16)
    dest = torch.randperm(rows, generator=g)[:T * k].view(T, k)
    dest[1, 2], dest[4, 0] = -1, rows + 2
    dest[6] = -1
    a, sa = moe.quantize_scatter(x, dest.to(torch.int32), rows)
    assert a.shape == (rows, H) and sa.shape == (rows, H // 128) and a.dtype == torch.float8_e4m3fn
    q, s = moe.quantize_groups(x)
    for t in range(T):
        for j in range(k):
            r = int(dest[t, j])
            if 0 <= r < rows:
                assert torch.equal(a[r].view(torch.uint8), q[t].view(torch.uint8)) and torch.equal(sa[r], s[t])
    a64, sa64 = moe.quantize_scatter(x, dest, rows)  # int64 destinations: the same rows
    named = dest[(dest >= 0) & (dest < rows)]
    assert torch.equal(a64[named].view(torch.uint8), a[named].view(torch.uint8))


def test_quantize_scatter_refuses_bad_input_naming_the_argument():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    dest = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="x must be a .T, H. tensor with H a multiple of 128"):
        moe.quantize_scatter(torch.zeros(3, 200, dtype=torch.bfloat16), dest, 10)
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        moe.quantize_scatter(x.float(), dest, 10)
    with pytest.raises(ValueError, match=r"dest must be a 2-D int32 or int64 \[3, k\] tensor"):
        moe.quantize_scatter(x, dest.float(), 10)
    with pytest.raises(ValueError, match="rows must be an int"):
        moe.quantize_scatter(x, dest, -1)
