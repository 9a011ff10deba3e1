"""The MoE grouped-GEMM programs: the launch glue against the programs' signatures (built, not compiled), both
GEMM operands in shared memory (what MUSA MP31 lowers), the lowering for sm_90a (TMA loads, FP8 warp-group MMA),
the refusal on a target without FP8, and real sm_90a builds with nvcc."""

import pytest
import torch

from musa_attn_backend import _tilelang
from musa_attn_backend.kernels import moe
from musa_attn_backend.kernels._tir import gemm_operands
from musa_attn_backend.kernels.moe import tilelang_impl as ti
from musa_attn_backend.kernels.moe.contiguous_fp4_fp8_kernel import build_grouped_gemm_contiguous_fp4_fp8
from musa_attn_backend.kernels.moe.contiguous_kernel import build_grouped_gemm_contiguous_fp4
from musa_attn_backend.kernels.moe.contiguous_kernel import build_grouped_gemm_contiguous
from musa_attn_backend.kernels.moe.contiguous_swiglu_kernel import build_grouped_gemm_swiglu_contiguous as _swiglu_gemm
from musa_attn_backend.kernels.moe.masked_fp4_fp8_kernel import build_grouped_gemm_masked_fp4_fp8
from musa_attn_backend.kernels.moe.masked_kernel import build_grouped_gemm_masked_fp4
from musa_attn_backend.kernels.moe.masked_kernel import build_grouped_gemm_masked
from musa_attn_backend.kernels.moe.masked_swiglu_kernel import build_grouped_gemm_swiglu_masked as _swiglu_masked
from musa_attn_backend.testing.toolchain import HOPPER, in_ci, nvcc_path

TORCH_OF = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "int64": torch.int64,
            "uint8": torch.uint8,
            "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}


def _signature_check(func, args):
    params = list(func.params)
    assert len(args) == len(params)
    for p, a in zip(params, args):
        buf = func.buffer_map[p]
        assert a.dtype == TORCH_OF[str(buf.dtype)], (buf.name, a.dtype, buf.dtype)
        assert a.dim() == len(buf.shape), buf.name
        static = [int(s) if hasattr(s, "value") or isinstance(s, int) else None for s in buf.shape]
        assert all(s is None or s == d for s, d in zip(static, a.shape)), (buf.name, static, a.shape)


