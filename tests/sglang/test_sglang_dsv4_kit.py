"""SGLang 0.5.23's own DeepSeek-V4 attention kit (``dsv4_attention.py``) against ``tilelang_musa`` on the CPU:
every case of ``make_dsv4_cases`` (SWA only), the compressed-cache cases at ratios 4 and 128 (decode and extend,
the C4 top-k seeded by the kit), its sparse-prefill cases, target verify and draft extend, and the CUDA-graph
decode runner (capture and replay of the metadata, no real graph). The kit compares with its own float reference
from a bf16 stash (``atol = rtol = 8e-2``) on the pool SGLang builds (``DeepSeekV4TokenToKVPool``, FP8 pages of 256).

The kit writes the caches with Triton and saves the CUDA RNG, neither of which runs on a CPU: the test replaces
the kit's packer by the identity and the pool's two store methods by this package's writer (``write_kv_v4``, the
bytes SGLang's own writers produce; checked on the H200), and makes the RNG calls no-ops. Our backend is not
patched: it is the one SGLang's registry builds for the name.
"""

import unittest

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit  # noqa: E402

from musa_attn_backend import BACKEND_NAME  # noqa: E402
from musa_attn_backend.kernels import dsv4  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_kit")


class _TC(unittest.TestCase):
    __test__ = False  # a carrier of assert methods for the kit, not a test

    def runTest(self):  # pragma: no cover - only a carrier for assert methods / skipTest
        pass


def _backend_is_ours(fixture_backend) -> None:
    from musa_attn_backend.sglang.dsv4 import TileLangMusaDSV4Backend

    assert isinstance(fixture_backend, TileLangMusaDSV4Backend), type(fixture_backend)


@pytest.mark.parametrize("case", kit.make_dsv4_cases(BACKEND_NAME), ids=lambda c: c.name)
def test_dsv4_swa_case(case):
    kit.run_dsv4_attention_case(_TC(), case, device="cpu")


def test_the_registry_builds_our_v4_backend():
    case = kit.make_dsv4_cases(BACKEND_NAME)[0]
    fixture = kit.build_dsv4_attention_fixture(_TC(), case, dtype=torch.bfloat16, device="cpu")
    _backend_is_ours(fixture.backend)
    assert fixture.backend._flash_mla_with_kvcache is dsv4.flash_mla_with_kvcache


def _compress_case(name, mode, ratio, prefix, extend=()):
    return kit.DSV4AttentionCase(name=name, backend=BACKEND_NAME, forward_mode=mode, num_heads=64,
                                 page_size=kit.DSV4_PAGE_SIZE, prefix_lens=tuple(prefix), extend_lens=tuple(extend),
                                 compress_ratio=ratio, attn_sink_value=0.5)


# within the kit's pool: 1024 SWA slots, 256 full slots a request (lengths up to 255)
COMPRESS_CASES = [
    _compress_case("c4_decode", ForwardMode.DECODE, 4, (100, 37, 200)),
    _compress_case("c4_extend", ForwardMode.EXTEND, 4, (0, 64), (40, 17)),
    _compress_case("c128_decode", ForwardMode.DECODE, 128, (200, 140)),
    _compress_case("c128_extend", ForwardMode.EXTEND, 128, (130,), (60,)),
]


