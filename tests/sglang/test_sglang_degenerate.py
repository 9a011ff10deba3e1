"""Degenerate batches through every SGLang 0.5.23 hook this package installs for DeepSeek-V4, on a CPU: zero
tokens, a single token, the largest decode batch SGLang's CUDA graphs capture, zero-length requests, index sets
with no valid entry, CUDA-graph padding rows, and MoE routings with a repeated or a dropped (-1) expert id. Each
must give what the contract says (an empty output of the right shape, the references' rows, the sum of both
choices of a repeated expert) and never change another token's result.

What SGLang really sends (sglang 0.5.23 wheel, ``sglang/srt/``):

- **IDLE, unpadded** (data-parallel attention, a rank with no request, DP ``SUM_LEN``): every batch tensor empty
  (``managers/schedule_batch.py`` ``prepare_for_idle``, ``model_executor/forward_batch_info.py`` ``init_new``:
  ``positions`` empty). The eager runner builds no attention metadata and sets ``forward_metadata = None``
  (``model_executor/runner/eager_runner.py`` ``_execute_idle``); the V4 attention returns before the backend when
  its input has no row, unless the input is scattered over attention TP (``models/deepseek_v4.py``, the
  attention's ``forward``). The model-side kernels (mHC, the MoE, the head) still run on 0 rows.
- **IDLE, padded** (DP ``MAX_LEN``: ``forward_batch_info.py`` ``prepare_mlp_sync_batch``): ``batch_size`` becomes
  the padded token count, ``_pad_inputs_to_size`` pads ``req_pool_indices`` / ``out_cache_loc`` / ``positions``
  with 0 and ``seq_lens`` with the backend's fill value (1); the mode stays IDLE and the eager runner builds
  metadata for these rows.
- **CUDA-graph padded decode**: the graph buffers' padded tail is ``req_pool_indices = 0``, ``out_cache_loc = 0``,
  ``positions = 0``, ``seq_lens = 1`` (``model_executor/cuda_graph_buffer_registry.py`` ``build_decode_registry``);
  request slot 0 is SGLang's reserved padding row (``mem_cache/memory_pool.py`` ``ReqToTokenPool``) and full slot 0
  its padding slot. An IDLE rank replaying a graph gets the same rows from the V4 backend's out-of-graph step
  (``layers/attention/deepseek_v4_backend.py`` ``init_forward_metadata_out_graph``).
- **The largest captured decode batch**: ``cuda_graph_max_bs`` is no longer in ``server_args.py``; it is
  ``cuda_graph_config.decode.max_bs``, sized by GPU memory in ``arg_groups/memory_hook.py`` (at most 512: H200 or
  H20 with TP >= 4, B200 / MI300), and capped by ``max_running_requests`` (256 for V4 by default,
  ``arg_groups/deepseek_v4_hook.py``) when left at its default. 512 is tested here.

The model hooks run in a fresh interpreter after ``load_plugins()``, called through SGLang's names, as SGLang's
processes load them (``test_sglang_dsv4_model_hooks.py``); the attention backend runs on SGLang's own V4 pool and
metadata builders (SGLang's V4 attention kit, as ``test_sglang_dsv4_kit.py``); the MoE paths through a real
``MoeRunner`` (as ``test_sglang_moe.py``).
"""

import json
import os
import subprocess
import sys
import types
import unittest
from pathlib import Path

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.layers.moe.moe_runner import runner as sglang_runner  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoeQuantInfo  # noqa: E402
from sglang.srt.layers.moe.moe_runner.runner import MoeRunner  # noqa: E402
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import MoeRunnerBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit  # noqa: E402

from musa_attn_backend import BACKEND_NAME  # noqa: E402
from musa_attn_backend.kernels import dsv4  # noqa: E402
from musa_attn_backend.kernels import moe as moe_ops  # noqa: E402
from musa_attn_backend.kernels.dsv4 import layout as L  # noqa: E402
from musa_attn_backend.sglang import moe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRAPH_MAX_BS = 512  # the largest decode batch SGLang 0.5.23 captures by default (module docstring)

# ----------------------------------------------------------------------------------------------------------------
# 1. The model hooks (model_hooks.py), through SGLang's names in a fresh interpreter
# ----------------------------------------------------------------------------------------------------------------

