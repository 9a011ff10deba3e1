"""SGLang 0.5.23's own attention test kit, run against ``tilelang_musa`` (CPU: the reference ops; GPU with
``-m gpu``: the TileLang kernels).

The kit builds a mock model runner with SGLang's real ``ReqToTokenPool`` and ``MHATokenToKVPool``, writes
prefix K/V through the pool, runs the backend found in SGLang's registry under our name (registered by our
entry point through ``load_plugins``) and compares with its own PyTorch reference.
"""

import functools
import unittest

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402

from musa_attn_backend import BACKEND_NAME  # noqa: E402

# Our decode window includes the current token (keys q-W .. q), the kit's "extend_window" rule.
kit._SWA_DECODE_EXTEND_WINDOW = kit._SWA_DECODE_EXTEND_WINDOW | {BACKEND_NAME}


def _case(name, mode, *, heads=4, kv_heads=4, page=16, prefix=(0,), extend=None, window=None):
    kw = dict(name=name, backend=BACKEND_NAME, forward_mode=mode, num_heads=heads, num_kv_heads=kv_heads,
              page_size=page, prefix_lens=tuple(prefix))
    if extend is not None:
        kw["extend_lens"] = tuple(extend)
    if window is not None:
        kw["sliding_window_size"] = window
    return kit.DenseAttentionCase(**kw)


EXTRA = [
    _case("extend_batch1_single_token", ForwardMode.EXTEND, prefix=(0,), extend=(1,)),
    _case("extend_empty_prefix_gqa_page1", ForwardMode.EXTEND, heads=8, kv_heads=2, page=1, prefix=(0, 0),
          extend=(7, 33)),
    _case("mixed_mode_prefix_and_fresh", ForwardMode.MIXED, heads=8, kv_heads=2, prefix=(40, 0, 5),
          extend=(1, 20, 1)),
    _case("extend_long_context_page64", ForwardMode.EXTEND, heads=4, kv_heads=1, page=64, prefix=(300,),
          extend=(37,)),
    _case("decode_batch64_page1", ForwardMode.DECODE, heads=8, kv_heads=2, page=1,
          prefix=tuple((7 * i) % 50 + 1 for i in range(64))),
    _case("decode_long_context", ForwardMode.DECODE, heads=8, kv_heads=2, page=16, prefix=(420, 3)),
]

CASES = (list(kit.make_dense_cases(BACKEND_NAME)) + list(kit.make_swa_no_prefix_input_config_cases(BACKEND_NAME))
         + list(kit.make_swa_prefix_input_config_cases(BACKEND_NAME)) + EXTRA)
LAYOUTS = ["shuffled_pages", "interleaved_pages", "non_monotonic_extend"]


class _TC(unittest.TestCase):
    def runTest(self):  # pragma: no cover - only a carrier for assert methods / skipTest
        pass


