"""The TileLang MoE grouped GEMMs on the GPU against their float32 references (same FP8 operands, so the only
differences are float32 accumulation order and the bf16 rounding of the output): both layouts, the V4 expert
shapes, uniform, skewed and empty experts, one row to 16k tokens x top-6, malformed contiguous layouts (NaN rows),
and NaN-poisoned outputs (rows nobody writes stay NaN, every written row is finite)."""

import pytest
import torch

from musa_attn_backend.kernels import moe
from musa_attn_backend.kernels.moe.reference import ue8m0_to_float

pytestmark = pytest.mark.gpu

SHAPES = {"flash_gate_up": (4096, 4096), "flash_down": (4096, 2048), "pro_gate_up": (6144, 7168),
          "small": (256, 384)}


def weights(E, N, K, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(E, N, K, device=dev, generator=g, dtype=torch.bfloat16)
    return moe.quantize_weight_blocks_reference(w)


def absolute(t):
    """``|t|`` in ``t``'s format: FP8 exactly; packed E2M1 bytes with both sign bits cleared."""
    return t & 0x77 if t.dtype == torch.uint8 else t.float().abs().to(t.dtype)


def close(out, ref, rows, mag):
    """Written rows: ``|out - ref| <= 2^-6 |ref| + 2^-10 mag``, ``mag`` the same GEMM of the operands' absolute
    values (the sum of ``|a b|``). Both sides read the same FP8 values and sum in float32 in different orders, so
    their bf16 roundings can land a unit apart (a unit is at most 2^-7 relative; at a power of two the two sides
    round into different binades). The second term is the accumulation error: Hopper's FP8 tensor cores add with
    about 14 bits of mantissa inside each 128-wide K step, which shows where the sum cancels to near zero. A wrong
    scale, row, expert or K step is off by a large part of ``mag``."""
    o, r, m = out[rows].float(), ref[rows].float(), mag[rows].float()
    assert torch.isfinite(o).all()
    bound = 2 ** -6 * r.abs() + 2 ** -10 * m
    bad = (o - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off; worst {float((o - r).abs().max())}"


def close_quantised(q, s, rq, rs, slack=0.0):
    """GEMM2 inputs from an epilogue-fused GEMM1 against the reference's, on the same rows. Both sides round ``h``
    to bf16 from float32 sums in different orders (a unit apart at most, more where Hopper's FP8 accumulation
    meets cancellation), so: scales within 2^-6, and each dequantised value within a quarter of the reference's
    plus 2^-8 of its group's amax plus ``slack`` (:func:`swiglu_slack`: that accumulation error carried through
    the SwiGLU) (an e4m3 step is 2^-3 relative; a wrong row, expert, half or scale is off by far more), and
    relative L2 error below 2^-6."""
    torch.testing.assert_close(s, rs, rtol=2 ** -6, atol=0)
    deq = (q.float().unflatten(-1, (-1, 128)) * s.unsqueeze(-1)).flatten(-2)
    ref = (rq.float().unflatten(-1, (-1, 128)) * rs.unsqueeze(-1)).flatten(-2)
    bound = 0.25 * ref.abs() + 2 ** -8 * (rs * 448).repeat_interleave(128, -1) + slack
    bad = (deq - ref).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off; worst {float((deq - ref).abs().max())}"
    assert float((deq - ref).norm() / ref.norm()) < 2 ** -6


def swiglu_slack(h, mag, limit):
    """The bound :func:`close`'s accumulation term (2^-10 of the GEMM of absolute values, ``mag``) gives GEMM1's
    ``h = [gate | up]``, carried through ``silu(min(gate, L)) * clamp(up, -L, L)`` to first order: the clamps pass
    at most the error they get, silu's slope is below 1.1, so ``1.1 |up| e_gate + |silu(gate)| e_up``. Where
    gate cancels to near zero against a large ``mag`` and ``up`` is large (Flash and Pro's K of 4096 and 7168),
    this is the one term that covers the fused GEMM summing in another order than the reference."""
    h, mag = h.float(), mag.float()
    I = h.shape[-1] // 2
    gate, up = h[..., :I], h[..., I:]
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return 2 ** -10 * (1.1 * up.abs() * mag[..., :I] + torch.nn.functional.silu(gate).abs() * mag[..., I:])


def routing(T, k, E, skew, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most choices on a few experts, some experts empty
        p = torch.rand(E, generator=g) ** 6
        p[: E // 4] = 0
        ids = torch.multinomial(p.expand(T, E), k, replacement=False, generator=g)
    else:
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    return ids.to(torch.int32).to(dev)


@pytest.mark.parametrize("shape,T,E,skew", [("small", 1, 8, False), ("small", 333, 8, True),
                                            ("flash_gate_up", 64, 256, False), ("flash_down", 512, 256, True),
                                            ("flash_gate_up", 4096, 256, False), ("pro_gate_up", 300, 32, False),
                                            ("small", 16384, 64, False)])
def test_contiguous_matches_reference(gpu_device, shape, T, E, skew):
    N, K = SHAPES[shape]
    k = 6
    b, sb = weights(E, N, K, gpu_device)
    row_src, layout = moe.align_routing(routing(T, k, E, skew, gpu_device), E)
    x = torch.randn(T, K, device=gpu_device, dtype=torch.bfloat16)
    xs = x[(row_src.clamp(min=0) // k).long()]
    a, sa = moe.quantize_groups(xs)
    out = torch.full((layout.numel(), N), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, b, sb, layout, out, impl="tilelang")
    ref = moe.grouped_gemm_contiguous_reference(a, sa, b, sb, layout)
    mag = moe.grouped_gemm_contiguous_reference(absolute(a), sa, absolute(b), sb, layout)
    rows = layout >= 0
    close(out, ref, rows, mag)
    assert torch.isnan(out[~rows]).all()


PERSISTENT = dict(policy="FullRow", persistent=132)  # the persistent form (TileLang 0.1.15), one block an H100/H200 SM


def _needs_persistent(tiling):
    from musa_attn_backend.kernels.moe import tilelang_impl

    if tiling.get("persistent") and tilelang_impl._tl_version() < (0, 1, 15):
        pytest.skip("the persistent contiguous program needs TileLang >= 0.1.15")


@pytest.mark.parametrize("tiling", [{}, PERSISTENT])
def test_contiguous_malformed_layout_gives_nan_rows(gpu_device, tiling, monkeypatch):
    from musa_attn_backend.kernels.moe import tilelang_impl

    _needs_persistent(tiling)
    monkeypatch.setattr(tilelang_impl, "CONTIGUOUS", {**tilelang_impl.CONTIGUOUS, **tiling})
    E, N, K = 3, 256, 256
    b, sb = weights(E, N, K, gpu_device)
    layout = torch.full((512,), -1, dtype=torch.int32)
    layout[:10], layout[10:20], layout[129:140], layout[256:300], layout[384:390] = 0, 1, 2, 7, 2
    layout = layout.to(gpu_device)
    a, sa = moe.quantize_groups(torch.randn(512, K, device=gpu_device))
    out = torch.zeros(512, N, device=gpu_device, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, b, sb, layout, out, impl="tilelang")
    ref = moe.grouped_gemm_contiguous_reference(a, sa, b, sb, layout,
                                                torch.zeros(512, N, device=gpu_device, dtype=torch.bfloat16))
    nan_o, nan_r = torch.isnan(out).all(1), torch.isnan(ref).all(1)
    assert torch.equal(nan_o, nan_r) and int(nan_r.sum()) == 10 + 11 + 44
    assert torch.equal(out[~nan_r & (layout < 0)], ref[~nan_r & (layout < 0)])  # untouched zeros
    mag = moe.grouped_gemm_contiguous_reference(absolute(a), sa, absolute(b), sb, layout)
    close(out, ref, (layout >= 0) & ~nan_r, mag)


@pytest.mark.parametrize("musa_forms", [False, True])  # MUSA's form: 256 threads (docs/musa.md)
@pytest.mark.parametrize("shape,E,max_m,counts", [("small", 8, 5, "random"), ("flash_gate_up", 256, 64, "decode"),
                                                  ("flash_down", 256, 128, "random"), ("pro_gate_up", 16, 200, "big")])
def test_masked_matches_reference(gpu_device, use_settings, shape, E, max_m, counts, musa_forms):
    use_settings(musa_forms=musa_forms)
    N, K = SHAPES[shape]
    b, sb = weights(E, N, K, gpu_device, seed=1)
    g = torch.Generator().manual_seed(E)
    if counts == "decode":  # one decode step of 8 tokens x top-6: most experts empty
        m = torch.bincount(torch.rand(8, E, generator=g).topk(6, 1).indices.flatten(), minlength=E)
    elif counts == "big":
        m = torch.tensor([max_m + 50, 0, -3] + [max_m] * (E - 3))  # clamped to [0, max_m]
    else:
        m = torch.randint(0, max_m + 1, (E,), generator=g)
    m = m.to(torch.int32).to(gpu_device)
    a, sa = moe.quantize_groups(torch.randn(E, max_m, K, device=gpu_device))
    out = torch.full((E, max_m, N), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8_masked(a, sa, b, sb, m, out, impl="tilelang")
    ref = moe.grouped_gemm_masked_reference(a, sa, b, sb, m)
    mag = moe.grouped_gemm_masked_reference(absolute(a), sa, absolute(b), sb, m)
    rows = torch.arange(max_m, device=gpu_device).view(1, -1) < m.clamp(0, max_m).view(-1, 1)
    close(out, ref, rows, mag)
    assert torch.isnan(out[~rows]).all()


@pytest.mark.parametrize("T,layout,mapped", [(1, "masked", False), (64, "masked", True), (65, "contiguous", False),
                                             (2000, "contiguous", True)])
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("path", ["torch", "pass", "fused"])
def test_fused_experts_matches_reference(gpu_device, T, layout, mapped, fp4, path, monkeypatch):
    """The layer op (routing, both GEMMs, clamped SwiGLU, the weighted sum) against its float32 reference, V4-Flash
    widths with 32 local experts, each between-GEMM path (``layer.SWIGLU_PATH``): relative L2 error below 1e-2 (an
    activation near an FP8 rounding boundary can round the other way on either side), every output finite, the
    whole ``out`` written."""
    from musa_attn_backend.kernels.moe import layer as moe_layer

    monkeypatch.setattr(moe_layer, "SWIGLU_PATH", path)
    E, H, I, k = 32, 4096, 2048, 6
    if fp4:  # MXFP4 experts (the conversion in the kernel)
        g4 = torch.Generator(device=gpu_device).manual_seed(2)
        w13, s13 = moe.quantize_fp4_reference(torch.randn(E, 2 * I, H, device=gpu_device, generator=g4) / 64)
        w2, s2 = moe.quantize_fp4_reference(torch.randn(E, H, I, device=gpu_device, generator=g4) / 64)
    else:
        w13, s13 = weights(E, 2 * I, H, gpu_device, seed=2)
        w2, s2 = weights(E, H, I, gpu_device, seed=3)
        s13 /= 64  # keep the activations of order one
        s2 /= 64
    n_global = 64 if mapped else E
    g = torch.Generator().manual_seed(T)
    ids = torch.rand(T, n_global, generator=g).topk(k, 1).indices.to(torch.int32).to(gpu_device)
    emap = None
    if mapped:  # half the global experts on this rank
        emap = torch.full((n_global,), -1, dtype=torch.int32)
        emap[torch.randperm(n_global, generator=g)[:E]] = torch.arange(E, dtype=torch.int32)
        emap = emap.to(gpu_device)
    w = torch.rand(T, k, generator=g).to(gpu_device)
    x = torch.randn(T, H, device=gpu_device, dtype=torch.bfloat16)
    out = torch.full((T, H), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    args = (x, w13, w2, w, ids)
    kw = dict(w13_scale=s13, w2_scale=s2, swiglu_limit=10.0, expert_map=emap)
    moe.fused_experts(*args, **kw, out=out, layout=layout, impl="tilelang")
    ref = moe.fused_experts_reference(*args, **kw)
    assert torch.isfinite(out).all()
    rel = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert rel < 1e-2, rel


# the FP4 conversion forms (tilelang_impl's packing) and, for FP8 tensor cores, the spans of 32 values a K step
FP4_FORMS = [("bytes", 1), ("words", 1), ("fp8", 1), ("fp8", 2), ("fp8", 4)]


@pytest.mark.parametrize("shape,E,max_m", [("small", 8, 5), ("flash_gate_up", 32, 64), ("pro_gate_up", 8, 130)])
@pytest.mark.parametrize("scales", ["ue8m0", "float32"])
@pytest.mark.parametrize("packing,spans", FP4_FORMS)
def test_masked_fp4_matches_reference(gpu_device, shape, E, max_m, scales, packing, spans, monkeypatch):
    # spans 1 is MUSA's form (whole tiles as GEMM operands: docs/musa.md)
    """FP4 (MXFP4) experts converted in the kernel: the same bound as FP8 (the conversion is exact); the scales as
    UE8M0 bytes or as float32 powers of two (SGLang's storage); every conversion form (``packing``: to bf16 by
    bytes or words, or to e4m3 for FP8 tensor cores, 32, 64 or 128 values of K a step: ``spans``)."""
    from musa_attn_backend.kernels.moe import tilelang_impl

    monkeypatch.setitem(tilelang_impl.MASKED_FP4, "packing", packing)
    monkeypatch.setitem(tilelang_impl.MASKED_FP4_FP8, "spans", spans)
    N, K = SHAPES[shape]
    g = torch.Generator(device=gpu_device).manual_seed(4)
    packed, scale = moe.quantize_fp4_reference(torch.randn(E, N, K, device=gpu_device, generator=g,
                                                           dtype=torch.bfloat16))
    if scales == "float32":
        scale = ue8m0_to_float(scale)
    m = torch.randint(0, max_m + 1, (E,), device=gpu_device, generator=g).to(torch.int32)
    a, sa = moe.quantize_groups(torch.randn(E, max_m, K, device=gpu_device))
    out = torch.full((E, max_m, N), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8_masked(a, sa, packed, scale, m, out, impl="tilelang")
    ref = moe.grouped_gemm_masked_reference(a, sa, packed, scale, m)
    mag = moe.grouped_gemm_masked_reference(absolute(a), sa, absolute(packed), scale, m)
    rows = torch.arange(max_m, device=gpu_device).view(1, -1) < m.view(-1, 1)
    close(out, ref, rows, mag)
    assert torch.isnan(out[~rows]).all()


@pytest.mark.parametrize("shape,T,E,scales", [("small", 333, 8, "ue8m0"), ("flash_gate_up", 512, 32, "ue8m0"),
                                              ("small", 333, 8, "float32")])
@pytest.mark.parametrize("packing,spans", FP4_FORMS)
def test_contiguous_fp4_matches_reference(gpu_device, shape, T, E, scales, packing, spans, monkeypatch):
    from musa_attn_backend.kernels.moe import tilelang_impl

    monkeypatch.setitem(tilelang_impl.CONTIGUOUS_FP4, "packing", packing)
    monkeypatch.setitem(tilelang_impl.CONTIGUOUS_FP4_FP8, "spans", spans)
    N, K = SHAPES[shape]
    g = torch.Generator(device=gpu_device).manual_seed(5)
    packed, scale = moe.quantize_fp4_reference(torch.randn(E, N, K, device=gpu_device, generator=g))
    if scales == "float32":
        scale = ue8m0_to_float(scale)
    row_src, layout = moe.align_routing(routing(T, 6, E, True, gpu_device), E)
    a, sa = moe.quantize_groups(torch.randn(T, K, device=gpu_device)[(row_src.clamp(min=0) // 6).long()])
    out = torch.full((layout.numel(), N), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, packed, scale, layout, out, impl="tilelang")
    ref = moe.grouped_gemm_contiguous_reference(a, sa, packed, scale, layout)
    mag = moe.grouped_gemm_contiguous_reference(absolute(a), sa, absolute(packed), scale, layout)
    close(out, ref, layout >= 0, mag)
    assert torch.isnan(out[layout < 0]).all()


@pytest.mark.parametrize("T,layout", [(8, "masked"), (200, "contiguous")])
@pytest.mark.parametrize("path", ["torch", "pass", "fused"])
def test_fused_experts_is_captured_in_a_cuda_graph(gpu_device, T, layout, path, monkeypatch):
    """No host synchronisation on either layout (``torch.cuda.set_sync_debug_mode("error")`` while it runs), and
    a CUDA graph of the whole op, replayed on new routing written into the captured buffers, gives the eager
    result."""
    from musa_attn_backend.kernels.moe import layer as moe_layer

    monkeypatch.setattr(moe_layer, "SWIGLU_PATH", path)
    E, H, I, k = 16, 512, 256, 6
    w13, s13 = weights(E, 2 * I, H, gpu_device, seed=6)
    w2, s2 = weights(E, H, I, gpu_device, seed=7)
    s13 /= 16
    s2 /= 16
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, device=gpu_device, dtype=torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, 1).indices.to(torch.int32).to(gpu_device)
    w = torch.rand(T, k, generator=g).to(gpu_device)
    out = torch.empty(T, H, device=gpu_device, dtype=torch.bfloat16)
    run = lambda: moe.fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, swiglu_limit=10.0,  # noqa: E731
                                    out=out, layout=layout, impl="tilelang")
    run()  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    ids.copy_(torch.rand(T, E, generator=g).topk(k, 1).indices.to(torch.int32))
    x.copy_(torch.randn(T, H, device=gpu_device, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    run()
    assert torch.equal(replayed, out)


@pytest.mark.parametrize("tiling", [dict(policy="FullRow"), dict(policy="FullRow", num_stages=3),
                                    dict(policy="FullRow", swizzle=8), PERSISTENT, dict(PERSISTENT, num_stages=3)])
@pytest.mark.parametrize("shape,T,E", [("small", 333, 8), ("flash_down", 2048, 256)])
def test_contiguous_tilings_match_reference(gpu_device, tiling, shape, T, E):
    """The contiguous program under the other tilings ``bench_moe.py --tiling`` measures (one m64n128 WGMMA a
    k-slice; three stages), before any of them becomes the default."""
    from musa_attn_backend.kernels.moe import tilelang_impl

    _needs_persistent(tiling)
    N, K = SHAPES[shape]
    b, sb = weights(E, N, K, gpu_device, seed=3)
    row_src, layout = moe.align_routing(routing(T, 6, E, True, gpu_device, seed=3), E)
    x = torch.randn(T, K, device=gpu_device, dtype=torch.bfloat16)
    a, sa = moe.quantize_groups(x[(row_src.clamp(min=0) // 6).long()])
    out = torch.full((layout.numel(), N), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    tilelang_impl.contiguous_kernel(N, K, **tiling)(a, sa, b, sb, layout, out)
    ref = moe.grouped_gemm_contiguous_reference(a, sa, b, sb, layout)
    mag = moe.grouped_gemm_contiguous_reference(absolute(a), sa, absolute(b), sb, layout)
    rows = layout >= 0
    close(out, ref, rows, mag)
    assert torch.isnan(out[~rows]).all()


@pytest.mark.parametrize("I,limit", [(2048, 10.0), (3072, None), (128, 10.0)])
def test_swiglu_quant_matches_reference(gpu_device, I, limit):
    """The TileLang SwiGLU + 1 x 128 quantisation against the reference path on the same GPU: scales within one
    float32 unit, bytes equal but for values on an e4m3 rounding boundary (the kernel's exponential is not torch's
    to the last bit; then one e4m3 step, on at most 1 in 10^4 values); indices outside the rows skipped, rows no
    index names left NaN."""
    R = 3000
    g = torch.Generator(device=gpu_device).manual_seed(I)
    h = (torch.randn(R, 2 * I, device=gpu_device, generator=g) * 6).to(torch.bfloat16)
    rows = torch.randperm(R, device=gpu_device, generator=g)[:2000].to(torch.int32)
    rows[::97] = R  # a dropped choice's spare row
    rows[5] = -1
    poison = lambda: (torch.full((R, I), 0x7F, dtype=torch.uint8, device=gpu_device).view(torch.float8_e4m3fn),  # noqa: E731
                      torch.full((R, I // 128), float("nan"), device=gpu_device))
    q, s = moe.swiglu_quant(h, rows, limit, out=poison(), impl="tilelang")
    rq, rs = moe.swiglu_quant(h, rows, limit, out=poison(), impl="reference")
    named = torch.zeros(R, dtype=torch.bool, device=gpu_device)
    named[rows[(rows >= 0) & (rows < R)].long()] = True
    assert (q[~named].view(torch.uint8) == 0x7F).all() and torch.isnan(s[~named]).all()
    torch.testing.assert_close(s[named], rs[named], rtol=2 ** -23, atol=0)
    a, b = q[named].view(torch.uint8), rq[named].view(torch.uint8)
    differ = a != b
    assert int(differ.sum()) <= max(1, a.numel() // 10 ** 4), int(differ.sum())
    # one e4m3 step: neighbouring codes of the same sign
    assert ((a[differ].int() - b[differ].int()).abs() == 1).all()


@pytest.mark.parametrize("model,T,E,skew,limit", [("flash", 512, 256, True, 10.0), ("small", 333, 8, False, None),
                                                  ("pro", 300, 32, False, 10.0), ("small", 16384, 64, False, 10.0)])
def test_gemm_swiglu_matches_reference(gpu_device, model, T, E, skew, limit):
    """GEMM1 with the SwiGLU and quantisation epilogue against the plain GEMM's reference through the SwiGLU
    reference (the bounds: :func:`close_quantised`); padding rows untouched (NaN poison)."""
    I, H = {"flash": (2048, 4096), "pro": (3072, 7168), "small": (256, 384)}[model]
    k = 6
    w13, s13 = weights(E, 2 * I, H, gpu_device, seed=9)
    row_src, layout = moe.align_routing(routing(T, k, E, skew, gpu_device, seed=9), E)
    x = torch.randn(T, H, device=gpu_device, dtype=torch.bfloat16)
    a, sa = moe.quantize_groups(x[(row_src.clamp(min=0) // k).long()])
    M = layout.numel()
    q = torch.full((M, I), 0x7F, dtype=torch.uint8, device=gpu_device).view(torch.float8_e4m3fn)
    s = torch.full((M, I // 128), float("nan"), device=gpu_device)
    moe.grouped_gemm_swiglu_fp8(a, sa, w13, s13, layout, limit, out=(q, s), impl="tilelang")
    rq, rs = moe.grouped_gemm_swiglu_contiguous_reference(a, sa, w13, s13, layout, limit)
    rows = layout >= 0
    assert torch.isnan(s[~rows]).all() and (q[~rows].view(torch.uint8) == 0x7F).all()
    assert torch.isfinite(s[rows]).all()
    h = moe.grouped_gemm_contiguous_reference(a, sa, w13, s13, layout)[rows]
    mag = moe.grouped_gemm_contiguous_reference(absolute(a), sa, absolute(w13), s13, layout)[rows]
    close_quantised(q[rows], s[rows], rq[rows], rs[rows], swiglu_slack(h, mag, limit))


def test_gemm_swiglu_malformed_layout_gives_nan_rows(gpu_device):
    E, I, K = 3, 256, 256
    w13, s13 = weights(E, 2 * I, K, gpu_device, seed=4)
    layout = torch.full((512,), -1, dtype=torch.int32)
    layout[:10], layout[10:20], layout[129:140], layout[256:300], layout[384:390] = 0, 1, 2, 7, 2
    layout = layout.to(gpu_device)
    a, sa = moe.quantize_groups(torch.randn(512, K, device=gpu_device))
    q = torch.zeros(512, I, dtype=torch.float8_e4m3fn, device=gpu_device)
    s = torch.zeros(512, I // 128, device=gpu_device)
    moe.grouped_gemm_swiglu_fp8(a, sa, w13, s13, layout, 10.0, out=(q, s), impl="tilelang")
    rq, rs = moe.grouped_gemm_swiglu_contiguous_reference(a, sa, w13, s13, layout, 10.0)
    nan_r = torch.isnan(rs).all(1) & (layout >= 0)
    assert int(nan_r.sum()) == 10 + 11 + 44
    assert torch.isnan(s[nan_r]).all() and torch.isnan(q[nan_r].float()).all()
    assert (s[layout < 0] == 0).all() and (q[layout < 0].float() == 0).all()
    ok = (layout >= 0) & ~nan_r
    torch.testing.assert_close(s[ok], rs[ok], rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("model,E,max_m,limit", [("flash", 256, 64, 10.0), ("small", 8, 200, None),
                                                 ("pro", 16, 130, 10.0)])
def test_gemm_swiglu_masked_matches_reference(gpu_device, model, E, max_m, limit):
    """The masked epilogue-fused GEMM1 against the reference (:func:`close_quantised`); rows at or past
    ``masked_m[e]`` untouched (NaN poison), including an empty expert, a full one and a count past ``max_m``."""
    I, H = {"flash": (2048, 4096), "pro": (3072, 7168), "small": (256, 384)}[model]
    w13, s13 = weights(E, 2 * I, H, gpu_device, seed=8)
    g = torch.Generator().manual_seed(max_m)
    m = torch.randint(0, max_m + 1, (E,), generator=g)
    m[0], m[1], m[2] = 0, max_m, max_m + 7
    m = m.to(torch.int32).to(gpu_device)
    a, sa = moe.quantize_groups(torch.randn(E, max_m, H, device=gpu_device, dtype=torch.bfloat16))
    q = torch.full((E, max_m, I), 0x7F, dtype=torch.uint8, device=gpu_device).view(torch.float8_e4m3fn)
    s = torch.full((E, max_m, I // 128), float("nan"), device=gpu_device)
    moe.grouped_gemm_swiglu_fp8_masked(a, sa, w13, s13, m, limit, out=(q, s), impl="tilelang")
    rq, rs = moe.grouped_gemm_swiglu_masked_reference(a, sa, w13, s13, m, limit)
    rows = torch.arange(max_m, device=gpu_device) < m.clamp(0, max_m).unsqueeze(1)
    assert torch.isnan(s[~rows]).all() and (q[~rows].view(torch.uint8) == 0x7F).all()
    h = moe.grouped_gemm_masked_reference(a, sa, w13, s13, m)[rows]
    mag = moe.grouped_gemm_masked_reference(absolute(a), sa, absolute(w13), s13, m)[rows]
    close_quantised(q[rows], s[rows], rq[rows], rs[rows], swiglu_slack(h, mag, limit))


@pytest.mark.parametrize("T,H,R", [(1, 4096, 200), (333, 7168, 2500), (3000, 4096, 18000)])
def test_combine_experts_matches_reference(gpu_device, T, H, R):
    """The weighted sum program against the torch reference: within one bf16 rounding (both sum in float32 in
    choice order; the program may fuse each multiply-add); choices of -1 and past ``R`` add nothing; the rows no
    choice names hold NaN and must not leak; every token written."""
    k = 6
    g = torch.Generator(device=gpu_device).manual_seed(T)
    y = torch.randn(R, H, device=gpu_device, generator=g).to(torch.bfloat16)
    rows = torch.randint(0, R, (T, k), device=gpu_device, generator=g, dtype=torch.int32)
    drop = torch.rand(T, k, device=gpu_device, generator=g) < 0.1
    rows = torch.where(drop, torch.where(torch.rand(T, k, device=gpu_device, generator=g) < 0.5, -1, R + 3), rows)
    named = torch.zeros(R + 1, dtype=torch.bool, device=gpu_device)
    named[torch.where((rows >= 0) & (rows < R), rows, R).long().flatten()] = True
    y[~named[:R]] = float("nan")
    w = torch.rand(T, k, device=gpu_device, generator=g)
    out = torch.full((T, H), float("nan"), device=gpu_device, dtype=torch.bfloat16)
    moe.combine_experts(y, rows, w, out, impl="tilelang")
    ref = moe.combine_reference(y, rows, w)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("T,layout,mapped", [(8, "masked", True), (2000, "contiguous", True)])
def test_fused_experts_with_the_glue_programs(gpu_device, T, layout, mapped, monkeypatch):
    """The layer op with the TileLang glue (``layer.GLUE_KERNELS``: the quantise-and-scatter and the weighted sum),
    same bounds as with the torch glue."""
    from musa_attn_backend.kernels.moe import layer as moe_layer

    monkeypatch.setattr(moe_layer, "GLUE_KERNELS", True)
    test_fused_experts_matches_reference(gpu_device, T, layout, mapped, False, "pass", monkeypatch)


@pytest.mark.parametrize("T,H,k,rows", [(1, 4096, 6, 300), (333, 7168, 6, 5000), (4000, 4096, 8, 40000)])
def test_quantize_scatter_matches_reference(gpu_device, T, H, k, rows):
    """The quantise-and-scatter program against the reference on every named row, bit for bit (the same IEEE
    divisions, the reference run on the CPU; the amax is exact): codes and scales; a destination of -1 or past ``rows`` skipped; rows no
    destination names untouched (poisoned before, poisoned after)."""
    g = torch.Generator(device=gpu_device).manual_seed(T)
    x = (torch.randn(T, H, device=gpu_device, generator=g) * 3).to(torch.bfloat16)
    perm = torch.randperm(rows, device=gpu_device, generator=g)[:T * k].view(T, k).to(torch.int32)
    drop = torch.rand(T, k, device=gpu_device, generator=g) < 0.1
    dest = torch.where(drop, torch.where(torch.rand(T, k, device=gpu_device, generator=g) < 0.5, -1, rows + 5), perm)
    from musa_attn_backend.kernels.moe import tilelang_impl

    a = torch.full((rows, H), 0x7F, dtype=torch.uint8, device=gpu_device).view(torch.float8_e4m3fn)
    sa = torch.full((rows, H // 128), float("nan"), device=gpu_device)
    tilelang_impl.quantize_scatter_kernel(H, k)(x, dest.to(torch.int32), a, sa)
    # the reference on the CPU: torch on CUDA divides by a Python scalar as a multiplication by its reciprocal
    # (the scale, amax / 448, one float32 unit off), on the CPU by an IEEE division, as the program does
    ra, rsa = (t.to(gpu_device) for t in moe.quantize_scatter_reference(x.cpu(), dest.cpu(), rows))
    named = torch.zeros(rows + 1, dtype=torch.bool, device=gpu_device)
    named[torch.where((dest >= 0) & (dest < rows), dest, rows).long().flatten()] = True
    named = named[:rows]
    assert int(named.sum()) > 0.8 * T * k
    assert torch.equal(a[named].view(torch.uint8), ra[named].view(torch.uint8))
    assert torch.equal(sa[named], rsa[named])
    assert (a[~named].view(torch.uint8) == 0x7F).all() and torch.isnan(sa[~named]).all()
    qa, qsa = moe.quantize_scatter(x, dest, rows, impl="tilelang")  # the op: fresh buffers, same named rows
    assert torch.equal(qa[named].view(torch.uint8), ra[named].view(torch.uint8)) and torch.equal(qsa[named], rsa[named])


@pytest.mark.parametrize("T,ids_dtype,weights_dtype,mapped", [(1, torch.int32, torch.float32, False),
                                                              (7, torch.int64, torch.bfloat16, True),
                                                              (300, torch.int32, torch.float32, True),
                                                              (1000, torch.int64, torch.float32, False)])
def test_route_masked_program_matches_reference(gpu_device, T, ids_dtype, weights_dtype, mapped):
    """The one-launch routing (``route_masked_kernel.py``) against the torch rule: the same slots and counts, the
    merged weights within float32 rounding (summed in choice order), on routings with repeated experts, negative
    ids, ids past the map or the local range, experts of other ranks, and more choices than one chunk of threads
    (T 300, 1000: several chunks; counts carried between them)."""
    g = torch.Generator(device=gpu_device).manual_seed(T)
    E, k = 256, 6
    ids = torch.randint(-3, 300 if mapped else 270, (T, k), device=gpu_device, generator=g).to(ids_dtype)
    ids[0, 1:] = ids[0, 0]  # one token naming one expert six times
    weights = torch.rand(T, k, device=gpu_device, generator=g).to(weights_dtype)
    emap = None
    if mapped:
        emap = torch.randint(-1, E, (288,), device=gpu_device, generator=g, dtype=torch.int32)
    slot, merged, counts = moe.route_masked(ids, weights, E, emap, impl="tilelang")
    rs, rm, rc = moe.route_masked_reference(ids, weights, E, emap)
    assert torch.equal(slot.long(), rs.long()) and torch.equal(counts, rc)
    torch.testing.assert_close(merged, rm, rtol=1e-6, atol=1e-6)
    # not vacuous: most choices land in a slot (token 0's six choices of one expert merge into one slot, so the
    # one-token case has exactly one)
    kept = int((slot < E * T).sum())
    assert (kept == 1 if T == 1 else kept > 0.5 * T * k) and int(counts.sum()) == kept


@pytest.mark.parametrize("T,mapped", [(1, False), (64, True)])
def test_fused_experts_with_the_route_program(gpu_device, T, mapped, monkeypatch):
    """The masked layer with its routing in one launch (``layer.ROUTE_KERNEL``), same bounds as with torch's."""
    from musa_attn_backend.kernels.moe import layer as moe_layer

    monkeypatch.setattr(moe_layer, "ROUTE_KERNEL", True)
    test_fused_experts_matches_reference(gpu_device, T, "masked", mapped, False, "pass", monkeypatch)