HOOK_CHECKS = """
import json, sys, time, traceback
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.models.deepseek_v4 as model
import sglang.srt.models.deepseek_v2 as v2
from sglang.kernels.ops.layernorm import mhc, mhc_head
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
from sglang.srt.mem_cache import allocation
import sglang.srt.runtime_context as rc
from musa_attn_backend.kernels.dsv4 import model as ops

ROWS = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(0)
MAXPOS, N, H = 600, 4, 64  # positions of the RoPE table, mHC streams, stream width
ang = torch.rand(MAXPOS, 32, generator=g) * 6.3
freqs = torch.polar(torch.ones(MAXPOS, 32), ang)
cos, sin = freqs.real.contiguous(), freqs.imag.contiguous()  # the table the reference reads (not ours)
fn = torch.randn(N * (N + 2), N * H, generator=g) * 0.05
sc, base = torch.rand(3, generator=g) + 0.5, torch.randn(N * (N + 2), generator=g) * 0.1
norm_w = torch.rand(H, generator=g) + 0.5
R = "reference"
results = {}


def bf16(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def positions(T):
    p = torch.randint(0, MAXPOS, (T,), generator=g)
    if T > 1:
        p[0], p[-1] = 0, MAXPOS - 1
    return p


def close(a, b, what, tol=2 ** -7):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, tuple(a.shape), a.dtype, tuple(b.shape), b.dtype)
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=1e-5, msg=lambda m: f"{what}: {m}")


def per_row(run, T, what, *shapes):
    # the T-row call: its first outputs have the given shapes, and every output row equals that row run alone (no
    # row depends on another)
    outs, _ = run(None)
    got = [tuple(o.shape) for o in outs[:len(shapes)]]
    assert got == list(shapes), (what, got, shapes)
    if T < 2:
        return
    for r in (0, T // 2 + 1, T - 1):
        single, _ = run(r)
        for a, b in zip(outs, single):
            close(a[r:r + 1], b, f"{what}: row {r} of {T} against the row alone")


times = {}


def check(name, T):
    def deco(f):
        key = f"{name}[{T}]"
        t0 = time.perf_counter()
        try:
            f(T)
            results[key] = None
        except BaseException as e:  # noqa: BLE001 - reported per case to the test
            results[key] = f"{type(e).__name__}: {e}\\n" + traceback.format_exc()[-2500:]
        times[key] = round(time.perf_counter() - t0, 2)
        return f
    return deco


for T in ROWS:
    q_in, pos = bf16(T, 4, 512, scale=3), positions(T)

    @check("fused_q_norm_rope", T)
    def _(T):
        def run(r):
            q = q_in if r is None else q_in[r:r + 1]
            p = pos if r is None else pos[r:r + 1]
            outs = []
            for eps in (1e-6, None):
                out = torch.empty_like(q)
                assert model.fused_q_norm_rope(q, out, eps, freqs, p) is None
                close(out, ops.q_norm_rope(q, eps, cos, sin, p, impl=R), f"eps={eps}")
                fp8 = torch.empty_like(q, dtype=torch.float8_e4m3fn)
                model.fused_q_norm_rope(q, fp8, eps, freqs, p)
                assert torch.equal(fp8.float(), out.to(torch.float8_e4m3fn).float()), "FP8 out: the bf16 result cast"
                outs += [out, fp8]
            return outs, None
        per_row(run, T, "fused_q_norm_rope", *[(T, 4, 512)] * 4)

    @check("fused_rope_inplace", T)
    def _(T):
        def run(r):
            q = (q_in if r is None else q_in[r:r + 1]).clone()
            p = pos if r is None else pos[r:r + 1]
            k = q[:, :1, -64:].clone()
            want_q, want_k = q.clone(), k.clone()
            ops.rope_(want_q[..., -64:], cos, sin, p, True, impl=R)
            ops.rope_(want_k, cos, sin, p, True, impl=R)
            model.fused_rope_inplace(q[..., -64:], k, freqs, p, inverse=True)
            close(q, want_q, "q (nope dims untouched, rope dims rotated back)")
            close(k, want_k, "k")
            return [q, k], None
        per_row(run, T, "fused_rope_inplace", (T, 4, 512))

    @check("fused_norm_rope_inplace", T)
    def _(T):
        kv0, w = bf16(T, 512, scale=3), torch.rand(512, generator=g) + 0.5
        def run(r):
            kv = (kv0 if r is None else kv0[r:r + 1]).clone()
            p = pos if r is None else pos[r:r + 1]
            want = ops.norm_rope_(kv.clone(), w, 1e-6, cos, sin, p, impl=R)
            assert model.fused_norm_rope_inplace(kv, w, 1e-6, freqs, p) is None
            close(kv, want, "kv")
            return [kv], None
        per_row(run, T, "fused_norm_rope_inplace", (T, 512))

    @check("silu_and_mul_clamp", T)
    def _(T):
        x0 = bf16(T, 256, scale=8)
        def run(r):
            x = x0 if r is None else x0[r:r + 1]
            y = torch.empty(x.shape[0], 128, dtype=torch.bfloat16)
            assert v2.silu_and_mul_clamp(x, y, 10.0) is None
            close(y, ops.silu_and_mul_clamp(x, 10.0, impl=R), "y")
            return [y], None
        per_row(run, T, "silu_and_mul_clamp", (T, 128))

    res = bf16(T, N, H, scale=2)

    @check("mhc_pre", T)
    def _(T):
        def run(r):
            x = res if r is None else res[r:r + 1]
            outs = []
            for nw in (None, norm_w):
                kw = {} if nw is None else dict(norm_weight=nw, norm_eps=1e-6)
                post, comb, y = mhc.mhc_pre(x, fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0, 20, **kw)
                assert (post.shape, comb.shape, y.shape) == ((len(x), N, 1), (len(x), N, N), (len(x), H)), "shapes"
                want = ops.mhc_pre(x, fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0, 20, nw, 1e-6 if nw is not None else None,
                                   impl=R)
                for a, b, what in zip((post, comb, y), want, ("post", "comb", "y")):
                    close(a, b, f"{what} (norm={nw is not None})", tol=1e-5)
                if nw is None:  # SGLang's own torch mHC pre
                    for a, b, what in zip((post, comb, y), mhc._mhc_pre_torch(x, fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0,
                                                                              20), ("post", "comb", "y")):
                        close(a, b, f"{what} against SGLang's _mhc_pre_torch", tol=1e-5)
                outs += [post, comb, y]
            return outs, None
        per_row(run, T, "mhc_pre")

    post_in = torch.rand(T, N, 1, generator=g) * 2
    comb_in = torch.softmax(torch.randn(T, N, N, generator=g), -1)
    x_in = bf16(T, H, scale=2)

    @check("mhc_post", T)
    def _(T):
        def run(r):
            s = slice(None) if r is None else slice(r, r + 1)
            outs = []
            for post in (post_in[s], post_in[s, :, 0]):  # [T, n, 1] as the model passes it, and [T, n]
                out = mhc.mhc_post(x_in[s], res[s], post, comb_in[s])
                close(out, ops.mhc_post(x_in[s], res[s], post_in[s], comb_in[s], impl=R), "streams")
                close(out, mhc._mhc_post_torch(x_in[s], res[s], post_in[s], comb_in[s]),
                      "streams against SGLang's _mhc_post_torch", tol=2 ** -7)
                outs.append(out)
            return outs, None
        per_row(run, T, "mhc_post", (T, N, H))

    @check("mhc_fused_post_pre", T)
    def _(T):
        def run(r):
            s = slice(None) if r is None else slice(r, r + 1)
            outs = []
            for nw in (None, norm_w):
                kw = {} if nw is None else dict(norm_weight=nw, norm_eps=1e-6)
                got = mhc.mhc_fused_post_pre(x_in[s], res[s], post_in[s], comb_in[s], fn, sc, base, 1e-6, 1e-6, 1e-6,
                                             2.0, 20, **kw)
                streams = ops.mhc_post(x_in[s], res[s], post_in[s], comb_in[s], impl=R)
                want = (streams, *ops.mhc_pre(streams, fn, sc, base, 1e-6, 1e-6, 1e-6, 2.0, 20, nw,
                                              1e-6 if nw is not None else None, impl=R))
                for a, b, what in zip(got, want, ("streams", "post", "comb", "y")):
                    close(a, b, f"{what} (norm={nw is not None})", tol=1e-5)
                outs += list(got)
            return outs, None
        per_row(run, T, "mhc_fused_post_pre", (T, N, H), (T, N, 1), (T, N, N), (T, H))

    mixes = torch.randn(T, 1, N * (N + 2), generator=g)

    @check("hc_split_sinkhorn", T)
    def _(T):
        def run(r):
            m = mixes if r is None else mixes[r:r + 1]
            got = mhc.hc_split_sinkhorn(m, sc, base, N, 20, 1e-6)
            want = ops.hc_split_sinkhorn(m, sc, base, N, 20, 1e-6)
            for a, b, what in zip(got, want, ("pre", "post", "comb")):
                close(a, b, what, tol=1e-6)
            return list(got), None
        per_row(run, T, "hc_split_sinkhorn", (T, 1, N), (T, 1, N), (T, 1, N, N))

    pre_in = torch.rand(T, N, generator=g) + 0.1

    @check("mhc_combine", T)
    def _(T):
        def run(r):
            s = slice(None) if r is None else slice(r, r + 1)
            y = mhc.mhc_combine(res[s].flatten(1), pre_in[s], N, torch.bfloat16)
            close(y, ops.hc_combine(res[s], pre_in[s], torch.bfloat16), "y")
            return [y], None
        per_row(run, T, "mhc_combine", (T, H))

    @check("fused_hc_head", T)
    def _(T):
        def run(r):
            x = res if r is None else res[r:r + 1]
            y = mhc_head.fused_hc_head(x, fn[:N], sc[:1], base[:N], 1e-6, 1e-6)
            close(y, ops.hc_head(x, fn[:N], sc[:1], base[:N], 1e-6, 1e-6, impl=R), "y")
            close(y, model.hc_head_torch(x, fn[:N], sc[:1], base[:N], norm_eps=1e-6, hc_eps=1e-6),
                  "y against SGLang's hc_head_torch")
            return [y], None
        per_row(run, T, "fused_hc_head", (T, H))

    @check("unquantized_v4_experts", T)
    def _(T):
        # V4's routed experts with bf16 weights (UnquantizedFusedMoEMethod.forward_cpu, replaced by ours): token 0
        # names one expert twice (the sum of both choices), token 1 drops a choice (-1) and token 2 both (a zero
        # row); every other token's row is what the per-token formula gives
        E, HID, I, K = 4, 128, 64, 2
        w13, w2 = bf16(E, 2 * I, HID, scale=0.1), bf16(E, HID, I, scale=0.1)
        x = bf16(T, HID)
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(torch.int32)
        if T >= 1:
            ids[0, 1] = ids[0, 0]
        if T >= 2:
            ids[1, 0] = -1
        if T >= 3:
            ids[2] = -1
        w = torch.rand(T, K, generator=g)
        method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
        method.moe_runner_config = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=HID,
                                                   intermediate_size_per_partition=I, top_k=K,
                                                   num_fused_shared_experts=0, params_dtype=torch.bfloat16,
                                                   activation="silu", swiglu_limit=10.0)
        layer = torch.nn.Module()
        layer.w13_weight, layer.w2_weight = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
        d = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                   topk_output=StandardTopKOutput(topk_weights=w, topk_ids=ids,
                                                                  router_logits=torch.zeros(T, E)))
        out = UnquantizedFusedMoEMethod.forward_cpu(method, layer, d).hidden_states
        assert out.shape == (T, HID) and out.dtype == torch.bfloat16
        want = torch.zeros(T, HID)
        for t in range(T):
            for j in range(K):
                e = int(ids[t, j])
                if 0 <= e < E:
                    h = ops.silu_and_mul_clamp(x[t:t + 1] @ w13[e].t(), 10.0, impl=R)
                    want[t] += w[t, j] * (h @ w2[e].t()).float()[0]
        close(out, want.to(torch.bfloat16), "experts")
        if T >= 3:
            assert torch.equal(out[2], torch.zeros_like(out[2])), "a token with every choice dropped: a zero row"

    @check("get_last_loc", T)
    def _(T):
        # speculative decoding's last KV location per request: a zero-length request (prefix 0) gives -1
        r2t = torch.randint(1, 10 ** 6, (T + 1, 300), dtype=torch.int32, generator=g)
        idx = torch.randperm(T + 1, generator=g)[:T]
        lens = torch.randint(0, 301, (T,), generator=g)
        if T:
            lens[0] = 0
        real = rc.attention_backends
        rc.attention_backends = lambda: ("tilelang_musa", "tilelang_musa")
        try:
            got = allocation.get_last_loc(r2t, idx, lens)
        finally:
            rc.attention_backends = real
        assert got.shape == (T,)
        assert torch.equal(got, allocation.get_last_loc_torch(r2t, idx, lens))
        if T:
            assert got[0] == -1

print("RESULTS " + json.dumps(results))
print("TIMES " + json.dumps(times))
"""

