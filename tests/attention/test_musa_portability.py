"""Every attention program the MUSA platform would choose is one tilelang-musa can lower: checked on the TIR
the launchers build (before any target lowering, so this CUDA-only TileLang can build them), under a
simulated MUSA platform (``MUSA_ATTN_TARGET=mp_31`` / ``mp_22``).

tilelang-musa lowers a GEMM only from a shared-memory A operand on MUSA (SQMMA, PH1 WMMA and the FMA fallback);
the ``P V`` product must read P from shared memory there. The programs are collected by intercepting
``compile_cached`` while the launchers plan and build every kernel of a matrix of models, engines, page sizes,
FP8, windows and speculative lengths (and every prefill tiling the tuner may pick), so the kernel choice
itself is what is checked.
"""

import dataclasses

import pytest

from musa_attn_backend import _tilelang, config, platform
from musa_attn_backend.kernels._tir import gemm_operands, register_a_gemms
from musa_attn_backend.testing import mp31
from musa_attn_backend.kernels.attention import tilelang_impl as ti

def collect_programs(target: str, shared_p: bool = False) -> dict:
    """``{key: (prim_func, compile target)}`` of every kernel the launchers build for ``target``."""
    return mp31.dense_programs(target, shared_p)


@pytest.fixture(scope="module")
def mp31_programs():
    return collect_programs("mp_31")


def test_musa_programs_read_gemm_operands_from_shared_memory(mp31_programs):
    """No GEMM of any program chosen for MP31 reads A from registers; each attention program has its two
    products (Q K^T, P V; Q K^T as two GEMMs where the head dim is cut, 192 = 128 + 64) with both operands in
    shared memory and the accumulator in registers."""
    attention = {k: f for k, (f, _) in mp31_programs.items() if k.startswith("('prefill'") or k.startswith("('decode'")}
    assert len(attention) >= 60, f"too few programs collected ({len(attention)}): is the plan empty?"
    for key, func in attention.items():
        bad = register_a_gemms(func)
        assert not bad, f"{key}: GEMM reads A from registers on MUSA: {bad}"
        ops = gemm_operands(func)
        assert len(ops) == (3 if "d_parts" in key else 2), f"{key}: expected Q K^T and P V, found {ops}"
        assert all(g.a_scope.startswith("shared") and g.b_scope.startswith("shared") for g in ops), (key, ops)
        assert all(g.c_scope == "local.fragment" for g in ops), (key, ops)
        assert ops[-1].a == "P_s", f"{key}: P V reads {ops[-1].a}"
        assert "d_parts" in key or ", d=192," not in key, f"{key}: head dim 192 not cut for MP31"


def test_musa_choice_has_no_hopper_only_program(mp31_programs):
    """MP31 gets neither the warp-specialised ping-pong prefill (named barriers, register reallocation) nor
    programmatic dependent launch, and the compile target is MUSA's."""
    for key, (func, tgt) in mp31_programs.items():
        assert "pingpong=True" not in key and "'pdl'" not in key, key
        assert platform.parse_target(tgt) == ("musa", "mp_31"), tgt
        assert "'shared_p'" in key or not key.startswith(("('prefill'", "('decode'")), key


def test_musa_prefill_tilings_fit_its_shared_memory(use_settings):
    """Every prefill tiling MP31 may pick fits its 192 KB of shared memory with P's tile added; where the
    two-stage 128-key tiles of head dim 128 would not, narrower or single-stage ones are chosen."""
    use_settings(target="mp_31")
    plat = platform.get_platform()
    assert plat.smem_per_sm == 192 * 1024 and not plat.gemm_a_in_registers
    for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        for fp8 in (False, True):
            for page in (1, 16, 64, 128, 256):
                for window in (False, True):
                    for cfg in ti.prefill_candidates(d, dv, fp8, page, window):
                        assert not cfg.pingpong
                        assert ti.prefill_smem_bytes(cfg, d, dv, fp8, True) + 2048 <= plat.smem_per_sm, cfg
    two_stage_wide = ti.PrefillConfig(block_M=128, block_N=128, num_stages=2, threads=256)
    assert two_stage_wide not in ti.prefill_candidates(128, 128, False, 1, False)
    use_settings(target="sm_90a")  # Hopper keeps them (228 KB), P in registers or not
    assert two_stage_wide in ti.prefill_candidates(128, 128, False, 1, False)
    use_settings(shared_p=True)
    assert two_stage_wide in ti.prefill_candidates(128, 128, False, 1, False)


