"""Every public op of ``musa_attn_backend.kernels`` on the degenerate batches engines send (zero tokens,
zero-length requests, all-invalid index sets, one token, the largest graph batch, repeated and dropped expert
ids): the catalog and each case's contract are in :mod:`musa_attn_backend.testing.degenerate`. On a CPU the
references run; on a GPU the TileLang programs, each result also compared with the reference on the same
inputs (bf16 outputs within 2e-2, float32 within 1e-4, bytes exact). A public op with no case fails
``test_every_public_op_is_swept``: a new op cannot skip the sweep."""

import pytest

from musa_attn_backend.testing import degenerate

CASES = degenerate.CASES


def test_every_public_op_is_swept():
    ops = set(degenerate.public_ops())
    swept = {c.op for c in CASES}
    missing = ops - swept - set(degenerate.NOT_BATCH_OPS)
    assert not missing, f"public ops with no degenerate-input case: {sorted(missing)}"
    stale = (swept | set(degenerate.NOT_BATCH_OPS)) - ops
    assert not stale, f"cases or exemptions for names that are not public ops: {sorted(stale)}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_degenerate_inputs_reference(case, use_settings):
    use_settings(poison=True)
    case.run("cpu", "reference")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_degenerate_inputs_tilelang(case, use_settings, gpu_device):
    use_settings(poison=True)
    case.run(gpu_device, "tilelang")


SPARSE_CASES = [c for c in CASES if c.op in ("dsv4.sparse_mqa", "dsv4.sparse_mqa_plan", "dsv4.flash_mla_with_kvcache")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: c.id)
def test_degenerate_inputs_scheduled_program(case, use_settings, gpu_device):
    """The V4 sparse attention cases on the scheduled program (MUSA_ATTN_DSV4_PROGRAM=scheduled)."""
    use_settings(poison=True, dsv4_program="scheduled")
    case.run(gpu_device, "tilelang")