HOOK_ROWS = (0, 1, GRAPH_MAX_BS)
HOOKS = ("fused_q_norm_rope", "fused_rope_inplace", "fused_norm_rope_inplace", "silu_and_mul_clamp", "mhc_pre",
         "mhc_post", "mhc_fused_post_pre", "hc_split_sinkhorn", "mhc_combine", "fused_hc_head",
         "unquantized_v4_experts", "get_last_loc")


@pytest.fixture(scope="module")
def hook_results():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "integration_tests" / "sgl_kernel_shim"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", HOOK_CHECKS, json.dumps(list(HOOK_ROWS))], capture_output=True,
                         text=True, env=env, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, (out.stdout[-3000:], out.stderr[-6000:])
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("rows", HOOK_ROWS)
@pytest.mark.parametrize("hook", HOOKS)
def test_model_hook(hook_results, hook, rows):
    """Each hook through SGLang's name: 0 rows give empty outputs of the right shapes, 1 and 512 rows the ops'
    references (and SGLang's own torch forms where it has them), each row as if alone."""
    key = f"{hook}[{rows}]"
    assert key in hook_results, sorted(hook_results)
    assert hook_results[key] is None, hook_results[key]


# ----------------------------------------------------------------------------------------------------------------
# 2. The V4 attention backend (dsv4.py): SGLang's pool, metadata builders and batches
# ----------------------------------------------------------------------------------------------------------------