def test_launch_glue_matches_the_programs(use_settings):
    use_settings(target="sm_90a")
    E, N, K, M = 4, 256, 384, 300
    b = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
    sb = torch.ones(E, 2, 3)
    a, sa = torch.zeros(M, K, dtype=torch.float8_e4m3fn), torch.ones(M, 3)
    calls = []

    def capture(key, build, target, pass_configs):
        func = build()
        return lambda *args: calls.append((key[0], func, args))

    with _tilelang.intercepting(capture):
        ti.grouped_gemm_contiguous_tilelang(a, sa, b, sb, torch.zeros(M, dtype=torch.int32),
                                            torch.empty(M, N, dtype=torch.bfloat16))
        ti.grouped_gemm_masked_tilelang(torch.zeros(E, 7, K, dtype=b.dtype),
                                        torch.ones(E, 7, 3), b, sb, torch.zeros(E, dtype=torch.int32),
                                        torch.empty(E, 7, N, dtype=torch.bfloat16))
        ti.grouped_gemm_masked_tilelang(torch.zeros(E, 7, K, dtype=b.dtype), torch.ones(E, 7, 3),
                                        torch.zeros(E, N, K // 2, dtype=torch.uint8),
                                        torch.zeros(E, N, K // 32, dtype=torch.uint8), torch.zeros(E, dtype=torch.int32),
                                        torch.empty(E, 7, N, dtype=torch.bfloat16), fp4=True)
        ti.grouped_gemm_contiguous_tilelang(a, sa, torch.zeros(E, N, K // 2, dtype=torch.uint8),
                                            torch.zeros(E, N, K // 32, dtype=torch.uint8),
                                            torch.zeros(M, dtype=torch.int32), torch.empty(M, N, dtype=torch.bfloat16),
                                            fp4=True)
        ti.grouped_gemm_masked_tilelang(torch.zeros(E, 7, K, dtype=b.dtype), torch.ones(E, 7, 3),
                                        torch.zeros(E, N, K // 2, dtype=torch.uint8), torch.ones(E, N, K // 32),
                                        torch.zeros(E, dtype=torch.int32), torch.empty(E, 7, N, dtype=torch.bfloat16),
                                        fp4=True)
        ti.swiglu_quant_tilelang(torch.zeros(M, 2 * K, dtype=torch.bfloat16), torch.arange(5),
                                 10, (torch.empty(M, K, dtype=torch.float8_e4m3fn), torch.empty(M, 3)))
        ti.grouped_gemm_swiglu_contiguous_tilelang(a, sa, b, sb, torch.zeros(M, dtype=torch.int32), 10.0,
                                                   (torch.empty(M, N // 2, dtype=torch.float8_e4m3fn),
                                                    torch.empty(M, N // 256)))
        ti.grouped_gemm_swiglu_masked_tilelang(torch.zeros(E, 7, K, dtype=b.dtype), torch.ones(E, 7, 3), b, sb,
                                               torch.zeros(E, dtype=torch.int32), None,
                                               (torch.empty(E, 7, N // 2, dtype=torch.float8_e4m3fn),
                                                torch.empty(E, 7, N // 256)))
    assert [c[0] for c in calls] == ["moe_fp8_contiguous", "moe_fp8_masked", "moe_fp4_masked_fp8", "moe_fp4_contiguous_fp8",
                                     "moe_fp4_masked_fp8", "moe_swiglu_quant", "moe_fp8_contiguous_swiglu",
                                     "moe_fp8_masked_swiglu"]
    for _, func, args in calls:
        _signature_check(func, args)


@pytest.mark.parametrize("build", [lambda: build_grouped_gemm_contiguous(4096, 4096),
                                   lambda: build_grouped_gemm_masked(4096, 2048),
                                   lambda: build_grouped_gemm_masked_fp4(4096, 2048),
                                   lambda: build_grouped_gemm_contiguous_fp4(4096, 2048),
                                   lambda: build_grouped_gemm_masked_fp4_fp8(4096, 2048),
                                   lambda: build_grouped_gemm_contiguous_fp4_fp8(4096, 2048),
                                   lambda: _swiglu_gemm(2048, 4096, 10.0),
                                   lambda: _swiglu_masked(2048, 4096, 10.0)])
def test_programs_take_both_gemm_operands_from_shared_memory(build):
    ops = gemm_operands(build())
    assert len(ops) == 1 and ops[0].a_scope.startswith("shared") and ops[0].b_scope.startswith("shared")


@pytest.mark.parametrize("build", [build_grouped_gemm_masked_fp4, build_grouped_gemm_contiguous_fp4])
@pytest.mark.parametrize("scale_dtype", ["uint8", "float32"])
def test_fp4_programs_lower_for_sm90a_converting_in_the_kernel(build, scale_dtype):
    """Packed E2M1 bytes and UE8M0 scales (or float32 ones, used as they are) in, a bf16 tensor-core GEMM of the
    two converted shared tiles."""
    src = _tilelang.lower(build(4096, 2048, scale_dtype=scale_dtype), HOPPER).source
    assert "wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in src
    # uint8: the scale byte placed in a float32's exponent field
    assert ("<< (uint)23" in src) == (scale_dtype == "uint8")


@pytest.mark.parametrize("limit", [10.0, None])
def test_swiglu_quant_lowers_for_sm90a(limit):
    """One block a chosen row: IEEE divisions (the scale and the quantisation, as torch's), the clamp only with a
    limit, 64-bit row offsets (``R x 2I`` passes 2^31 at V4-Pro's sizes), and a guard on the row index."""
    from musa_attn_backend.kernels.moe.swiglu_quant_kernel import build_swiglu_quant

    src = _tilelang.lower(build_swiglu_quant(3072, limit), HOPPER).source
    assert "__fdiv_rn(" in src and "(0 <= r) && (r < rows_1)" in src
    assert "((int64_t)r) * (int64_t)6144" in src
    assert ("0x1.4p+3f" in src) == (limit is not None)  # 10.0


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gemm_swiglu_lowers_for_sm90a_with_both_weight_halves_in_one_tile(layout):
    """GEMM1 with the SwiGLU epilogue: per K step the A tile and two weight copies (the group's gate rows and the up
    rows ``I`` further) into one shared tile, one m64n128 FP8 WGMMA per consumer warp group (one half each), IEEE
    divisions in the quantisation; contiguous: the e4m3 NaN code (0x7F) for rows of another expert."""
    src = _tilelang.lower((_swiglu_gemm if layout == "contiguous" else _swiglu_masked)(2048, 4096, 10.0),
                          HOPPER).source
    assert src.count("tl::tma_load(") == 3
    assert "(((int)blockIdx.x) * 128) + 2048)" in src  # the up rows, I = 2048 past the gate rows
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 128, 32" in src
    assert "__fdiv_rn(" in src
    assert ("(uchar)127" in src) == (layout == "contiguous")


@pytest.mark.parametrize("which,packing", [("masked_fp4", "bytes"), ("masked_fp4", "words"), ("masked_fp4", "fp8"),
                                          ("contiguous_fp4", "bytes"), ("contiguous_fp4", "words"),
                                          ("contiguous_fp4", "fp8")])
def test_fp4_programs_are_built_without_warp_specialisation(which, packing):
    """The glue builds the FP4 programs with every thread pipelining (``tilelang_impl._fp4_pass_configs``: the
    warp-specialised build released the scale bytes' slot too early); no producer/consumer barriers remain."""
    src = getattr(ti, f"{which}_kernel")(4096, 2048, target=HOPPER, packing=packing).get_kernel_source()
    assert "cp_async" in src and "mbarrier" not in src


@pytest.mark.parametrize("which", ["contiguous", "masked"])
def test_programs_lower_for_sm90a(which):
    func = build_grouped_gemm_contiguous(4096, 4096) if which == "contiguous" else build_grouped_gemm_masked(4096, 2048)
    src = _tilelang.lower(func, HOPPER).source
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32" in src
    assert src.count("tl::tma_load(") == 2  # the A and B tiles
    if which == "contiguous":
        assert "(ushort)32704" in src  # the bf16 NaN of malformed rows


@pytest.mark.parametrize("target", ["sm_80", "mp_22"])
def test_targets_without_fp8_are_refused(use_settings, target, monkeypatch):
    use_settings(target=target)
    from musa_attn_backend.kernels import _common

    monkeypatch.setattr(_common, "resolve_impl", lambda impl, device, op: "tilelang")
    monkeypatch.setattr(moe, "resolve_impl", lambda impl, device, op: "tilelang")
    b = torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn)
    a = torch.zeros(3, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs FP8 tensor cores"):
        moe.grouped_gemm_fp8(a, torch.ones(3, 1), b, torch.ones(1, 1, 1), torch.zeros(3, dtype=torch.int32))


NVCC = nvcc_path()


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("which", ["contiguous", "masked", "masked_fp4", "contiguous_fp4", "swiglu_quant",
                                   "contiguous_swiglu", "masked_swiglu", "combine", "quantize_scatter",
                                   "masked_fp4_words", "contiguous_fp4_fp8", "route_masked"])
def test_programs_compile_for_sm90a(which):
    """Each program the glue launches, built by nvcc for sm_90a under its default tiling (the FP4 ones: the default
    forms, and the masked bf16 word form)."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    if which == "masked_fp4_words":
        kern = ti.masked_fp4_kernel(4096, 4096, target=HOPPER, packing="words")
    elif which == "contiguous_fp4_fp8":
        kern = ti.contiguous_fp4_kernel(4096, 4096, target=HOPPER, packing="fp8")
    elif which == "contiguous_fp4":
        kern = ti.contiguous_fp4_kernel(4096, 4096, target=HOPPER, packing="words")
    elif which == "combine":
        kern = ti.combine_kernel(7168, 6, target=HOPPER)
    elif which == "quantize_scatter":
        kern = ti.quantize_scatter_kernel(7168, 6, target=HOPPER)
    elif which == "route_masked":
        kern = ti.route_masked_kernel(256, 6, "int64", "bfloat16", True, target=HOPPER)
    elif which == "swiglu_quant":
        kern = ti.swiglu_quant_kernel(2048, 10.0, target=HOPPER)
    elif which.endswith("_swiglu"):
        kern = getattr(ti, f"{which}_kernel")(2048, 4096, 10.0, target=HOPPER)
    else:
        kern = getattr(ti, f"{which}_kernel")(4096, 4096, target=HOPPER)
    assert "__global__" in kern.get_kernel_source()


@pytest.mark.parametrize("policy,shape", [("Square", "64, 64, 32"), ("FullRow", "64, 128, 32")])
def test_contiguous_warp_policy_sets_the_wgmma_shape(policy, shape):
    """The tiling knob the bench sweeps (``--tiling policy=...``): FullRow gives each warp group whole rows of the
    tile, one m64n128 WGMMA per k-slice instead of two m64n64."""
    src = _tilelang.lower(build_grouped_gemm_contiguous(4096, 4096, policy=policy), HOPPER).source
    assert f"kFloat32, {shape}, false, false" in src


def test_contiguous_swizzle_knob_sets_the_block_order():
    """``--tiling swizzle=8``: the blocks launched in panels of 8 tile columns (TileLang's 2-D row rasterization);
    0, the default, leaves the launch order alone."""
    plain = _tilelang.lower(build_grouped_gemm_contiguous(4096, 4096), HOPPER).source
    panels = _tilelang.lower(build_grouped_gemm_contiguous(4096, 4096, swizzle=8), HOPPER).source
    assert "rasterization2DRow" not in plain and "tl::rasterization2DRow<8>()" in panels


def test_persistent_contiguous_needs_tilelang_0_1_15(monkeypatch):
    """The persistent form (``--tiling persistent=132``) is refused by name on a TileLang whose warp
    specialisation cannot lower a pipeline inside a loop (0.1.12 fails with "failed to replace pipeline loop")."""
    monkeypatch.setattr(ti, "_tl_version", lambda: (0, 1, 12))
    with pytest.raises(ValueError, match=r"persistent contiguous program needs TileLang >= 0.1.15.*persistent=0"):
        ti.contiguous_kernel(4096, 4096, target=HOPPER, persistent=132)


def test_persistent_contiguous_keeps_mp31s_rules():
    """The persistent form's TIR within MUSA MP31's lowering rules (both GEMM operands in shared memory, whole
    tiles): the check every compile runs, here without compiling."""
    _tilelang.check_portable("persistent", build_grouped_gemm_contiguous(4096, 4096, policy="FullRow",
                                                                         persistent=132), "mp_31")


PERSISTENT_BUILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import tilelang
from musa_attn_backend._tilelang import lower
from musa_attn_backend.kernels.moe.contiguous_kernel import build_grouped_gemm_contiguous
from musa_attn_backend.testing.toolchain import HOPPER
src = lower(build_grouped_gemm_contiguous(4096, 4096, policy="FullRow", persistent=132), HOPPER,
            pass_configs={tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}).source
print(tilelang.__version__)
print(src)
"""


def test_persistent_contiguous_lowers_on_tilelang_0_1_15():
    """The persistent form under TileLang 0.1.15 (the oracles' site of ``make setup``): 132 blocks, warp
    specialised (a producer warp group of TMA loads), the tile loop with no whole-block barrier in it and the
    consumers' two named barriers around the staging of D (the overlap of one tile's epilogue with the next
    tile's loads depends on both)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    oracles = Path(sys.prefix) / "oracles"
    if not (oracles / "tilelang").is_dir():
        pytest.skip(f"no TileLang 0.1.15 at {oracles} (make setup installs it)")
    root = Path(__file__).resolve().parents[2]
    # without what importing TileLang 0.1.12 here put in the environment (its library and template paths)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TVM_", "TL_", "TILELANG_"))}
    res = subprocess.run([sys.executable, "-c", PERSISTENT_BUILD, str(root)], capture_output=True, text=True,
                         timeout=600, env={**env, "PYTHONPATH": str(oracles)})
    assert res.returncode == 0, res.stderr[-3000:]
    version, src = res.stdout.split("\n", 1)
    assert version.startswith("0.1.15")
    loop = src[src.index("for (int t = 0;"):]
    assert "__launch_bounds__(384, 1)" in src and "tl::tma_load(" in loop and "wgmma_ss<" in loop
    assert "__syncthreads()" not in loop and loop.count("tl::__sync_thread_partial(3, 256);") == 2


def _fp4_conversion_program(R: int, C: int, scale_dtype: str):
    """A CPU program (TileLang's C target) writing one tile of FP4 weights in float32 through both TIR forms the
    FP4 GEMMs use: the byte form (:func:`fp4_weight`) and the word form (:func:`fp4_from_word`)."""
    from musa_attn_backend._tilelang import tl_lang as T
    from musa_attn_backend.kernels.moe.fp4_tir import fp4_from_word, fp4_weight

    @T.prim_func
    def conv(Bq: T.Tensor((R, C // 2), "uint8"), Bw: T.Tensor((R, C // 8), "int32"),
             Bs: T.Tensor((R, C // 32), scale_dtype), by_byte: T.Tensor((R, C), "float32"),
             by_word: T.Tensor((R, C), "float32")):
        with T.Kernel(1, threads=1) as _:
            for n in T.serial(R):
                for j in T.serial(C):
                    by_byte[n, j] = fp4_weight(Bq, Bs, n, j)
                    by_word[n, j] = fp4_from_word(Bw[n, j // 8], j % 8, Bs[n, j // 32], scale_dtype)

    return conv


@pytest.mark.parametrize("scale_dtype", ["uint8", "float32"])
def test_fp4_word_conversion_is_exact(scale_dtype):
    """The word form of the in-kernel FP4 conversion (``packing="words"``: the bytes read as little-endian int32
    words, the magnitude from a table constant) against the byte form and the reference ``dequantize_fp4``, bit
    for bit, on random bytes (every byte value occurs) under every UE8M0 byte (row ``n`` scaled by ``2^(n - 127)``;
    0 and 255, outside the format's normal use, compared between the two forms only) or under float32 powers of
    two. Compiled for the CPU (TileLang's C target): the TIR expressions the GPU programs inline."""
    import tilelang

    R, C = 256, 256
    g = torch.Generator().manual_seed(0)
    bq = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    assert torch.unique(bq[1:255]).numel() == 256
    if scale_dtype == "uint8":
        bs = torch.arange(R, dtype=torch.uint8).unsqueeze(1).expand(R, C // 32).contiguous()
    else:
        bs = torch.ldexp(torch.ones(R, C // 32), torch.randint(-40, 20, (R, C // 32), generator=g))
    by_byte, by_word = torch.full((R, C), 7.0), torch.full((R, C), 7.0)
    kernel = tilelang.compile(_fp4_conversion_program(R, C, scale_dtype), target="c")
    kernel(bq, bq.view(torch.int32), bs, by_byte, by_word)
    torch.testing.assert_close(by_word, by_byte, rtol=0, atol=0, equal_nan=True)
    ref = moe.dequantize_fp4(bq, bs)
    rows = slice(1, 255) if scale_dtype == "uint8" else slice(None)
    torch.testing.assert_close(by_word[rows], ref[rows], rtol=0, atol=0)
    assert (by_word != 0).float().mean() > 0.8  # the check is not one of zeros


@pytest.mark.parametrize("build", [build_grouped_gemm_masked_fp4, build_grouped_gemm_contiguous_fp4])
def test_fp4_word_packing_converts_eight_values_a_store(build):
    """``packing="words"``: the weights read as int32 words, each thread converting 8 neighbouring values into
    one 16-byte store of the bf16 tile; the byte form's per-value expression is gone."""
    words = _tilelang.lower(build(4096, 2048, packing="words"), HOPPER).source
    plain = _tilelang.lower(build(4096, 2048), HOPPER).source
    table = str(0xC8643210)
    assert table in words and table not in plain
    assert "*(uint4*)(((bfloat16_t*)B_w)" in words and "*(uint4*)(((bfloat16_t*)B_w)" not in plain


@pytest.mark.parametrize("M,E,packing", [(35584, 256, "fp8"), (57088, 256, "words"), (300, 4, "fp8"),
                                         (4 * 127 + 32 * 4, 4, "fp8"), (4 * 127 + 32 * 4 + 1, 4, "words")])
def test_contiguous_fp4_auto_packing_follows_the_rows_an_expert(M, E, packing):
    """``CONTIGUOUS_FP4["packing"] == "auto"``: the FP8-tensor-core form while the layout (sized by
    ``align_routing`` for ``T x k`` choices plus ``E x 127`` rows of padding) holds at most 32 rows an expert
    (T = 512 at V4-Flash: 35,584 rows), the bf16 word form above (T = 4096: 57,088); a set packing is kept."""
    assert ti.CONTIGUOUS_FP4["packing"] == "auto"
    assert ti._contiguous_fp4_overrides(M, E) == {"packing": packing}
    ids = torch.randint(0, 256, (512, 6), dtype=torch.int32)
    assert moe.align_routing(ids, 256)[1].numel() == 35584


def test_contiguous_fp4_kernel_refuses_an_unresolved_packing():
    with pytest.raises(ValueError, match="packing must be one of"):
        ti.contiguous_fp4_kernel(4096, 4096, target=HOPPER)


def test_masked_fp4_kernel_refuses_an_unknown_packing():
    with pytest.raises(ValueError, match="moe_fp4_masked: packing must be one of"):
        ti.masked_fp4_kernel(4096, 4096, target=HOPPER, packing="nibbles")


def test_fp4_word_packing_glue_passes_the_same_memory_as_words(use_settings, monkeypatch):
    """Under ``packing="words"`` the glue hands the FP4 programs the packed bytes as an int32 view (no copy) that
    matches their signatures."""
    use_settings(target="sm_90a")
    monkeypatch.setitem(ti.MASKED_FP4, "packing", "words")
    monkeypatch.setitem(ti.CONTIGUOUS_FP4, "packing", "words")
    E, N, K, M = 4, 256, 384, 300
    b = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    sb = torch.zeros(E, N, K // 32, dtype=torch.uint8)
    calls = []

    def capture(key, build, target, pass_configs):
        func = build()
        return lambda *args: calls.append((func, args))

    with _tilelang.intercepting(capture):
        ti.grouped_gemm_masked_tilelang(torch.zeros(E, 7, K, dtype=torch.float8_e4m3fn), torch.ones(E, 7, 3), b, sb,
                                        torch.zeros(E, dtype=torch.int32), torch.empty(E, 7, N, dtype=torch.bfloat16),
                                        fp4=True)
        ti.grouped_gemm_contiguous_tilelang(torch.zeros(M, K, dtype=torch.float8_e4m3fn), torch.ones(M, 3), b, sb,
                                            torch.zeros(M, dtype=torch.int32), torch.empty(M, N, dtype=torch.bfloat16),
                                            fp4=True)
    assert len(calls) == 2
    for func, args in calls:
        _signature_check(func, args)
        assert args[2].dtype == torch.int32 and args[2].data_ptr() == b.data_ptr()


def _e4m3_conversion_program(R: int, C: int):
    """A CPU program (TileLang's C target, which has no FP8 type) writing one tile of packed E2M1 words as e4m3
    bytes, two int32 words (the bits of two uint32) a packed word, through :func:`e4m3_quads`, the conversion of the FP8-tensor-core FP4
    programs."""
    from musa_attn_backend._tilelang import tl_lang as T
    from musa_attn_backend.kernels.moe.fp4_tir import e4m3_quads

    @T.prim_func
    def conv(Bw: T.Tensor((R, C // 8), "int32"), out: T.Tensor((R, C // 4), "int32")):
        with T.Kernel(1, threads=1) as _:
            for n in T.serial(R):
                for q in T.serial(C // 8):
                    lo, hi = e4m3_quads(Bw[n, q])
                    out[n, 2 * q] = T.Cast("int32", lo)
                    out[n, 2 * q + 1] = T.Cast("int32", hi)

    return conv


def test_fp4_to_e4m3_conversion_is_exact():
    """``packing="fp8"``: each E2M1 value becomes the e4m3 value ``E2M1 / 64`` by bit moves, bit for bit against
    the reference's decode (``dequantize_fp4`` under the scale byte 121, ``2^-6``) on random words holding every
    byte value, both signs of zero included (0x8 decodes to -0.0). Compiled for the CPU (TileLang's C target)."""
    import tilelang

    R, C = 64, 256
    g = torch.Generator().manual_seed(1)
    bq = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    assert torch.unique(bq).numel() == 256
    out = torch.full((R, C), 0x7F, dtype=torch.uint8)
    kernel = tilelang.compile(_e4m3_conversion_program(R, C), target="c")
    kernel(bq.view(torch.int32), out.view(torch.int32))
    ref = moe.dequantize_fp4(bq, torch.full((R, C // 32), 121, dtype=torch.uint8))
    assert torch.equal(out, ref.to(torch.float8_e4m3fn).view(torch.uint8))
    assert (out.view(torch.float8_e4m3fn).float() != 0).float().mean() > 0.8


@pytest.mark.parametrize("spans", [1, 2, 4])
@pytest.mark.parametrize("which", ["masked_fp4", "contiguous_fp4"])
def test_fp4_fp8_programs_lower_for_sm90a(which, spans):
    """``packing="fp8"``: the packed words and the activations loaded by every thread (cp.async, no warp
    specialisation), one m64n16k32 FP8 WGMMA of the converted weight tile (the M side) and the token tile per 32
    values of K (``spans`` of them a step, each on its own slice of both tiles), the converted words stored 8 bytes
    at a time, the factor 64 applied once to the output; contiguous: the NaN of rows of another expert."""
    src = getattr(ti, f"{which}_kernel")(4096, 2048, target=HOPPER, packing="fp8", spans=spans).get_kernel_source()
    assert "cp_async" in src and "mbarrier" not in src
    assert "*(uint2*)(((uchar*)B_bytes)" in src
    assert (f"for (int s = 0; s < {spans}; ++s)" in src) == (spans > 1)
    assert ("increase_descriptor_offset<int>(desc_a, (s * 4096))" in src) == (spans > 1)
    assert ("(uint16_t)32704" in src or "0x7FC0" in src.upper() or "32704" in src) == (which == "contiguous_fp4")
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 16, 32" in src
    assert src.count("0x1p+6f") == 1
    assert "kBFloat16" not in src


@pytest.mark.parametrize("H,block", [(4096, 1024), (7168, 1024), (384, 128)])
def test_combine_glue_and_lowering(use_settings, H, block):
    """``combine_experts`` on the TileLang path: int32 rows and float32 weights handed to a program whose signature
    they match, a block as wide as ``H`` allows (up to 1024 columns), each chosen row read with 16-byte loads
    at 64-bit offsets."""
    use_settings(target="sm_90a")
    calls = []

    def capture(key, build, target, pass_configs):
        func = build()
        return lambda *args: calls.append((key, func, args))

    y = torch.zeros(300, H, dtype=torch.bfloat16)
    with _tilelang.intercepting(capture):
        ti.combine_tilelang(y, torch.zeros(5, 6, dtype=torch.int32), torch.ones(5, 6),
                            torch.empty(5, H, dtype=torch.bfloat16))
    ((key, func, args),) = calls
    _signature_check(func, args)
    assert ("block", block) in key
    src = _tilelang.lower(func, HOPPER).source
    assert "*(uint4*)(Y + " in src and "(int64_t)rows[" in src


def test_quantize_scatter_glue_and_lowering(use_settings):
    """``quantize_scatter`` on the TileLang path: int32 destinations and fresh ``(a, sa)`` buffers matching the
    program's signature; each named row written with vectorised stores at 64-bit offsets, the group amax a warp
    reduction, the divisions IEEE."""
    use_settings(target="sm_90a")
    calls = []

    def capture(key, build, target, pass_configs):
        func = build()
        return lambda *args: calls.append((func, args))

    with _tilelang.intercepting(capture):
        a, sa = ti.quantize_scatter_tilelang(torch.zeros(5, 4096, dtype=torch.bfloat16),
                                             torch.zeros(5, 6, dtype=torch.int32), 300)
    ((func, args),) = calls
    _signature_check(func, args)
    assert args[2] is a and args[3] is sa and a.shape == (300, 4096) and sa.shape == (300, 32)
    src = _tilelang.lower(func, HOPPER).source
    assert "*(fp8_e4_4_t*)(A + (((((int64_t)dest[" in src and "tl::AllReduce<tl::MaxOp" in src
    assert "__fdiv_rn(" in src


@pytest.mark.parametrize("ids_dtype,mapped", [(torch.int32, False), (torch.int64, True)])
def test_route_masked_glue_and_lowering(use_settings, ids_dtype, mapped):
    """``route_masked`` on the TileLang path: the ids and weights as they come, a map (or a one-entry stand-in the
    program does not read) and fresh int32 slots, float32 weights and int32 counts, matching the program's
    signature; one block, its chunks' choices ranked in shared memory between barriers."""
    use_settings(target="sm_90a")
    calls = []

    def capture(key, build, target, pass_configs):
        func = build()
        return lambda *args: calls.append((key, func, args))

    ids = torch.zeros(5, 6, dtype=ids_dtype)
    emap = torch.arange(512, dtype=torch.int32) if mapped else None
    with _tilelang.intercepting(capture):
        slot, merged, counts = ti.route_masked_tilelang(ids, torch.ones(5, 6), 256, emap)
    ((key, func, args),) = calls
    _signature_check(func, args)
    assert key == ("moe_route_masked", 256, 6, str(ids_dtype).split(".")[-1], "float32", mapped)
    assert slot.dtype == torch.int32 and merged.dtype == torch.float32 and counts.shape == (256,)
    assert (args[2] is emap) == mapped
    src = _tilelang.lower(func, HOPPER).source
    assert src.count("__syncthreads()") >= 3 and "__shared__" in src


def _route_by_hand(ids, weights, E, emap):
    """The masked routing written out choice by choice (the spec the reference and the program implement)."""
    T, k = ids.shape
    loc = [[E] * k for _ in range(T)]
    for t in range(T):
        for j in range(k):
            g = int(ids[t, j])
            if emap is not None:
                g = int(emap[g]) if 0 <= g < emap.numel() else -1
            loc[t][j] = g if 0 <= g < E else E
    slot, merged, counts = torch.full((T, k), E * T), torch.zeros(T, k), torch.zeros(E, dtype=torch.int32)
    for t in range(T):
        for j in range(k):
            e = loc[t][j]
            merged[t, j] = sum(float(weights[t, i]) for i in range(k) if loc[t][i] == e)
            if e < E and e in loc[t][:j]:
                merged[t, j] = 0.0
                continue
            if e < E:
                slot[t, j] = e * T + int(counts[e])
                counts[e] += 1
    return slot, merged, counts


@pytest.mark.parametrize("mapped", [False, True])
def test_route_masked_reference_is_the_rule(mapped):
    """The reference routing against the rule written out by hand, on routings with repeated experts, ids past
    the map or the local range, negative ids and (mapped) experts of other ranks: slots, merged weights, counts."""
    g = torch.Generator().manual_seed(int(mapped))
    T, k, E = 37, 6, 8
    ids = torch.randint(-2, 14 if mapped else 10, (T, k), generator=g, dtype=torch.int32)
    ids[3] = ids[3, 0]  # a token naming one expert six times
    weights = torch.rand(T, k, generator=g)
    emap = torch.where(torch.rand(12, generator=g) < 0.3, -1, torch.randint(0, E + 2, (12,), generator=g)).to(
        torch.int32) if mapped else None
    slot, merged, counts = moe.route_masked_reference(ids, weights, E, emap)
    hs, hm, hc = _route_by_hand(ids, weights, E, emap)
    assert torch.equal(slot.long(), hs.long()) and torch.equal(counts, hc)
    torch.testing.assert_close(merged, hm, rtol=1e-6, atol=1e-6)
    assert 0 < int((slot < E * T).sum()) < T * k  # some choices kept, some dropped
    op_slot, op_merged, op_counts = moe.route_masked(ids, weights, E, emap)  # the op on the CPU: the reference
    assert torch.equal(op_slot, slot) and torch.equal(op_counts, counts)


def test_route_masked_refuses_bad_arguments():
    ids = torch.zeros(4, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_ids must be a 2-D int32 or int64"):
        moe.route_masked(ids.float(), torch.ones(4, 6), 8)
    with pytest.raises(ValueError, match="topk_weights must be a float32 or bfloat16"):
        moe.route_masked(ids, torch.ones(4, 5), 8)
    with pytest.raises(ValueError, match="expert_map must be a contiguous 1-D int32"):
        moe.route_masked(ids, torch.ones(4, 6), 8, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        moe.route_masked(ids, torch.ones(4, 6), 0)
