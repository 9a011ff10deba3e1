"""Degenerate batches through this package's vLLM 0.33.0 hooks on a CPU: they never crash and never corrupt.

What vLLM 0.33 really sends (``vllm/`` paths inside the wheel):

- **0 tokens: never.** Model runner V2 (the default where Triton runs) returns before the forward when the
  scheduler scheduled nothing (``v1/worker/gpu/model_runner.py:1792-1796``) and when every DP rank has nothing
  (``:1850-1853``); its dummy batches assert ``0 < num_reqs <= num_tokens`` (``v1/worker/gpu/input_batch.py:143``).
  The V1 runner returns early on no scheduled tokens too (``v1/worker/gpu_model_runner.py:3955-3971``). We still
  run 0 tokens, with and without metadata: the contract is an empty output.
- **DP dummy batches:** an idle DP rank runs ``_dummy_run(1 or 1 + spec, uniform_decode=True)``
  (``v1/worker/gpu_worker.py:1466-1472``), padded by the DP sync to the other ranks' size: requests of one token
  (``seq_lens`` 1), every position 0, block tables of the null block 0, every slot ``-1``
  (``v1/worker/gpu/input_batch.py:135-205``, ``model_runner.py:1617-1631``, ``block_table.py:213-271``), with
  attention metadata built; its tokens flagged ``is_padding``. The profile run (``skip_attn``) and the V1 runner's
  dummy runs outside FULL graphs pass no attention metadata (``model_runner.py:1938-1951``; V1
  ``gpu_model_runner.py:5615-5640``).
- **CUDA-graph padding:** our V4 builders declare no CUDA-graph support, so vLLM runs these layers eagerly inside
  PIECEWISE/breakable graphs (``config/compilation.py:1420-1445``): the layer gets ``num_tokens_after_padding`` rows
  while the metadata counts the real ones (``v1/worker/gpu/model_states/default.py:179-186``); the slot mapping
  past them is ``-1`` (``block_table.py:229-260``, V1 ``gpu_model_runner.py:3866-3870``), the padding rows'
  positions are whatever the buffer held (``input_batch.py:357-390`` writes only real rows). FULL graphs (not
  ours) also pad requests: no rows, ``seq_lens`` 0, ``query_start_loc`` repeated (``model_runner.py:1464-1468``,
  ``input_batch.py:368-374``).
- **A request of no new token** is never scheduled into a batch by vLLM; zero-length request rows appear only as
  FULL-graph padding. We run both (context and no rows; neither).
- **The largest decode batch** vLLM captures by default: 512 tokens (``config/vllm.py:2398-2470``: ``min(max_num_seqs
  * decode_query_len * 2, 512)``, 1024 on data-centre Blackwell only). Run here at 512 (about 10 s on this CPU).
- **MoE ids of -1:** with ``VLLM_MOE_SKIP_PADDING`` (default on) V4's router writes ``topk_ids = -1`` and weight 0
  for every padding token (``model_executor/layers/fused_moe/router/fused_topk_bias_router.py:28-32,181-201``,
  ``router/dsv4_topk.py:111-114``); expert parallelism without all2all maps other ranks' experts to ``-1``
  through ``expert_map``. vLLM's top-k routers pick distinct experts (hash-routed layers take theirs from the
  checkpoint's table); the contract for a repeated id (the sum of both choices) is tested anyway.

The driver (:mod:`musa_attn_backend.testing.vllm_dsv4_degenerate`, one fresh interpreter, about a minute) builds the
tiny V4's four layers (ratios 0/4/128/4) with vLLM's constructors, caches planned and bound by vLLM in one buffer
of random bytes, and every case starts from the same cache bytes. Checked per case:

- the degenerate tokens' outputs against the independent float32 forward (``dsv4_reference``): mean |error| under
  4% and largest under 30% of the mean |output| per layer (observed at most 2.6% and 11%; the single-token versions
  of ``test_vllm_dsv4_layer``'s bounds, whose wrong-math variants give 4.5-43% or 0.57-16);
- the other tokens' outputs against the same batch without the degenerate part: within 1% of the mean |output|
  (observed: identical);
- no cache byte written outside the degenerate requests' own blocks (the real requests' float32 compressor-state
  rows may differ in the last bits only: this CPU's float32 GEMM rounds a row differently from one batch size to
  another; observed 2.4e-7); nothing written at all by dummy, profile and 0-token runs.

The MoE cases run vLLM's FP8 MoE kernel (``FusedMoEFactory`` + ``Fp8Config`` 128 x 128, the no-EP
prepare/finalize and our experts class) against ``kernels.moe.fused_experts_reference``, at 6 tokens (the masked
layout) and 100 (the contiguous one) and 512.

The dense ``TILELANG_MUSA`` backend's builder and impl take 0 tokens, a zero-length request and padded rows too
(in-process, last tests).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

REF_MEAN, REF_MAX = 0.04, 0.3  # per layer, of the mean |output| (see the module docstring)
OTHERS_REL = 0.01
STATE_DIFF = 1e-5


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_degenerate") / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               VLLM_TARGET_DEVICE="cpu", MUSA_ATTN_MOE="on", VLLM_LOGGING_LEVEL="WARNING")
    run = subprocess.run([sys.executable, "-m", "musa_attn_backend.testing.vllm_dsv4_degenerate", str(out)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    return json.loads(out.read_text())


def _case(report, part, name):
    res = report[part][name]
    assert "error" not in res, (name, res["error"])
    return res


def _refs_close(res):
    for token, layers in res["ref"].items():
        for layer, (mean, mx) in layers.items():
            assert mean < REF_MEAN and mx < REF_MAX, (token, layer, mean, mx)


def _no_corruption(res):
    assert res["others_rel"] <= OTHERS_REL, res
    assert res["cache_foreign_blocks"] == 0, res
    assert res["state_diff"] < STATE_DIFF, res


# ------------------------------------------------------------------------------------------------ V4 attention
def test_single_decode_token(report):
    res = _case(report, "attention", "single_decode")
    _refs_close(res)
    assert res["others_rel"] <= OTHERS_REL, res  # alone as in a batch of two


@pytest.mark.parametrize("name", ["one_token_prompt", "short_prompt_first_chunk", "padded_mixed"])
def test_request_without_context(report, name):
    """A 1-token prompt and a first prefill chunk (context 0) next to decoding requests (padded, too)."""
    res = _case(report, "attention", name)
    _refs_close(res)
    _no_corruption(res)


def test_zero_length_requests(report):
    """A request with context and no rows, and one with neither, between two decoding requests."""
    res = _case(report, "attention", "zero_length_requests")
    assert res["rows"] == 2
    _no_corruption(res)


@pytest.mark.parametrize("name,rows", [("padded_decode", 8), ("full_graph_padding", 4)])
def test_padded_rows_change_nothing(report, name, rows):
    """Padding rows (slot -1, stale positions, junk hidden states): the real rows equal the unpadded batch's and
    nothing is written for them; also with FULL-graph-style padded requests counted as actual tokens."""
    res = _case(report, "attention", name)
    assert res["rows"] == rows
    _no_corruption(res)


@pytest.mark.parametrize("name,rows", [("dp_dummy_1", 1), ("dp_dummy_4", 4)])
def test_dp_dummy_batch_writes_nothing(report, name, rows):
    res = _case(report, "attention", name)
    assert res["rows"] == rows and res["cache_changed_blocks"] == 0, res


@pytest.mark.parametrize("name,rows", [("profile_0", 0), ("profile_64", 64)])
def test_runs_without_metadata_give_zeros(report, name, rows):
    res = _case(report, "attention", name)
    assert res["rows"] == rows and res["all_zero"] and res["cache_changed_blocks"] == 0, res


@pytest.mark.parametrize("name", ["zero_tokens_empty_batch", "zero_tokens_zero_length_request"])
def test_zero_tokens_give_an_empty_output(report, name):
    res = _case(report, "attention", name)
    assert res["shapes"] == [[0, 256]] * 4 and res["cache_changed_blocks"] == 0, res


def test_largest_captured_decode_batch(report):
    res = _case(report, "attention", "large_decode")
    assert res["tokens"] == 512 and res["finite"], res
    _refs_close(res)
    _no_corruption(res)  # A's and B's rows and caches as in their batch of two


# ------------------------------------------------------------------------------------------------------- MoE
def _moe_close(res, key="ref_diff"):
    assert res[key] <= 0.01 * res["ref_abs"], res  # observed exactly 0: the same math on a CPU


def test_moe_is_ours(report):
    assert report["moe"]["experts_cls"] == "MusaBlockFp8Experts", report["moe"]


def test_moe_zero_tokens(report):
    assert _case(report, "moe", "zero_tokens")["shape"] == [0, 256]


def test_moe_one_token(report):
    res = _case(report, "moe", "one_token")
    assert res["shape"] == [1, 256] and res["ref_abs"] > 0.1
    _moe_close(res)


@pytest.mark.parametrize("kind,T", [(k, T) for T in (6, 100) for k in
                                    ("repeated", "repeated_crowded", "dropped_all", "dropped_one", "unmapped")]
                         + [("padded", 512)])
def test_moe_degenerate_routing(report, kind, T):
    """``repeated``: an expert twice in one token's top-k (the sum of both choices; ``crowded``: every token also
    picks it, so it gets more choices than tokens); ``dropped_all``: ids -1 (weights 0 or not): a zero row;
    ``dropped_one``: one choice -1; ``unmapped``: both choices on another rank; ``padded``: the last 40 of 512 rows
    are vLLM's padding. Against the reference, and the other tokens against the batch without the degenerate ones."""
    res = _case(report, "moe", f"{kind}_T{T}")
    _moe_close(res)
    _moe_close(res, "ref_diff_degenerate_rows")
    _moe_close(res, "others_diff")
    if kind in ("dropped_all", "unmapped", "padded"):
        assert res["degenerate_rows_abs"] == 0.0, res
    else:
        assert res["degenerate_rows_abs"] > 0.1, res