class _TC(unittest.TestCase):
    __test__ = False  # a carrier of assert methods for the kit, not a test

    def runTest(self):  # pragma: no cover
        pass


def _case(mode, ratio, prefix, extend=(), name="degenerate"):
    return kit.DSV4AttentionCase(name=name, backend=BACKEND_NAME, forward_mode=mode, num_heads=64,
                                 page_size=kit.DSV4_PAGE_SIZE, prefix_lens=tuple(prefix), extend_lens=tuple(extend),
                                 compress_ratio=ratio, attn_sink_value=0.5)


class StandInCompressor:
    """SGLang's ``Compressor`` as the backend sees it (as test_sglang_dsv4_compressor.py): ``compute_kv_score``
    returns rows of this call's ``kv_score`` (``x`` is only their count), the state pool is SGLang's."""

    def __init__(self, ratio, d, indexer, g, max_pos=4096):
        coff = 2 if ratio == 4 else 1
        self.ratio, self.head_dim, self.is_in_indexer, self.rotate, self.layer_id = ratio, d, indexer, indexer, 0
        self.width = 2 * coff * d
        self.ape = torch.randn(ratio, coff * d, generator=g)
        self.ape_converted = False
        self.norm = types.SimpleNamespace(weight=torch.rand(d, generator=g) + 0.5, variance_epsilon=1e-6)
        self.freqs_cis = torch.polar(torch.ones(max_pos, 32), torch.rand(max_pos, 32, generator=g) * 6.3)
        self.rows = None

    def compute_kv_score(self, x, forward_batch):
        return self.rows[: x.shape[0]]

    def get_state_pool(self, backend):
        pool = backend.token_to_kv_pool
        return (pool.get_indexer_compress_states if self.is_in_indexer
                else pool.get_attention_compress_states)(self.layer_id)


class StandInIndexer:
    """SGLang's ``C4Indexer`` as the backend sees it: ``compute_weights`` / ``wq_b`` return this call's rows."""

    def __init__(self, g, heads=16):
        self.layer_id, self.n_local_heads, self.head_dim, self.use_fp4_indexer = 0, heads, L.INDEX_D, False
        self.weight_scale = L.INDEX_D ** -0.5 * heads ** -0.5
        self.compressor = StandInCompressor(4, L.INDEX_D, True, g)
        self.freqs_cis = self.compressor.freqs_cis
        self.w = self.q = None

    def compute_weights(self, x, skip_scale=False):
        return self.w[: x.shape[0]]

    def wq_b(self, q_lora):
        return self.q[: q_lora.shape[0]].flatten(1), None


def _fixture(ratio, prefix=(40, 130), runner_batch_size=None, swa_size=1024):
    """SGLang's V4 pool (FP8 pages of 256; with ``ratio`` 4: the C4 caches and the indexer-key cache, 128: the C128
    cache) and our backend, built by SGLang's registry for the name (the kit's fixture)."""
    ratios = [ratio] if ratio else [0]
    return kit.build_dsv4_attention_fixture(_TC(), _case(ForwardMode.DECODE, ratio, prefix), dtype=torch.float32,
                                            device="cpu", compression_ratios=ratios, swa_size=swa_size,
                                            runner_batch_size=runner_batch_size)


def _buffers(pool, ratio) -> dict:
    """Every cache and compressor state the SWA store, the compressors and the indexer may write, live: paged
    caches as ``[pages, page_bytes]`` uint8, states as ``[rows, width]`` float32."""
    live = {"swa": pool.get_swa_raw_buffer(0).view(torch.uint8)}
    if ratio:
        live["extra"] = pool.get_extra_key_buffer(0).view(torch.uint8)
        live["core_state"] = pool.get_attention_compress_states(0).kv_score_buffer.kv_score
    if ratio == 4:
        live["index_k"] = pool.get_index_k_with_scale_buffer(0).view(torch.uint8)
        live["index_state"] = pool.get_indexer_compress_states(0).kv_score_buffer.kv_score
    return live


def _snapshot(pool, ratio) -> dict:
    return {name: t.clone() for name, t in _buffers(pool, ratio).items()}


def _restore(pool, ratio, snap) -> None:
    for name, t in _buffers(pool, ratio).items():
        t.copy_(snap[name])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (compressor states start uninitialised: NaN compares unequal as a float)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _but_padding_slot(swa: torch.Tensor, page: int = 256) -> torch.Tensor:
    """The SWA buffer's bytes but those of slot 0 (SGLang's padding slot): its row and its scale bytes."""
    keep = torch.ones_like(swa, dtype=torch.bool)
    keep[0, :L.DATA_BYTES] = False
    keep[0, page * L.DATA_BYTES:page * L.DATA_BYTES + L.SCALE_BYTES] = False
    return swa[keep]


