"""A launch grid's y and z dimensions hold at most 65,535 blocks (CUDA and MUSA alike; x holds 2^31 - 1), so no
program puts a dimension that grows with the call's tokens there unscaled: a prefill of 70,000 tokens (one of
FlashMLA's own prefill cases) failed to launch with the workspace programs' tokens on y (``CUDA_ERROR_INVALID_VALUE``,
grid (2, 70000, 1)) until they moved to x.

Checked on the TIR of every program of the reference plans for mp_31 (dense, DeepSeek-V4, MoE: ``testing/mp31.py``)
and of every DeepSeek-V4 sparse program as built for sm_90a, the workspace ones included."""

import pytest

from musa_attn_backend import _tilelang, config
from musa_attn_backend.testing import mp31

TOKEN_NAMES = ("num_tokens", "tokens")  # the dynamic dimensions that count a call's tokens


def token_extents_on_y_or_z(func) -> list:
    """``[(blockIdx tag, extent)]`` where a grid's y or z extent is a call's token count itself."""
    from musa_attn_backend.kernels._tir import _tir_of

    tir = _tir_of(func)
    found = []

    def visit(node):
        # before lowering a grid dimension is a loop bound to a block index; after, a thread_extent attribute
        if isinstance(node, tir.For) and node.thread_binding is not None:
            tag, extent = node.thread_binding.thread_tag, node.extent
        elif isinstance(node, tir.AttrStmt) and node.attr_key == "thread_extent":
            tag, extent = node.node.thread_tag, node.value
        else:
            return
        if tag in ("blockIdx.y", "blockIdx.z") and isinstance(extent, tir.Var) and extent.name in TOKEN_NAMES:
            found.append((tag, extent.name))

    tir.stmt_functor.post_order_visit(func.body, visit)
    return found


def _sparse_programs_for_sm90a() -> dict:
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    programs: dict = {}
    with config.override(target="sm_90a"), _tilelang.intercepting(mp31._collector(programs)):
        for H in (64, 128):
            for name in ti.WORKSPACE_PROGRAMS:
                ti._WS_KERNELS[name](H, True, "bfloat16")
            for program in ("scheduled", "portable"):
                for split in (False, True):
                    ti.sparse_mqa_kernel(H, True, True, split, "bfloat16", program=program)
    with config.override(target="sm_90a", musa_forms=True), _tilelang.intercepting(mp31._collector(programs)):
        ti.portable_ws_kernel(64, True, "bfloat16")
    return programs


def test_the_check_sees_a_token_count_on_y():
    """The check finds a call's token count on y (the grid the workspace programs had), and not on x."""
    from musa_attn_backend._tilelang import tl_lang as T

    def program(tokens_on_y):
        NT = T.dynamic("num_tokens")

        @T.prim_func
        def copy_rows(A: T.Tensor((NT, 64), "float32"), B: T.Tensor((NT, 64), "float32")):
            with T.Kernel(2, NT, threads=32) if tokens_on_y else T.Kernel(NT, 2, threads=32) as (x, y):
                t = y if tokens_on_y else x
                h = x if tokens_on_y else y
                for c in T.Parallel(32):
                    B[t, h * 32 + c] = A[t, h * 32 + c]
        return copy_rows

    assert token_extents_on_y_or_z(program(True)) == [("blockIdx.y", "num_tokens")]
    assert token_extents_on_y_or_z(program(False)) == []


@pytest.mark.parametrize("where", ["mp_31 plans", "sm_90a sparse"])
def test_no_program_puts_the_token_count_on_grid_y_or_z(where):
    programs = mp31.programs("mp_31") if where == "mp_31 plans" else _sparse_programs_for_sm90a()
    assert len(programs) > 10
    bad = {key[:120]: found for key, (func, _) in programs.items() if (found := token_extents_on_y_or_z(func))}
    assert not bad, bad