def test_prefill_smem_estimate_matches_tilelang():
    """The shared-memory estimate that bounds the tilings is TileLang's own layout (dynamic pool plus static
    rows), read from its sm_90a lowering: P tile or not, TMA or row gathers, FP8 staging, head dim 256. (The
    same held for the 128-key two-stage tilings of head dim 128, TMA or gathers, P tile or not.)"""
    from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill

    cases = [(128, "float8_e4m3", 128, 1, False, True), (256, "bfloat16", 64, 2, True, False)]
    for d, kv, bn, stages, tma, shared_p in cases:
        lay = (2 * d, 2 * d, d)
        func = build_prefill.__wrapped__(8, 2, d, d, "bfloat16", kv, True, False, False, False, kv != "bfloat16",
                                         lay, lay, 128, bn, stages, 256, tma, False, shared_p)
        cfg = ti.PrefillConfig(block_M=128, block_N=bn, num_stages=stages, threads=256, tma=tma)
        lowered = _tilelang.lower(func, {"kind": "cuda", "arch": "sm_90a"})
        assert lowered.shared_bytes == ti.prefill_smem_bytes(cfg, d, d, kv != "bfloat16", shared_p), (d, kv, bn)


def test_hopper_programs_keep_p_in_registers_unless_asked(use_settings):
    """The check can fail: on sm_90a the P V product reads P from registers (the faster path there), and
    ``MUSA_ATTN_SHARED_P=1`` moves it to shared memory, the ping-pong prefill leaving the choice."""
    lay = (2 * 128, 2 * 128, 128)
    spec = ti.AttnSpec(8, 2, 128, 128, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)
    for shared_p in (False, True):
        programs = {}
        with config.override(target="sm_90a", shared_p=shared_p), _tilelang.intercepting(
                lambda key, build, tgt, pc: programs.setdefault(repr(key), build())):
            cfg = ti.prefill_config(128, 128, False, 1, False)
            assert cfg.pingpong != shared_p
            ti.prefill_kernel(spec, True, 1, cfg=ti.PrefillConfig(block_M=128, block_N=128, num_stages=2,
                                                                    threads=256))
            ti.decode_kernel(spec, ti.decode_config(8, 4), True)  # 8 tokens x 4 heads: 64-row tiles
        assert len(programs) == 2
        for func in programs.values():
            assert bool(register_a_gemms(func)) != shared_p


def test_compile_refuses_register_operand_for_musa(use_settings):
    """A program with a register A operand is refused for a MUSA target before any lowering, naming the kernel
    and the operand (rather than failing deep in tilelang-musa's GEMM lowering)."""
    from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill

    lay = (2 * 128, 2 * 128, 128)
    func = build_prefill.__wrapped__(8, 2, 128, 128, "bfloat16", "bfloat16", True, False, False, False, False,
                                     lay, lay, 128, 64, 2, 256)
    with pytest.raises(ValueError, match=r"'k1'.*acc_p \(local.fragment\) x V_.*shared memory only"):
        _tilelang.check_portable("k1", func, {"kind": "musa", "arch": "mp_31"})
    _tilelang.check_portable("k1", func, {"kind": "cuda", "arch": "sm_90a"})  # fine there