def _batch(mode, rows):
    """A batch as SGLang sends it with ``rows`` padding rows (module docstring): request slot 0, sequence length 1,
    position 0, full slot 0; ``rows`` 0: every tensor empty (an unpadded IDLE batch)."""
    i64 = dict(dtype=torch.int64)
    fb = ForwardBatch(forward_mode=mode, batch_size=rows, input_ids=torch.zeros(rows, **i64),
                      req_pool_indices=torch.zeros(rows, **i64), seq_lens=torch.ones(rows, **i64),
                      seq_lens_cpu=torch.ones(rows, **i64), out_cache_loc=torch.zeros(rows, **i64),
                      seq_lens_sum=rows, positions=torch.zeros(rows, **i64))
    if mode.is_extend():
        fb.extend_seq_lens = torch.ones(rows, dtype=torch.int32)
        fb.extend_seq_lens_cpu = [1] * rows
        fb.extend_prefix_lens = torch.zeros(rows, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = [0] * rows
        fb.extend_start_loc = torch.arange(rows, dtype=torch.int32)
        fb.extend_num_tokens = rows
    return fb


def _run_layer(backend, fb, q, ratio, layer, sink, g):
    """One V4 attention layer's backend calls in the model's order, on random inputs: the SWA store through the
    pool (at ``get_swa_out_cache_loc``), the core compressor, the C4 indexer (ratio 4), attention."""
    T = q.shape[0]
    pool = backend.token_to_kv_pool
    x = torch.zeros(T, 8)
    loc = backend.get_swa_out_cache_loc(fb)
    assert loc.shape == (T,), loc.shape
    kv = torch.randn(T, L.D, generator=g).to(torch.bfloat16)
    freqs = torch.polar(torch.ones(4096, 32), torch.rand(4096, 32, generator=g))
    pool.set_swa_key_buffer_radix_fused_norm_rope(layer_id=0, swa_loc=loc, kv=kv, kv_weight=torch.ones(L.D), eps=1e-6,
                                                  freqs_cis=freqs, positions=fb.positions[:T])
    if ratio:
        comp = StandInCompressor(ratio, L.D, False, g)
        comp.rows = torch.randn(T, comp.width, generator=g)
        backend.forward_core_compressor(x, fb, 0, comp)
    if ratio == 4:
        ind = StandInIndexer(g)
        ind.compressor.rows = torch.randn(T, ind.compressor.width, generator=g)
        ind.w, ind.q = torch.randn(T, 16, generator=g), torch.randn(T, 16, L.INDEX_D, generator=g)
        backend.forward_c4_indexer(x, x, ind, fb)
    return backend.forward(q, q, q, layer, fb, compress_ratio=ratio, save_kv_cache=False, attn_sink=sink)


NO_TOKEN_CASES = [(ForwardMode.IDLE, "dropped"), (ForwardMode.IDLE, "built"), (ForwardMode.DECODE, "built"),
                  (ForwardMode.EXTEND, "built")]


@pytest.mark.usefixtures("cpu_kit")
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("mode,metadata", NO_TOKEN_CASES, ids=lambda v: getattr(v, "name", v))
def test_no_token_batch(ratio, mode, metadata):
    """A batch of no token: SGLang's unpadded IDLE batch, with the metadata its eager runner drops
    (``dropped``: ``forward_metadata = None``) or with ``init_forward_metadata`` called on it (``built``), and
    DECODE / EXTEND batches of no request. Every backend call the V4 layer makes returns its empty result (the
    attention ``[0, 64, 512]``, the SWA locations ``[0]``) and nothing is written."""
    g = torch.Generator().manual_seed(1)
    fx = _fixture(ratio)
    backend, pool = fx.backend, fx.runner.token_to_kv_pool
    before = _snapshot(pool, ratio)
    fb = _batch(mode, 0)
    fx.runner.kv_index_translator.bind_own_plan(fb)
    q = torch.randn(0, 64, L.D, generator=g).to(torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        if metadata == "dropped":
            backend.forward_metadata = None
        else:
            backend.init_forward_metadata(fb)
        out = _run_layer(backend, fb, q, ratio, fx.actual_module.attn, fx.actual_module.attn_sink, g)
        if ratio == 4:
            comp = StandInCompressor(4, L.INDEX_D, True, g)
            comp.rows = torch.empty(0, comp.width)
            backend.forward_indexer_compressor(torch.zeros(0, 8), fb, 0, comp)
    assert out.shape == (0, 64, L.D) and out.dtype == torch.bfloat16
    for name, t in _snapshot(pool, ratio).items():
        assert _same(t, before[name]), f"{name} changed"
    # the backend serves the next real batch as before
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fx.forward_batch)
        q = torch.randn(2, 64, L.D, generator=g).to(torch.bfloat16)
        assert backend.forward(q, q, q, fx.actual_module.attn, fx.forward_batch, compress_ratio=ratio,
                               save_kv_cache=False, attn_sink=fx.actual_module.attn_sink).shape == (2, 64, L.D)


@pytest.mark.usefixtures("cpu_kit")
@pytest.mark.parametrize("ratio,rows", [(0, 3), (4, 3), (128, 3), (0, GRAPH_MAX_BS), (128, GRAPH_MAX_BS)])
def test_padded_idle_batch(ratio, rows):
    """SGLang's IDLE batch padded for DP attention's MAX_LEN gather (``rows`` fabricated rows: request slot 0,
    length 1, position 0, full slot 0) through every backend call of a V4 layer: a finite ``[rows, 64, 512]``
    attention output; the compressors and the indexer write nothing (an IDLE rank has no request), the SWA store
    only SGLang's padding slot."""
    g = torch.Generator().manual_seed(2)
    fx = _fixture(ratio, runner_batch_size=4)
    backend, pool = fx.backend, fx.runner.token_to_kv_pool
    before = _snapshot(pool, ratio)
    fb = _batch(ForwardMode.IDLE, rows)
    fx.runner.kv_index_translator.bind_own_plan(fb)
    q = torch.randn(rows, 64, L.D, generator=g).to(torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fb)
        out = _run_layer(backend, fb, q, ratio, fx.actual_module.attn, fx.actual_module.attn_sink, g)
    assert out.shape == (rows, 64, L.D) and torch.isfinite(out.float()).all()
    after = _snapshot(pool, ratio)
    for name in before:
        if name == "swa":
            assert _same(_but_padding_slot(after[name]), _but_padding_slot(before[name])), \
                "an SWA row other than the padding slot changed"
        else:
            assert _same(after[name], before[name]), f"{name} changed"


# --- CUDA-graph padded decode ------------------------------------------------------------------------------------


def _fill_caches(pool, ratio, g) -> None:
    """Valid FP8 rows in every slot of the caches the attention and the indexer read: the SWA cache, the
    compressed cache and the indexer keys (random, as any earlier steps may have left them)."""
    swa = dsv4.paged_view(pool.get_swa_raw_buffer(0).view(torch.uint8), 256)
    n = swa.shape[0] * 256
    dsv4.write_kv_v4(torch.randn(n, L.D, generator=g).to(torch.bfloat16), swa, torch.arange(n))
    if ratio:
        rows = pool.get_extra_key_page_size(0)
        extra = dsv4.paged_view(pool.get_extra_key_buffer(0).view(torch.uint8), rows)
        n = extra.shape[0] * rows
        dsv4.write_kv_v4(torch.randn(n, L.D, generator=g).to(torch.bfloat16), extra, torch.arange(n))
    if ratio == 4:
        rows = pool.get_index_k_page_size(4)
        index = dsv4.paged_view(pool.get_index_k_with_scale_buffer(0).view(torch.uint8), rows, L.INDEX_ROW_BYTES)
        n = index.shape[0] * rows
        dsv4.write_index_k(torch.randn(n, L.INDEX_D, generator=g), index, torch.arange(n), scale="exact")
    for name, t in _buffers(pool, ratio).items():
        if name.endswith("state"):
            t.copy_(torch.randn(t.shape, generator=g))


def _decode_batch(runner, prefix, pad):
    """A decode batch as SGLang's graph replay gives it: the requests at slots 1.. (slot 0 is SGLang's padding
    row), request ``r`` at its own page-aligned full slots (``256 * r + position``, an identity SWA mapping), then
    ``pad`` padding rows (module docstring)."""
    R = len(prefix)
    req = torch.tensor(list(range(1, R + 1)) + [0] * pad, dtype=torch.int64)
    for r, p in zip(range(1, R + 1), prefix):
        runner.req_to_token_pool.req_to_token[r, :p + 1] = 256 * r + torch.arange(p + 1, dtype=torch.int32)
    seq = torch.tensor([p + 1 for p in prefix] + [1] * pad, dtype=torch.int64)
    pos = torch.tensor(list(prefix) + [0] * pad, dtype=torch.int64)
    loc = torch.tensor([256 * r + p for r, p in zip(range(1, R + 1), prefix)] + [0] * pad, dtype=torch.int64)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=R + pad, input_ids=torch.zeros(R + pad,
                      dtype=torch.int64), req_pool_indices=req, seq_lens=seq, seq_lens_cpu=seq.clone(),
                      out_cache_loc=loc, seq_lens_sum=int(seq.sum()), positions=pos)
    runner.kv_index_translator.bind_own_plan(fb)
    return fb