@pytest.mark.parametrize("case", COMPRESS_CASES, ids=lambda c: c.name)
def test_dsv4_compressed_cache_case(case):
    # the kit fills 32 compressed rows; lengths past them read rows it also wrote (zeros are valid FP8)
    kit.run_dsv4_compress_attention_case(_TC(), case, device="cpu", extra_entries=max(
        32, max(case.seq_lens) // case.compress_ratio + 1))


# The kit's sparse-prefill cases: each query's own causal C4 set ((pos + 1) // 4 rows, the indexer's output for
# short sequences) and the C128 rows, under SGLANG_OPT_FLASHMLA_SPARSE_PREFILL. SGLang's route for them gathers
# the caches into a bf16 workspace for FlashMLA's sparse prefill; ours reads the FP8 caches in both modes, so the
# kit's check that its route ran becomes the check that ours did. Its seeding needs one request on page 0.
SPARSE_PREFILL_CASES = [
    _compress_case("c4_sparse_prefill_fresh", ForwardMode.EXTEND, 4, (0,), (150,)),
    _compress_case("c4_sparse_prefill_prefix", ForwardMode.EXTEND, 4, (64,), (17,)),
    _compress_case("c128_sparse_prefill", ForwardMode.EXTEND, 128, (130,), (60,)),
]


class _TCOurPrefillRoute(_TC):
    __test__ = False

    def assertIsNotNone(self, obj, msg=None):
        if msg and "did not take _forward_prefill_sparse" in msg:
            assert obj is None, "the FlashMLA sparse-prefill workspace was built under tilelang_musa"
            return
        super().assertIsNotNone(obj, msg)


@pytest.mark.parametrize("case", SPARSE_PREFILL_CASES, ids=lambda c: c.name)
def test_dsv4_sparse_prefill_case(case):
    kit.run_dsv4_compress_attention_case(_TCOurPrefillRoute(), case, device="cpu", sparse_prefill=True,
                                         extra_entries=max(32, max(case.seq_lens) // case.compress_ratio + 1))


VERIFY_CASES = [
    _compress_case("verify_swa", ForwardMode.TARGET_VERIFY, 0, (40, 130), (3, 3)),
    _compress_case("verify_c4", ForwardMode.TARGET_VERIFY, 4, (61, 90), (4, 4)),
    _compress_case("verify_c128", ForwardMode.TARGET_VERIFY, 128, (126, 200), (3, 3)),
]


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.name)
def test_dsv4_target_verify_case(case):
    kit.run_dsv4_target_verify_attention_case(_TC(), case, device="cpu")


# the kit sizes draft tokens from the first request's count, so every request accepts as many
@pytest.mark.parametrize("prefix,accepted", [((30, 77), (3, 3)), ((200,), (1,))])
def test_dsv4_draft_extend_case(prefix, accepted):
    case = _compress_case("draft_extend", ForwardMode.DRAFT_EXTEND_V2, 0, prefix, accepted)
    kit.run_dsv4_draft_extend_attention_case(_TC(), case, device="cpu")


@pytest.mark.parametrize("prefix", [(5,), (40, 128, 255), (1, 2, 3, 4)])
def test_dsv4_graph_decode_runner(prefix):
    """The kit's CUDA-graph decode runner: init_cuda_graph_state, the out-of-graph metadata at capture and at each
    padded replay, the in-graph upgrade, against eager and the reference (no real graph on a CPU)."""
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as runner

    case = _compress_case(f"graph_decode_{len(prefix)}", ForwardMode.DECODE, 0, prefix)
    runner.run_dsv4_cuda_graph_decode_case(_TC(), case, device="cpu",
                                           cuda_graph_capture_batch_size=max(2, len(prefix)))


def test_eagle_draft_factories_build_our_v4_backends():
    """SGLang's draft factories key on backend names and refuse ours ("EAGLE is not supported in ... backend");
    for a V4 draft, the multi-step decode backend and the draft-extend backend are ours (each step's too)."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from musa_attn_backend.sglang.dsv4 import TileLangMusaDSV4Backend, TileLangMusaDSV4MultiStepBackend

    case = _compress_case("draft", ForwardMode.DECODE, 0, (20, 30))
    fixture = kit.build_dsv4_attention_fixture(_TC(), case, dtype=torch.bfloat16, device="cpu")
    factory = DraftBackendFactory(fixture.runner, topk=1, speculative_num_steps=3)
    decode = factory.create_decode_backend()
    assert isinstance(decode, TileLangMusaDSV4MultiStepBackend) and len(decode.attn_backends) == 3
    assert all(type(b) is TileLangMusaDSV4Backend for b in decode.attn_backends)
    assert decode.decode_attention_backend_str == BACKEND_NAME
    extend = factory.create_draft_extend_backend()
    assert isinstance(extend, TileLangMusaDSV4Backend)


@pytest.mark.parametrize("setting,value,match", [
    ("page_size", 64, r"needs --page-size 256"),
    ("kv_cache_dtype", "bfloat16", r"FP8 e4m3 KV cache .* got --kv-cache-dtype bfloat16"),
    ("attn_cp_size", 2, r"context parallelism \(attn_cp_size=2\)"),
    ("dcp_size", 2, r"context parallelism \(dcp_size=2\)"),
    ("enable_prefill_cp", True, r"--enable-prefill-cp"),
    ("layout", "v41", r"the SWA cache has the v41 layout"),
])
def test_unsupported_v4_settings_are_refused_at_construction(setting, value, match, monkeypatch):
    """Settings our V4 kernels do not serve stop the backend's construction (at server start) with a message
    naming them; the same runner builds the backend with the setting put back."""
    from musa_attn_backend.sglang.dsv4 import TileLangMusaDSV4Backend

    case = _compress_case("c4_refuse", ForwardMode.DECODE, 4, (100,))
    fixture = kit.build_dsv4_attention_fixture(_TC(), case, dtype=torch.bfloat16, device="cpu",
                                               compression_ratios=[4])
    runner = fixture.runner
    if setting == "page_size":
        monkeypatch.setattr(runner, "page_size", value)
    elif setting == "layout":
        monkeypatch.setattr(type(runner.token_to_kv_pool), "get_swa_key_layout", lambda self: value)
    else:  # SGLang's resolved server args are read-only: an overlay with the one setting changed
        real = runner.server_args

        class Overlay:
            def __getattr__(self, name):
                return value if name == setting else getattr(real, name)

        monkeypatch.setattr(runner, "server_args", Overlay())
    with pytest.raises(ValueError, match=match):
        TileLangMusaDSV4Backend(runner)
    monkeypatch.undo()
    assert isinstance(TileLangMusaDSV4Backend(runner), TileLangMusaDSV4Backend)