def test_mp22_programs_are_shared_p_too():
    """MP22 (S4000, best effort: no FP8, no bulk copies) gets row-gather programs with P in shared memory."""
    programs = {}
    lay = (2 * 128, 2 * 128, 128)
    spec = ti.AttnSpec(8, 2, 128, 128, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)
    with config.override(target="mp_22"), _tilelang.intercepting(
            lambda key, build, tgt, pc: programs.setdefault(repr(key), build())):
        for cfg in ti.prefill_candidates(128, 128, False, 128, False):
            assert not cfg.tma and not cfg.pingpong
            ti.prefill_kernel(spec, True, 128, cfg=cfg)
        for q in (1, 4):
            ti.decode_kernel(spec, ti.decode_config(q, 4), False)
    assert len(programs) >= 3
    assert all(not register_a_gemms(f) for f in programs.values())


@pytest.mark.parametrize("parses", [True, False])
def test_musa_target_form(monkeypatch, use_settings, parses):
    """The MUSA target in the form the installed TileLang takes: a dict where its TVM has no target-string
    parser (TVM 0.25: TileLang 0.1.12+, tilelang-musa 0.1.12+musa.1), else tilelang-musa's string form; both
    read back to the same kind and arch, and to the same capability flags."""
    monkeypatch.setattr(platform, "tvm_parses_target_strings", lambda: parses)
    use_settings(target="mp_31")
    tgt = platform.get_platform().tilelang_target()
    assert tgt == ("musa -arch=mp_31" if parses else {"kind": "musa", "arch": "mp_31"})
    assert platform.parse_target(tgt) == ("musa", "mp_31")
    assert platform.features_of(tgt) == platform.features_of(None)
    assert platform.features_of(tgt)["gemm_a_in_registers"] is False


def test_installed_tvm_target_form():
    """This TileLang (0.1.12+: TVM 0.25) rejects command-line target strings, so MUSA gets the dict form."""
    platform.tvm_parses_target_strings.cache_clear()
    assert platform.tvm_parses_target_strings() is False
    assert platform.musa_target("mp_31") == {"kind": "musa", "arch": "mp_31"}


def test_parse_target_rejects_unknown_forms():
    for bad in ("llvm", {"kind": "rocm", "arch": "gfx942"}, {"kind": "musa"}, 3):
        with pytest.raises(ValueError, match="cannot read a CUDA/MUSA kind and arch"):
            platform.parse_target(bad)
    assert platform.parse_target("cuda -arch=sm_90a") == ("cuda", "sm_90a")


def test_shared_p_setting_is_a_kernel_switch(use_settings):
    """MUSA_ATTN_SHARED_P changes the kernels: it is in the compile-cache key, the flag follows it."""
    use_settings(target="sm_90a")
    assert platform.get_platform().gemm_a_in_registers
    assert ("MUSA_ATTN_SHARED_P", "0") in config.kernel_settings()
    use_settings(shared_p=True)
    assert not platform.get_platform().gemm_a_in_registers
    assert ("MUSA_ATTN_SHARED_P", "1") in config.kernel_settings()
    assert dataclasses.replace(config.settings(), shared_p=False) != config.settings()


def test_doctor_says_where_p_goes(use_settings, capsys, monkeypatch):
    """``musa-attn doctor`` shows the flag: P in shared memory for MP31, in registers for sm_90a."""
    import re

    from musa_attn_backend import cli

    monkeypatch.setattr(cli, "probe_engine", lambda engine: {"installed": False})  # engines: not the point here
    for target, expected in (("mp_31", r"P V operand +shared memory"), ("sm_90a", r"P V operand +registers")):
        use_settings(target=target)
        info, _ = cli.collect()
        assert info["platform"]["gemm_a_in_registers"] == (target == "sm_90a")
        cli.print_report(info, [])
        assert re.search(expected, capsys.readouterr().out), target


def test_no_fitting_tiling_is_a_clear_error(use_settings):
    """Where no prefill tiling fits a target's shared memory (head dim 256 on MP22's assumed 128 KB), planning
    says so, naming the head dims, the size and the arch, before anything is built or launched."""
    use_settings(target="mp_22")
    with pytest.raises(ValueError, match=r"no prefill tiling of head dims 256/256 fits the 128 KB .* mp_22"):
        ti.prefill_config(256, 256, False, 1, False)
    assert ti.prefill_config(128, 128, False, 1, False)  # head dim 128 fits