def _graph_view(fb, bs):
    """What SGLang's decode graph runner hands the backend at replay (as the kit's graph runner does)."""
    return types.SimpleNamespace(
        batch_size=bs, forward_mode=fb.forward_mode, actual_forward_mode=fb.forward_mode, input_ids=fb.input_ids,
        positions=fb.positions, req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
        seq_lens_sum=fb.seq_lens_sum, seq_lens_cpu=fb.seq_lens_cpu, encoder_lens=fb.encoder_lens,
        extend_seq_lens=None, out_cache_loc=fb.out_cache_loc, kv_loc_plan=fb.kv_loc_plan,
        kv_loc_cols=fb.kv_loc_cols, spec_info=fb.spec_info)


class _Inputs:
    """Per-token inputs of one layer: rows of the real requests fixed, padding rows drawn anew each call."""

    def __init__(self, R, g):
        self.R, self.g = R, g
        self.q = torch.randn(R, 64, L.D, generator=g).to(torch.bfloat16)
        self.kv = torch.randn(R, L.D, generator=g).to(torch.bfloat16)
        self.core = torch.randn(R, 2 * 2 * L.D, generator=g)
        self.index_kv = torch.randn(R, 2 * 2 * L.INDEX_D, generator=g)
        self.w, self.iq = torch.randn(R, 16, generator=g), torch.randn(R, 16, L.INDEX_D, generator=g)

    def rows(self, pad):
        def more(t):
            return torch.cat([t, (torch.randn((pad,) + t.shape[1:], generator=self.g) * 5).to(t.dtype)])
        return types.SimpleNamespace(q=more(self.q), kv=more(self.kv), core=more(self.core),
                                     index_kv=more(self.index_kv), w=more(self.w), iq=more(self.iq))


def _layer(backend, fb, x, ratio, fx, g):
    """:func:`_run_layer` with given per-token inputs: returns the attention output and the C4 top-k rows."""
    T = x.q.shape[0]
    pool = backend.token_to_kv_pool
    loc = backend.get_swa_out_cache_loc(fb)
    freqs = torch.polar(torch.ones(4096, 32), torch.arange(4096 * 32).view(4096, 32).float() * 1e-3)
    pool.set_swa_key_buffer_radix_fused_norm_rope(layer_id=0, swa_loc=loc, kv=x.kv, kv_weight=torch.ones(L.D),
                                                  eps=1e-6, freqs_cis=freqs, positions=fb.positions[:T])
    topk = None
    if ratio:
        comp = StandInCompressor(ratio, L.D, False, torch.Generator().manual_seed(9))
        comp.rows = x.core[:, :comp.width]
        backend.forward_core_compressor(torch.zeros(T, 8), fb, 0, comp)
    if ratio == 4:
        ind = StandInIndexer(torch.Generator().manual_seed(10))
        ind.compressor.rows, ind.w, ind.q = x.index_kv, x.w, x.iq
        backend.forward_c4_indexer(torch.zeros(T, 8), torch.zeros(T, 8), ind, fb)
        topk = backend.forward_metadata.core_metadata.c4_sparse_page_indices[:T].clone()
    out = backend.forward(x.q, x.q, x.q, fx.actual_module.attn, fb, compress_ratio=ratio, save_kv_cache=False,
                          attn_sink=fx.actual_module.attn_sink)
    return out, topk


def _real_part(name, t, ratio):
    """What belongs to the real requests (pages and ring rows of requests 1..; page / ring 0 is the padding
    row's): paged caches from page 1, C4 states from the ring of SWA page 1 (8 rows a page), C128 states from the
    ring of request 1 (128 rows a request)."""
    if name.endswith("state"):
        ring = 128 if (name == "core_state" and ratio == 128) else 8
        return t[ring:]
    return t[1:]


