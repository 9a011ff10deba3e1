"""The FlashMLA conformance harness (``scripts/flashmla_suite.py``) without FlashMLA's code: the stand-in package
exposes FlashMLA's three functions with FlashMLA's argument order, the case lists of a test script's ``__main__``
block are read without running the block, V3.2 cases are left out and the work filter counts entries."""

import dataclasses
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite(load_script):
    return load_script("flashmla_suite")


def test_standin_serves_flashmlas_three_functions_in_its_argument_order():
    sys.path.insert(0, str(ROOT / "integration_tests" / "flashmla_standin"))
    try:
        import flash_mla
    finally:
        sys.path.pop(0)
    assert flash_mla.__file__.startswith(str(ROOT / "integration_tests"))
    decode = list(inspect.signature(flash_mla.flash_mla_with_kvcache).parameters)
    # FlashMLA's tests pass these positionally, in this order
    assert decode[:16] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                           "num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink",
                           "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    prefill = list(inspect.signature(flash_mla.flash_mla_sparse_fwd).parameters)
    assert prefill[:7] == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"]
    meta, none = flash_mla.get_mla_metadata()
    assert none is None and not meta.have_initialized


def test_main_block_cases_are_read_without_running_the_block(suite, tmp_path):
    script = tmp_path / "t.py"
    script.write_text(
        "import dataclasses\n"
        "@dataclasses.dataclass\nclass P:\n    s_q: int\n    d_qk: int\n    topk: int = 64\n    decode: object = None\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('the block must not run')\n"
        "    a = [P(s, d) for s in (1, 2) for d in (512, 576)]\n"
        "    b = [P(9, 512, 128)]\n"
        "    testcases = a + b\n"
        "    raise SystemExit('nor what follows the case lists')\n")
    ns = {"__name__": "t"}
    exec(compile(script.read_text().split("if __name__")[0], str(script), "exec"), ns)
    cases = suite._main_block_cases(script, ns)
    assert [(c.s_q, c.d_qk) for c in cases] == [(1, 512), (1, 576), (2, 512), (2, 576), (9, 512)]
    assert [suite._work(c) for c in cases][-1] == 9 * 128

    @dataclasses.dataclass
    class D:
        b: int
        extra_topk: int

    assert suite._work(dataclasses.replace(cases[0], decode=D(4, 512))) == 4 * 1 * (64 + 512)
