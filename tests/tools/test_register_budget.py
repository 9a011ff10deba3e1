"""The register budget of warp-specialised programs (``kernels/_tir.py``: ``INVARIANTS``), checked on every target.

setmaxnreg moves registers between a block's warp groups within what the block got at launch; an increase waits
until the pool holds it. The paired V4 program's first GPU run (H100, 2026-12-06) hung on every input with warp
groups asking 208 + 208 + 96 of a 384-thread block's 3 x 168: this check would have refused it before lowering.
"""

import pytest

from musa_attn_backend import _tilelang
from musa_attn_backend.kernels._tir import INVARIANTS, RULES, _register_budget, _set_max_nregs, violations

CUDA = {flag: True for flag in RULES}


def _sched():
    from musa_attn_backend.kernels.dsv4.sparse.sched_kernel import build_sparse_mqa_sched

    return build_sparse_mqa_sched.__wrapped__(64, True, True)


def _paired(extra=True):
    from musa_attn_backend.kernels.dsv4.sparse.paired_kernel import build_sparse_mqa_paired

    return build_sparse_mqa_paired.__wrapped__(128, extra, True)


def _pingpong(gather):
    from musa_attn_backend.kernels.attention.prefill_pingpong_kernel import build_prefill_pingpong

    lay = (2 * 128, 2 * 128, 128)
    return build_prefill_pingpong.__wrapped__(8, 2, 128, 128, "bfloat16", True, False, True, lay, lay, 128, 2,
                                              gather=gather)


PROGRAMS = {"sched": _sched, "paired": _paired, "paired_no_extra": lambda: _paired(False),
            "pingpong_tma": lambda: _pingpong(False), "pingpong_gather": lambda: _pingpong(True)}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_warp_specialised_program_fits_its_block_registers(name):
    """Each program sets one count a warp group, three groups of 384 threads, within 3 x 168 in all."""
    func = PROGRAMS[name]()
    calls = _set_max_nregs(func)
    assert len(calls) == 3 and all(n > 0 for n, _ in calls), calls
    assert sum(n for n, _ in calls) <= 3 * 168, calls
    assert _register_budget(func) == [] and violations(func, CUDA) == []


def test_the_paired_programs_first_counts_are_refused_before_lowering(monkeypatch):
    """208 + 208 + 96 (what hung) is a violation on CUDA too, and compile_cached's check names it for sm_90a."""
    from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk

    monkeypatch.setattr(pk, "MATH_REGS", 208)
    monkeypatch.setattr(pk, "PRODUCER_REGS", 96)
    func = _paired()
    bad = violations(func, CUDA)
    assert len(bad) == 1 and bad[0].flag == "" and "208 + 208 + 96" in bad[0].detail and "3 x 168" in bad[0].detail
    with pytest.raises(ValueError, match=r"3 x 168.*every target"):
        _tilelang.check_portable(("dsv4_sparse_mqa_paired",), func, {"kind": "cuda", "arch": "sm_90a"})


@pytest.mark.parametrize("math,producer,why", [(200, 100, "multiple of 8"), (256, 16, "multiple of 8 in"),
                                               (216, 80, "exceed")])
def test_counts_off_the_grid_or_over_the_pool_are_named(monkeypatch, math, producer, why):
    """A count that is no multiple of 8 or outside [24, 256], or a sum over the pool, each named."""
    from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk

    monkeypatch.setattr(pk, "MATH_REGS", math)
    monkeypatch.setattr(pk, "PRODUCER_REGS", producer)
    bad = _register_budget(_paired())
    assert bad and any(why in b for b in bad), bad
    assert "register_budget" in INVARIANTS