@pytest.mark.usefixtures("cpu_kit")
@pytest.mark.parametrize("ratio,bs", [(0, 4), (4, 4), (128, 4), (0, GRAPH_MAX_BS), (128, GRAPH_MAX_BS)])
def test_graph_padded_decode(ratio, bs):
    """Three decode requests (one with a single token: prefix 0) in a captured graph of ``bs`` rows
    (SGLang's metadata steps: ``init_cuda_graph_state``, the out-of-graph and in-graph steps at capture and at
    replay; no real graph on a CPU), padded with SGLang's padding rows. The real rows' attention output, their C4
    top-k, and every cache row and compressor state of theirs equal those of the same step run eagerly without
    padding; replayed again with other padding inputs, the real rows do not change at all. Then the same
    graph replayed for an IDLE rank (SGLang substitutes padding rows for the whole bucket): finite output, and no
    real request's cache or state changes."""
    g = torch.Generator().manual_seed(3)
    prefix = (43, 0, 127)  # C4 emits a compressed row at 44 tokens, C4 and C128 at 128; 1 token: nothing yet
    R = len(prefix)
    fx = _fixture(ratio, prefix=(1,), runner_batch_size=max(bs, 16), swa_size=256 * (R + 1))
    runner, backend, pool = fx.runner, fx.backend, fx.runner.token_to_kv_pool
    _fill_caches(pool, ratio, g)
    initial = _snapshot(pool, ratio)
    x = _Inputs(R, g)
    ctx = forward_context(ForwardContext(attn_backend=backend))
    with torch.no_grad(), ctx:
        eager_fb = _decode_batch(runner, prefix, 0)
        backend.init_forward_metadata(eager_fb)
        eager_out, eager_topk = _layer(backend, eager_fb, x.rows(0), ratio, fx, g)
        eager_state = _snapshot(pool, ratio)
        for name in eager_state:  # the step wrote rows of the real requests: the comparisons below are not vacuous
            assert not _same(_real_part(name, eager_state[name], ratio), _real_part(name, initial[name], ratio)), name

        _restore(pool, ratio, initial)
        capture = _decode_batch(runner, (), bs)
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
        backend.init_forward_metadata_out_graph(capture, in_capture=True)
        backend.init_forward_metadata_in_graph(capture)
        _layer(backend, capture, _Inputs(bs, g).rows(0), ratio, fx, g)  # the capture run (discarded)
        backend.on_after_cuda_graph_warmup()

        outs = []
        for _ in range(2):
            _restore(pool, ratio, initial)
            fb = _decode_batch(runner, prefix, bs - R)
            view = _graph_view(fb, bs)
            backend.init_forward_metadata_out_graph(view)
            backend.init_forward_metadata_in_graph(view)
            out, topk = _layer(backend, fb, x.rows(bs - R), ratio, fx, g)
            assert out.shape == (bs, 64, L.D) and torch.isfinite(out.float()).all()
            outs.append(out[:R])
            torch.testing.assert_close(out[:R].float(), eager_out.float(), rtol=2 ** -8, atol=1e-4)
            if ratio == 4:
                assert torch.equal(topk[:R], eager_topk), "the C4 top-k of a real row changed under padding"
            after = _snapshot(pool, ratio)
            for name in after:
                assert _same(_real_part(name, after[name], ratio), _real_part(name, eager_state[name], ratio)), \
                    f"{name}: a real request's row differs from the unpadded step"
        assert torch.equal(outs[0], outs[1]), "other padding inputs changed a real row"

        # an IDLE rank replaying the bucket: SGLang's out-of-graph step substitutes padding rows for every row
        _restore(pool, ratio, initial)
        idle = _batch(ForwardMode.IDLE, 0)
        view = _graph_view(idle, bs)
        view.forward_mode, view.actual_forward_mode = ForwardMode.DECODE, ForwardMode.IDLE
        backend.init_forward_metadata_out_graph(view)
        backend.init_forward_metadata_in_graph(view)
        padded = _batch(ForwardMode.IDLE, bs)
        out, _ = _layer(backend, padded, _Inputs(bs, g).rows(0), ratio, fx, g)
        assert out.shape == (bs, 64, L.D) and torch.isfinite(out.float()).all()
        after = _snapshot(pool, ratio)
        for name in after:
            assert _same(_real_part(name, after[name], ratio), _real_part(name, initial[name], ratio)), \
                f"{name}: an IDLE replay changed a real request's row"


# --- a single token; the largest decode batch ---------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_kit")
@pytest.mark.parametrize("case", [
    _case(ForwardMode.DECODE, 0, (77,), name="decode_one_request"),
    _case(ForwardMode.EXTEND, 0, (0,), (1,), name="one_token_prompt"),
    _case(ForwardMode.EXTEND, 0, (90,), (1,), name="one_token_extend_after_prefix"),
], ids=lambda c: c.name)
def test_single_token_swa(case):
    kit.run_dsv4_attention_case(_TC(), case, device="cpu")