def _max_context(case):
    need = max(p + e for p, e in zip(case.prefix_lens, case.input_lens)) + 1
    return max(kit.DEFAULT_MAX_CONTEXT_LEN, -(-need // case.page_size) * case.page_size + case.page_size)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kit_case_cpu(case, layout):
    if layout == "non_monotonic_extend" and case.forward_mode.is_decode():
        pytest.skip("layout applies to extend batches")
    if layout == "non_monotonic_extend" and case.page_size > 1:
        # It permutes tokens inside a request's slots, which SGLang's paged allocator never does for
        # page_size > 1 (position p of a page always sits at offset p % page_size); we read pages.
        pytest.skip("token-granular scatter is a page_size 1 layout")
    with torch.no_grad():
        kit.run_dense_attention_case(_TC(), case, device="cpu", dtype=torch.float32, loc_layout=layout,
                                     max_context_len=_max_context(case))


def test_registry_has_our_factory():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from musa_attn_backend.sglang.backend import create_backend

    assert ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
    assert ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1


def test_backend_is_a_module_level_attention_backend():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from musa_attn_backend.sglang import backend

    assert issubclass(backend.TileLangMusaAttnBackend, AttentionBackend)
    assert backend.TileLangMusaAttnBackend.__qualname__ == "TileLangMusaAttnBackend"


def test_backend_refuses_unsupported_model(monkeypatch):
    from musa_attn_backend.sglang import backend

    runner = type("R", (), dict(device="cpu", page_size=1, dtype=torch.int8, req_to_token_pool=None,
                                token_to_kv_pool=None))()
    with pytest.raises(ValueError, match="model dtype torch.int8 is not supported"):
        backend.create_backend(runner)
    runner.dtype = torch.bfloat16
    runner.use_mla_backend = True
    with pytest.raises(ValueError, match="MLA"):
        backend.create_backend(runner)


# --------------------------------------------------------------------------------------------------- GPU
GPU_CASES = [c for c in CASES if c.name in {
    "mha_extend_page_size_1", "mha_extend_ragged_page_boundary", "gqa_decode_page_boundary",
    "mqa_extend_total_exact_page", "swa_extend_prefix_window_edges", "mixed_mode_prefix_and_fresh",
    "decode_batch64_page1", "decode_long_context"}]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_kit_case_gpu_tilelang(case, gpu_device):
    """The same kit cases on the GPU: the backend runs the TileLang kernels (bf16, head dim 64)."""
    with torch.no_grad():
        kit.run_dense_attention_case(_TC(), case, device=gpu_device, dtype=torch.bfloat16,
                                     max_context_len=_max_context(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.forward_mode.is_decode()], ids=lambda c: c.name)
def test_kit_decode_cuda_graph_capture_and_replay(case, gpu_device):
    """Decode captured into a CUDA graph and replayed on padded batches equals eager (kit runner)."""
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        run_dense_cuda_graph_decode_case)

    if gpu_device != "cuda":
        pytest.skip("the kit's graph runner drives torch.cuda graphs")
    with torch.no_grad():
        run_dense_cuda_graph_decode_case(_TC(), case, device=gpu_device, dtype=torch.bfloat16,
                                         max_context_len=_max_context(case),
                                         cuda_graph_capture_batch_size=max(4, case.batch_size))


# --------------------------------------------------------------------------------------------------- verify
VERIFY_CASES = [
    _case("verify_chain4_page16", ForwardMode.TARGET_VERIFY, heads=8, kv_heads=2, page=16, prefix=(40, 3, 17),
          extend=(4, 4, 4)),
    _case("verify_chain2_page1_mha", ForwardMode.TARGET_VERIFY, page=1, prefix=(9, 1), extend=(2, 2)),
    _case("verify_chain8_page64_long", ForwardMode.TARGET_VERIFY, heads=8, kv_heads=1, page=64, prefix=(300, 64),
          extend=(8, 8)),
    _case("verify_chain3_window", ForwardMode.TARGET_VERIFY, heads=4, kv_heads=2, page=16, prefix=(50, 12),
          extend=(3, 3), window=8),
]


def _verify(case, device, dtype, **kw):
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        run_dense_spec_verify_case)

    with torch.no_grad():
        run_dense_spec_verify_case(_TC(), case, device=device, dtype=dtype, max_context_len=_max_context(case),
                                   **kw)


@pytest.mark.parametrize("spec_kind", ["eagle", "dflash", "frozen_kv_mtp"])
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.name)
def test_kit_target_verify_chain_cpu(case, spec_kind):
    """Speculative verify (TARGET_VERIFY) with chain drafts, through the kit's verify runner: the draft
    tokens attend to the accepted prefix and causally to each other (the kit's custom-mask reference)."""
    _verify(case, "cpu", torch.float32, topk=1, spec_kind=spec_kind)


@pytest.mark.parametrize("spec_kind,topk", [("eagle", 2), ("ngram", 1)])
def test_kit_target_verify_tree_is_refused(spec_kind, topk):
    case = _case("verify_tree", ForwardMode.TARGET_VERIFY, heads=4, kv_heads=2, page=16, prefix=(10, 5),
                 extend=(3, 3))
    with pytest.raises(NotImplementedError, match="tree attention mask"):
        _verify(case, "cpu", torch.float32, topk=topk, spec_kind=spec_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.name)
def test_kit_target_verify_gpu(case, gpu_device):
    """Verify on the GPU (the split-KV decode kernel with 2-8 query tokens per request), bf16."""
    _verify(case, gpu_device, torch.bfloat16, topk=1, spec_kind="eagle")


def _verify_graph(case, device, dtype, monkeypatch):
    """The kit's speculative CUDA-graph runner: an eager leg on the graph fixture, then capture-time metadata
    (``init_forward_metadata_out_graph`` into the persistent buffers) and a replay on a batch padded to the
    capture size, each compared with the reference. The runner rewrites the prefix K/V at the kit's
    contiguous slots (``prepare_dense_runner_inputs`` ignores the fixture's slot layout), so the fixture is
    built with that layout too; with the default shuffled pages the eager leg reads a cache the runner has
    partly overwritten, for any backend."""
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as runner

    monkeypatch.setattr(runner, "build_dense_attention_fixture",
                        functools.partial(kit.build_dense_attention_fixture, loc_layout="contiguous"))
    with torch.no_grad():
        runner.run_dense_spec_verify_cuda_graph_case(_TC(), case, topk=1, device=device, dtype=dtype,
                                                     max_context_len=_max_context(case),
                                                     cuda_graph_capture_batch_size=max(4, case.batch_size + 1))


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.name)
def test_kit_target_verify_graph_metadata_cpu(case, monkeypatch):
    """Verify through the persistent graph buffers (capture, then a padded replay) on the CPU reference path."""
    _verify_graph(case, "cpu", torch.float32, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.name)
