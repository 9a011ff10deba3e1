"""SGLang 0.5.23's own DeepSeek-V4 attention kit on a GPU with the TileLang kernels: the same cases as the CPU
run (``test_sglang_dsv4_kit.py``), with the kit's own Triton writers filling the caches (no shim), so the
backend reads the bytes SGLang writes, and the kit's CUDA-graph decode runner with real graphs. Skipped where
SGLang's kit does not import."""

import sys
import unittest

import pytest
import torch

pytestmark = pytest.mark.gpu
sglang = pytest.importorskip("sglang")


def _cases():
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
        from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: F401
        from test_sglang_dsv4_kit import COMPRESS_CASES, SPARSE_PREFILL_CASES, VERIFY_CASES, kit
    except Exception:  # noqa: BLE001 - reported by the test below
        return [], [], [], []
    from musa_attn_backend import BACKEND_NAME

    return list(kit.make_dsv4_cases(BACKEND_NAME)), COMPRESS_CASES, SPARSE_PREFILL_CASES, VERIFY_CASES


SWA, COMPRESS, SPARSE_PREFILL, VERIFY = _cases()


class _TC(unittest.TestCase):
    __test__ = False  # a carrier of assert methods for the kit, not a test

    def runTest(self):  # pragma: no cover
        pass


def _kit():
    try:
        from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's V4 kit does not import here: {type(e).__name__}: {e}")
    return kit


@pytest.mark.parametrize("case", SWA, ids=lambda c: c.name)
def test_dsv4_swa_case_gpu(gpu_device, case):
    _kit().run_dsv4_attention_case(_TC(), case, device=str(gpu_device))


@pytest.mark.parametrize("case", COMPRESS, ids=lambda c: c.name)
def test_dsv4_compressed_cache_case_gpu(gpu_device, case):
    _kit().run_dsv4_compress_attention_case(_TC(), case, device=str(gpu_device), extra_entries=max(
        32, max(case.seq_lens) // case.compress_ratio + 1))


@pytest.mark.parametrize("case", SPARSE_PREFILL, ids=lambda c: c.name)
def test_dsv4_sparse_prefill_case_gpu(gpu_device, case):
    from test_sglang_dsv4_kit import _TCOurPrefillRoute

    _kit().run_dsv4_compress_attention_case(_TCOurPrefillRoute(), case, device=str(gpu_device), sparse_prefill=True,
                                            extra_entries=max(32, max(case.seq_lens) // case.compress_ratio + 1))


@pytest.mark.parametrize("case", VERIFY, ids=lambda c: c.name)
def test_dsv4_target_verify_case_gpu(gpu_device, case):
    _kit().run_dsv4_target_verify_attention_case(_TC(), case, device=str(gpu_device))


@pytest.mark.parametrize("prefix,accepted", [((30, 77), (3, 3)), ((200,), (1,))])
def test_dsv4_draft_extend_case_gpu(gpu_device, prefix, accepted, monkeypatch):
    import importlib.util
    import types

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    if importlib.util.find_spec("setproctitle") is None:  # the kit's draft runner imports it (process titles)
        stub = types.ModuleType("setproctitle")
        stub.setproctitle, stub.getproctitle = (lambda title: None), (lambda: "")
        monkeypatch.setitem(sys.modules, "setproctitle", stub)
    from test_sglang_dsv4_kit import _compress_case

    case = _compress_case("draft_extend", ForwardMode.DRAFT_EXTEND_V2, 0, prefix, accepted)
    _kit().run_dsv4_draft_extend_attention_case(_TC(), case, device=str(gpu_device))


@pytest.mark.parametrize("prefix", [(5,), (40, 128, 255), (1, 2, 3, 4)])
def test_dsv4_graph_decode_runner_gpu(gpu_device, prefix):
    """The kit's CUDA-graph decode runner with real graphs: capture at the padded batch size, replay per batch,
    against eager and the reference."""
    _kit()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as runner
    from test_sglang_dsv4_kit import _compress_case

    case = _compress_case(f"graph_decode_{len(prefix)}", ForwardMode.DECODE, 0, prefix)
    runner.run_dsv4_cuda_graph_decode_case(_TC(), case, device=str(gpu_device),
                                           cuda_graph_capture_batch_size=max(2, len(prefix)))


def test_dsv4_backend_is_ours_on_gpu(gpu_device):
    kit = _kit()
    from musa_attn_backend import BACKEND_NAME
    from musa_attn_backend.kernels import dsv4
    from musa_attn_backend.sglang.dsv4 import TileLangMusaDSV4Backend

    fixture = kit.build_dsv4_attention_fixture(_TC(), kit.make_dsv4_cases(BACKEND_NAME)[0], dtype=torch.bfloat16,
                                               device=str(gpu_device))
    assert isinstance(fixture.backend, TileLangMusaDSV4Backend)
    assert fixture.backend._flash_mla_with_kvcache is dsv4.flash_mla_with_kvcache