# -------------------------------------------------------------------------------- the dense TILELANG_MUSA backend
def _dense_run(qlens, seqs, table, pad=0, flat_output=False):
    """Builder + impl on one batch (NHD cache of random values, block size 16, 4 query and 2 KV heads of 64):
    returns ``(output, cache after)``; ``pad`` rows past the batch with slot -1 (a padded batch)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    H, HKV, D, BS = 4, 2, 64, 16
    vc = VllmConfig()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    builder = TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], vc, torch.device("cpu"))
    with set_current_vllm_config(vc):
        impl = TileLangMusaBackend.get_impl_cls()(num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=HKV,
                                                  alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(8, BS, HKV, 2 * D, generator=g).permute(0, 2, 1, 3)
    qsl = torch.tensor([0] + torch.tensor(qlens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
    T = int(qsl[-1])
    slots = [table[i].long()[torch.arange(s - q, s) // BS] * BS + torch.arange(s - q, s) % BS
             for i, (q, s) in enumerate(zip(qlens, seqs))] + [torch.full((pad,), -1, dtype=torch.long)]
    seq = torch.tensor(seqs, dtype=torch.int32)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(qlens),
                                 num_actual_tokens=T, max_query_len=max(qlens, default=0),
                                 max_seq_len=max(seqs, default=0), block_table_tensor=table,
                                 slot_mapping=torch.cat(slots), causal=True, seq_lens_cpu_upper_bound=seq)
    md = builder.build(0, cm)
    # each request's rows drawn from its own generator: a request's rows are the same in every batch
    rows = [torch.randn(q, H + 2 * HKV, D, generator=torch.Generator().manual_seed(10 + s)) for q, s in
            zip(qlens, seqs)] + [100 * torch.randn(pad, H + 2 * HKV, D, generator=g)]
    x = torch.cat(rows)
    q, k, v = x[:, :H], x[:, H:H + HKV], x[:, H + HKV:]
    out = torch.full((T + pad, H * D) if flat_output else (T + pad, H, D), float("nan"))
    layer = type("L", (), {})()
    impl.do_kv_cache_update(layer, k, v, kv, md.slot_mapping)
    impl.forward(layer, q, k, v, kv, md, out)
    return out.view(T + pad, H, D), kv


TABLE = torch.tensor([[3, 7, -1], [5, 1, 2], [0, 4, 6]], dtype=torch.int32)


@pytest.mark.parametrize("flat", [False, True], ids=["output_3d", "output_2d"])
def test_dense_backend_zero_tokens(flat):
    out, kv = _dense_run([], [], torch.zeros(0, 3, dtype=torch.int32), flat_output=flat)
    assert out.shape == (0, 4, 64)
    with_pad, kv_pad = _dense_run([], [], torch.zeros(0, 3, dtype=torch.int32), pad=3, flat_output=flat)
    assert with_pad.shape == (3, 4, 64)
    fresh = torch.randn(8, 16, 2, 128, generator=torch.Generator().manual_seed(0)).permute(0, 2, 1, 3)
    assert torch.equal(kv, fresh) and torch.equal(kv_pad, fresh)  # nothing written


def test_dense_backend_degenerate_rows_change_nothing():
    """A zero-length request between two others, and 5 padding rows (slot -1): the real rows and the cache equal
    those of the plain batch; a single decode token alone equals itself in the batch."""
    plain, kv_plain = _dense_run([1, 3], [20, 30], TABLE[[0, 2]])
    table = TABLE[[0, 1, 2]]
    zero_len, kv_zero = _dense_run([1, 0, 3], [20, 17, 30], table)
    padded, kv_padded = _dense_run([1, 3], [20, 30], TABLE[[0, 2]], pad=5, flat_output=True)
    single, _ = _dense_run([1], [20], TABLE[:1])
    assert torch.isfinite(plain).all()
    assert torch.equal(zero_len, plain) and torch.equal(kv_zero, kv_plain)
    assert torch.equal(padded[:4], plain) and torch.equal(kv_padded, kv_plain)
    assert torch.allclose(single[0], plain[0], rtol=1e-5, atol=1e-6)