def test_kit_target_verify_cuda_graph(case, gpu_device, monkeypatch):
    """The same on the GPU (TileLang kernels), bf16."""
    _verify_graph(case, gpu_device, torch.bfloat16, monkeypatch)


def test_other_speculative_modes_are_refused_not_misread():
    from musa_attn_backend.metadata import sglang as sglang_meta

    for mode in (ForwardMode.DRAFT_EXTEND_V2, ForwardMode.DLLM_EXTEND):
        fb = type("FB", (), {"forward_mode": mode})()
        with pytest.raises(NotImplementedError, match=mode.name):
            sglang_meta.forward_batch_meta(fb, None, 1)


# --------------------------------------------------------------------------------------------------- new K/V
def _spy_new_kv(monkeypatch):
    """Record, per layer call, whether the batch was flagged free of cached prefixes and the new K/V passed."""
    from musa_attn_backend.sglang import backend

    seen = []
    real = backend.paged_attention

    def spy(q, k_cache, v_cache, meta, **kw):
        nkv = kw.get("new_kv")
        seen.append((meta.new_kv_only, None if nkv is None else tuple(tuple(x.shape) for x in nkv)))
        return real(q, k_cache, v_cache, meta, **kw)

    monkeypatch.setattr(backend, "paged_attention", spy)
    return seen


@pytest.mark.parametrize("name,flagged", [("extend_empty_prefix_gqa_page1", True),
                                          ("mixed_mode_prefix_and_fresh", False),
                                          ("extend_long_context_page64", False)])
def test_extend_without_prefixes_hands_over_new_kv(monkeypatch, name, flagged):
    """An extend batch whose requests have no cached prefix (SGLang's host ``extend_prefix_lens_cpu``) is flagged
    ``new_kv_only`` and its new K/V, as written into the pool, go along with the call (the GPU prefill may read
    them instead of the pages); any prefix, or decodes in a mixed batch, and it is not flagged."""
    case = next(c for c in CASES if c.name == name)
    seen = _spy_new_kv(monkeypatch)
    with torch.no_grad():
        kit.run_dense_attention_case(_TC(), case, device="cpu", dtype=torch.float32,
                                     max_context_len=_max_context(case))
    assert seen and all(f == flagged for f, _ in seen), seen
    tokens = sum(case.input_lens)
    assert all(shapes == ((tokens, case.num_kv_heads, kit.DEFAULT_HEAD_DIM),) * 2 for _, shapes in seen), seen


@pytest.mark.gpu
def test_kit_extend_new_kv_prefill_gpu(monkeypatch, use_settings, gpu_device):
    """On the GPU, by default: a prefill without cached prefixes at page 1 runs the TMA
    ping-pong kernel on the new K/V rows (SGLang's k / v views), and matches the kit's reference."""
    from musa_attn_backend.kernels.attention import tilelang_impl

    use_settings(new_kv_prefill=True)  # the default
    ragged = []
    real = tilelang_impl.prefill_kernel
    monkeypatch.setattr(tilelang_impl, "prefill_kernel",
                        lambda *a, **k: ragged.append(k.get("ragged", False)) or real(*a, **k))
    case = _case("extend_new_kv_page1", ForwardMode.EXTEND, heads=8, kv_heads=2, page=1, prefix=(0, 0, 0),
                 extend=(7, 300, 129))
    with torch.no_grad():
        kit.run_dense_attention_case(_TC(), case, device=gpu_device, dtype=torch.bfloat16, head_dim=128,
                                     hidden_size=256, max_context_len=_max_context(case))
    assert ragged and all(ragged), ragged


def test_extend_writes_sglang_output_buffer_in_place(monkeypatch):
    """Where SGLang hands the call an output buffer (``ForwardBatch._attn_output``: piecewise prefill graphs,
    padded extend batches), the kernels write it and it is what the backend returns, so SGLang copies nothing;
    the kit's reference still matches."""
    from musa_attn_backend.sglang import backend

    seen = []
    real = backend.TileLangMusaAttnBackend.forward_extend

    def forward_extend(self, q, k, v, layer, fb, *a, **kw):
        fb._attn_output = torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), float("nan"),
                                     dtype=q.dtype)
        try:
            res = real(self, q, k, v, layer, fb, *a, **kw)
        finally:
            buf, fb._attn_output = fb._attn_output, None
        seen.append(res.data_ptr() == buf.data_ptr() and res.shape == buf.shape)
        return res

    monkeypatch.setattr(backend.TileLangMusaAttnBackend, "forward_extend", forward_extend)
    case = next(c for c in CASES if c.name == "mixed_mode_prefix_and_fresh")
    with torch.no_grad():
        kit.run_dense_attention_case(_TC(), case, device="cpu", dtype=torch.float32,
                                     max_context_len=_max_context(case))
    assert seen and all(seen), seen
