"""MUSA MP31's lowering rules (``kernels/_tir.py``: ``RULES``; ``docs/musa.md``) checked on the programs' TIR.

- Each rule catches the program tilelang-musa refused (``../shared/musa/lowering-2026-12-03.md``), built as it was
  before its MUSA form, and passes the form the launchers now choose for MUSA; a CUDA target checks none.
- Every program of the reference plans (``testing/mp31.py``: dense models, DeepSeek-V4-Flash and -Pro for both
  engines with FP8 and FP4 experts on our MoE, every MoE form) keeps every rule for mp_31.
- The vectoriser model reproduces what the fork did with the masked FP8 GEMM.
"""

import pytest

from musa_attn_backend import _tilelang, config, platform
from musa_attn_backend.kernels import _sqmma
from musa_attn_backend.kernels._tir import RULES, violations
from musa_attn_backend.testing import mp31

MUSA = {flag: False for flag in RULES}  # a target lacking every flag of the rules
CUDA = {flag: True for flag in RULES}
LAY = (4 * 192, 4 * 192, 192)
VLAY = (4 * 128, 4 * 128, 128)


def _sparse_mqa(separate_v):
    from musa_attn_backend.kernels.dsv4.sparse.mqa_kernel import build_sparse_mqa

    return build_sparse_mqa(64, True, True, False, "bfloat16", 64, 32 if separate_v else 64, 256, True, True,
                            separate_v)


def _prefill_192(split):
    from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill

    return build_prefill(16, 4, 192, 128, "bfloat16", "bfloat16", True, False, False, False, False, LAY, VLAY,
                         128, 64, 2, 256, False, False, True, (128, 64) if split else ())


def _decode_192(split):
    from musa_attn_backend.kernels.attention.decode_kernel import build_decode

    return build_decode(16, 4, 192, 128, "bfloat16", "bfloat16", 1, False, False, False, False, True, LAY, VLAY,
                        64, 64, 2, 128, shared_p=True, d_parts=(128, 64) if split else ())


def _fp4_fp8(spans):
    from musa_attn_backend.kernels.moe.masked_fp4_fp8_kernel import build_grouped_gemm_masked_fp4_fp8

    return build_grouped_gemm_masked_fp4_fp8(4096, 7168, spans=spans)


def _masked_fp8(threads):
    from musa_attn_backend.kernels.moe.masked_kernel import build_grouped_gemm_masked

    return build_grouped_gemm_masked(4096, 7168, threads=threads)


def _prefill_p(shared_p):
    from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill

    lay = (2 * 128, 2 * 128, 128)
    return build_prefill(8, 2, 128, 128, "bfloat16", "bfloat16", True, False, False, False, False, lay, lay, 128, 64,
                         2, 256, False, False, shared_p)


# (flag, what the fork said, the program as it was, the program MUSA now gets)
CASES = [
    ("gemm_tile_two_majors", "Get different layout for KV_s", lambda: _sparse_mqa(False), lambda: _sparse_mqa(True)),
    ("gemm_any_extent", "PH1 chunked swizzle (prefill, head dim 192)", lambda: _prefill_192(False),
     lambda: _prefill_192(True)),
    ("gemm_any_extent", "PH1 chunked swizzle (decode, head dim 192)", lambda: _decode_192(False),
     lambda: _decode_192(True)),
    ("gemm_tile_slices", "bad optional access (FP4 on FP8, 2 spans)", lambda: _fp4_fp8(2), lambda: _fp4_fp8(1)),
    ("wide_float_vectors", "Cannot convert type float32x16", lambda: _masked_fp8(128), lambda: _masked_fp8(256)),
    ("gemm_a_in_registers", "register A operand", lambda: _prefill_p(False), lambda: _prefill_p(True)),
]


@pytest.mark.parametrize("flag,what,before,after", CASES, ids=[c[1] for c in CASES])
def test_each_rule_catches_its_failure_and_passes_musas_form(flag, what, before, after):
    """The rule of ``flag`` finds the program as tilelang-musa refused it, and nothing else finds it (each rule
    stands for its own failure); the form MUSA now gets keeps every rule; CUDA's flags check nothing."""
    old = violations(before(), MUSA)
    assert old and {v.flag for v in old} == {flag}, old
    assert violations(after(), MUSA) == []
    assert violations(before(), CUDA) == []


def test_the_launchers_choose_musas_forms_for_mp31(use_settings):
    """The glue builds each MUSA form for mp_31 (and keeps CUDA's for sm_90a): K and V tiles of their own for the
    sparse MQA, the head dim cut in two, one span a step for FP4 on FP8, 256 threads for masked FP8."""
    from musa_attn_backend.kernels.attention import tilelang_impl as ti
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as dti
    from musa_attn_backend.kernels.moe import tilelang_impl as mi

    for target, musa in (("mp_31", True), ("sm_90a", False)):
        use_settings(target=target)
        keys = []
        with _tilelang.intercepting(lambda key, build, tgt, pc: keys.append(repr(key))):
            dti.sparse_mqa_kernel(64, True, True, False, "bfloat16", program="portable")
            spec = ti.AttnSpec(16, 4, 192, 128, "bfloat16", "bfloat16", k_layout=LAY, v_layout=VLAY)
            ti.decode_kernel(spec, ti.decode_config(1, 4, False, 128), False)
            mi.masked_fp4_kernel(4096, 7168, packing="fp8")
            mi.masked_kernel(4096, 7168)
        assert ("'separate_v'" in keys[0] and ", 32, True" in keys[0]) == musa
        assert ("('d_parts', (128, 64))" in keys[1]) == musa
        assert ("('spans', 1)" in keys[2]) == musa and (("('spans', 2)" in keys[2]) != musa)
        assert ("('threads', 256)" in keys[3]) == musa