@pytest.mark.usefixtures("cpu_kit")
@pytest.mark.parametrize("case", [
    _case(ForwardMode.DECODE, 4, (100,), name="c4_decode_one_request"),
    _case(ForwardMode.DECODE, 128, (200,), name="c128_decode_one_request"),
    _case(ForwardMode.EXTEND, 4, (0,), (1,), name="c4_one_token_prompt"),
    _case(ForwardMode.EXTEND, 128, (0,), (1,), name="c128_one_token_prompt"),
], ids=lambda c: c.name)
def test_single_token_compressed(case):
    """One token against SWA and compressed rows (the C4 top-k seeded by the kit); a one-token prompt has no
    compressed row yet: every index of its compressed set is invalid, only the SWA row and the sink count."""
    kit.run_dsv4_compress_attention_case(_TC(), case, device="cpu", extra_entries=max(
        32, max(case.seq_lens) // case.compress_ratio + 1))


@pytest.mark.usefixtures("cpu_kit")
def test_largest_captured_decode_batch():
    """512 decode requests (SGLang's largest captured decode batch) of lengths 1 to 41, among them requests
    with a single token: each row against the kit's float reference over its last 128 keys."""
    prefix = tuple((i * 37) % 41 for i in range(GRAPH_MAX_BS))
    case = _case(ForwardMode.DECODE, 0, prefix, name="largest_decode")
    fx = kit.build_dsv4_attention_fixture(_TC(), case, dtype=torch.float32, device="cpu",
                                          swa_size=GRAPH_MAX_BS * 256 + 256)
    max_ctx = fx.runner.req_to_token_pool.req_to_token.shape[1]
    # the kit's _populate_swa_kv_cache, projecting only K for the cached tokens (it projects q too: minutes here)
    with torch.no_grad():
        ks = [fx.actual_module.k_proj(torch.cat([h, fx.input_hidden[r:r + 1]])) for r, h in enumerate(fx.prefix_hidden)]
        locs = [1 + r * max_ctx + torch.arange(k.shape[0]) for r, k in enumerate(ks)]  # the kit's _token_loc
        kit._write_swa_cache(fx.runner, 0, torch.cat(locs), torch.cat(ks))
        fx._swa_bf16_k_per_req = ks
        q, _ = fx.actual_module.project(fx.input_hidden)
    q = q.to(torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata(fx.forward_batch)
        out = fx.backend.forward(q, q, q, fx.actual_module.attn, fx.forward_batch, compress_ratio=0,
                                 save_kv_cache=False, attn_sink=fx.actual_module.attn_sink)
    want = kit._pure_torch_dsv4_swa_reference(fx, q, locs)
    torch.testing.assert_close(out.float(), want.float(), atol=kit.DSV4_ATOL, rtol=kit.DSV4_RTOL)


# ----------------------------------------------------------------------------------------------------------------
# 3. SGLang's MoE paths on our op (moe.py): the triton fused function and the deep_gemm runner core
# ----------------------------------------------------------------------------------------------------------------

E, HID, INTER, K = 4, 256, 128, 2


@pytest.fixture
def runner_cores(monkeypatch):
    """SGLang's registry of custom runner cores, a copy for this test (as test_sglang_moe.py)."""
    monkeypatch.setattr(sglang_runner, "_CUSTOM_RUNNER_CORE_FACTORIES",
                        dict(sglang_runner._CUSTOM_RUNNER_CORE_FACTORIES))


def _routing(T, kind, g):
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(torch.int32)  # K distinct experts a token
    if kind == "repeat" and T:  # token 0 names one expert twice (and token T // 2 as well)
        ids[0, 1] = ids[0, 0]
        ids[T // 2, 0] = ids[T // 2, 1]
    if kind == "drop" and T:  # token 0 drops a choice (another rank's expert), the last token every choice
        ids[0, 1] = -1
        ids[-1] = -1
    return ids


def _moe_call(path, T, kind):
    g = torch.Generator().manual_seed(T)
    if path == "deep_gemm_fp4":
        w13, s13 = moe_ops.quantize_fp4_reference(torch.randn(E, 2 * INTER, HID, generator=g) / 16)
        w2, s2 = moe_ops.quantize_fp4_reference(torch.randn(E, HID, INTER, generator=g) / 16)
        s13, s2 = s13.view(torch.float8_e8m0fnu).float(), s2.view(torch.float8_e8m0fnu).float()
        info = DeepGemmMoeQuantInfo(w13_weight=w13.view(torch.int8), w2_weight=w2.view(torch.int8), use_fp8=True,
                                    w13_scale=s13, w2_scale=s2, block_shape=[128, 128], is_fp4_experts=True)
    else:
        w13, s13 = moe_ops.quantize_weight_blocks_reference(torch.randn(E, 2 * INTER, HID, generator=g) / 16)
        w2, s2 = moe_ops.quantize_weight_blocks_reference(torch.randn(E, HID, INTER, generator=g) / 16)
        if path == "triton":
            info = TritonMoeQuantInfo(w13_weight=w13, w2_weight=w2, use_fp8_w8a8=True, w13_scale=s13, w2_scale=s2,
                                      block_shape=[128, 128])
        else:
            info = DeepGemmMoeQuantInfo(w13_weight=w13, w2_weight=w2, use_fp8=True, w13_scale=s13, w2_scale=s2,
                                        block_shape=[128, 128])
    config = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=HID, intermediate_size_per_partition=INTER,
                             top_k=K, num_fused_shared_experts=0, params_dtype=torch.bfloat16, activation="silu",
                             swiglu_limit=10.0)
    hidden = (torch.randn(T, HID, generator=g) * 4).to(torch.bfloat16)
    weights = torch.rand(T, K, generator=g)
    ids = _routing(T, kind, g)
    return config, info, hidden, weights, ids, (w13, s13, w2, s2)


def _run_moe(path, config, info, hidden, weights, ids):
    backend = MoeRunnerBackend.TRITON if path == "triton" else MoeRunnerBackend.DEEP_GEMM
    runner = MoeRunner(backend, config)  # as Fp8MoEMethod.create_moe_runner builds it
    topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=torch.zeros(len(ids), E))
    d = StandardDispatchOutput(hidden_states=hidden.clone(), hidden_states_scale=None, topk_output=topk)
    return runner.run(d, info).hidden_states


@pytest.mark.usefixtures("runner_cores")
@pytest.mark.parametrize("kind", ["plain", "repeat", "drop"])
@pytest.mark.parametrize("T", [0, 1, 64, GRAPH_MAX_BS])
@pytest.mark.parametrize("path", ["triton", "deep_gemm", "deep_gemm_fp4"])
def test_moe_degenerate(use_settings, path, T, kind):
    """SGLang's MoE runner on our op: 0 tokens give a ``[0, H]`` output; 1, 64 (the masked layout's largest
    batch) and 512 (the contiguous layout) tokens the reference; a token naming one expert twice gets the sum of
    both choices, a dropped choice (-1) adds nothing and a token with every choice dropped is a zero row; every
    other token's row is the one it gets in a batch with ordinary routing."""
    use_settings(moe="on")
    moe.install()
    config, info, hidden, weights, ids, (w13, s13, w2, s2) = _moe_call(path, T, kind)
    out = _run_moe(path, config, info, hidden, weights, ids)
    assert out.shape == (T, HID) and out.dtype == torch.bfloat16
    if path == "deep_gemm_fp4":
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    want = moe_ops.fused_experts_reference(hidden, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2,
                                           swiglu_limit=10.0)
    # the op's layouts batch the GEMMs differently from the per-expert reference (and merge a repeated expert's
    # weights first), so a bf16 rounding step may differ
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    if kind == "drop" and T:
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "a token with every choice dropped"
    if kind != "plain" and T > 1:
        # the degenerate tokens' routing made ordinary: every other token's row is unchanged
        touched = {0, T // 2, T - 1}
        ordinary = ids.clone()
        for t in touched:
            ordinary[t] = torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K].to(torch.int32)
        base = _run_moe(path, config, info, hidden, weights, ordinary)
        rest = torch.tensor([t for t in range(T) if t not in touched])
        assert torch.equal(out[rest], base[rest]), "a repeated or dropped id changed another token's output"