def test_musa_forms_setting_turns_every_flag_off_on_cuda(use_settings):
    """``MUSA_ATTN_MUSA_FORMS=1``: sm_90a gets every form MUSA needs (to run them on the H200), P in shared memory
    included; the flags of the rest of the target (TMA, FP8) stay."""
    use_settings(target="sm_90a", musa_forms=True)
    plat = platform.get_platform()
    assert not any(getattr(plat, f) for f in platform.LOWERING_FLAGS) and not plat.gemm_a_in_registers
    assert plat.fp8 and plat.bulk_copy
    use_settings(musa_forms=False)
    assert all(getattr(platform.get_platform(), f) for f in platform.LOWERING_FLAGS)


def test_compile_refuses_a_program_breaking_a_rule_for_musa():
    """``compile_cached``'s check refuses, before any lowering, a program that breaks a rule of a MUSA target,
    naming the kernel, what breaks and the flag; the same program passes for sm_90a."""
    func = _masked_fp8(128)
    with pytest.raises(ValueError, match=r"'k1'.*16 float32 lanes.*platform.wide_float_vectors is false"):
        _tilelang.check_portable("k1", func, {"kind": "musa", "arch": "mp_31"})
    _tilelang.check_portable("k1", func, {"kind": "cuda", "arch": "sm_90a"})


@pytest.mark.parametrize("M,N,threads,policy,lanes", [
    (64, 128, 128, "Square", 16),  # the masked FP8 default: float32x16, refused by the fork
    (64, 128, 256, "Square", 8),  # 256 threads: lowers
    (64, 64, 128, "Square", 8),  # block_n 64: lowers
    (128, 128, 256, "FullRow", 16),  # the contiguous GEMM's tile, were its scale read from shared memory
])
def test_vector_model_reproduces_the_forks_widths(M, N, threads, policy, lanes):
    """The model of tilelang-musa's warp partition, SQMMA accumulator and v0.1.8 vectoriser gives the widths the
    fork gave a loop ``acc[i, j] += part[i, j] * scale_s[i]`` (a shared scale read by row), and none for a loop
    that touches no shared or global memory (the contiguous GEMM keeps its scales in registers)."""
    shape = _sqmma.sqmma_shape(M, N, 128, threads, policy, "fp8")
    assert shape is not None
    assert _sqmma.loop_lanes(M, N, threads, shape, ["row"]) == lanes
    assert _sqmma.loop_lanes(M, N, threads, shape, []) == 1
    assert _sqmma.loop_lanes(M, N, threads, shape, ["col"]) == 1  # a column-indexed read: 8 columns apart


@pytest.fixture(scope="module")
def checked():
    return mp31.checked("mp_31")


def test_every_program_of_the_plans_keeps_every_rule_for_mp31(checked):
    """Dense attention, every V4 family and every MoE form, as the launchers build them for mp_31: no rule broken
    (the table in the README is made of these rows)."""
    broken = [(key[:140], [v.detail for v in bad]) for key, _, bad in checked if bad]
    assert not broken, broken
    families = {fam for _, fam, _ in checked}
    assert families == {name for _, name in mp31.FAMILIES}, families
    count = {fam: sum(f == fam for _, f, _ in checked) for fam in families}
    assert count["dense attention"] >= 300 and count["V4 sparse attention"] >= 8 and count["MoE grouped GEMMs"] >= 40


def test_the_check_sees_the_forms_musa_was_given(checked):
    """The rows are MUSA's programs: the sparse MQA's separate K and V tiles, head dim 192 cut in two, FP4 on FP8
    one span a step, masked FP8 at 256 threads."""
    keys = [k for k, _, _ in checked]
    sparse = [k for k in keys if k.startswith("('dsv4_sparse_mqa'")]
    assert sparse and all("'separate_v'" in k for k in sparse)
    assert all("('d_parts', (128, 64))" in k for k in keys if ", d=192," in k and k.startswith(("('prefill'",
                                                                                                 "('decode'")))
    assert all("('spans', 1)" in k for k in keys if "_fp8', " in k and k.startswith("('moe_fp4"))
    assert all("('threads', 256)" in k for k in keys if k.startswith("('moe_fp8_masked', "))


def test_readme_table_is_made_of_the_rows(checked):
    table = mp31.markdown_table("mp_31", checked)
    assert "| all | " in table and "| dense attention | " in table
    n = len(checked)
    assert f"| all | {n} | {n} |" in table
    with config.override(target="mp_31"):
        assert not platform.get_platform().gemm_tile_slices
