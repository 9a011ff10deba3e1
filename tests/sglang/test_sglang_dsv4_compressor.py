"""Our V4 backend's compressors and C4 indexer inside SGLang 0.5.23's structures, on the CPU: SGLang's own pool
(``DeepSeekV4TokenToKVPool`` with its compressor state rings), its metadata builders and forward batches (made by
its V4 kit), a sequence fed through several calls (chunked prefill, then decode steps). The compressed cache
SGLang ends up with must hold, at SGLang's slots, the rows of the whole sequence compressed in one call by the
reference (no state read), within one e4m3 step of the row's 64-value tile (a value at a rounding boundary may
round the other way after a different sum order). The compressor module is a stand-in with SGLang's
attributes: ``compute_kv_score`` returns this call's ``[kv | score]`` rows, the state pool is SGLang's."""

import types
import unittest

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit  # noqa: E402

from musa_attn_backend import BACKEND_NAME  # noqa: E402
from musa_attn_backend.kernels import dsv4  # noqa: E402
from musa_attn_backend.kernels.dsv4 import layout as L  # noqa: E402


class _TC(unittest.TestCase):
    __test__ = False  # a carrier of assert methods for the kit, not a test

    def runTest(self):  # pragma: no cover
        pass


@pytest.fixture(autouse=True)
def page_aligned_locs(monkeypatch):
    """Full-pool slots as SGLang's page allocator gives them (position ``p`` of a request at offset ``p % 256`` of
    its pages; page 0 left out, as the kit leaves slot 0), where the kit shifts every slot by one: the compressor
    writes row ``c`` at ``full_slot // ratio`` and the indexer reads it through the page table, which agree only on
    aligned pages."""
    monkeypatch.setattr(kit, "_token_loc", lambda req_idx, pos, *, max_context_len: 256 + req_idx * max_context_len
                        + pos)


# The kit sizes the compressor state by its batch (its cases never compress); SGLang sizes it by the SWA pages
# (8 rows each for C4): enough rows for every page these sequences touch.
STATE_ROWS = 128


class StandInCompressor:
    """SGLang's ``Compressor`` as the backend sees it (the projection left out: ``x`` is ``kv_score``)."""

    def __init__(self, ratio, d, indexer, layer_id, g, max_pos, device="cpu"):
        coff = 2 if ratio == 4 else 1
        self.ratio, self.head_dim, self.is_in_indexer, self.rotate, self.layer_id = ratio, d, indexer, indexer, \
            layer_id
        self.checkpoint_ape = torch.randn(ratio, coff * d, generator=g)
        # SGLang lays a C4 ape out again at load (_apply_ape_hotfix); the backend must undo it
        halves = torch.chunk(self.checkpoint_ape, 2, dim=-1) if ratio == 4 else (self.checkpoint_ape,)
        self.ape = torch.cat(halves, 0).reshape(ratio, -1).contiguous()
        self.ape_converted = ratio == 4
        self.norm = types.SimpleNamespace(weight=torch.rand(d, generator=g) + 0.5, variance_epsilon=1e-6)
        self.freqs_cis = torch.polar(torch.ones(max_pos, 32), torch.rand(max_pos, 32, generator=g) * 6.3)
        self.checkpoint_ape, self.ape = self.checkpoint_ape.to(device), self.ape.to(device)
        self.norm.weight, self.freqs_cis = self.norm.weight.to(device), self.freqs_cis.to(device)

    def compute_kv_score(self, x, forward_batch):
        return x

    def get_state_pool(self, backend):
        pool = backend.token_to_kv_pool
        return (pool.get_indexer_compress_states if self.is_in_indexer
                else pool.get_attention_compress_states)(self.layer_id)


def _case(prefix, extend, ratio):
    mode = ForwardMode.EXTEND if extend > 1 or prefix == 0 else ForwardMode.DECODE
    return kit.DSV4AttentionCase(name="compress", backend=BACKEND_NAME, forward_mode=mode, num_heads=64,
                                 page_size=kit.DSV4_PAGE_SIZE, prefix_lens=(prefix,),
                                 extend_lens=(extend,) if mode == ForwardMode.EXTEND else (), compress_ratio=ratio)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,d,schedule", [
    (4, L.D, [37, 100, 1, 1, 1, 1, 1, 9]),
    (4, L.INDEX_D, [13, 1, 1, 1, 1, 60, 1, 1]),
    (128, L.D, [200, 57, 1, 1, 1]),
])
def test_compressor_through_sglangs_pool_and_metadata(ratio, d, schedule, device):
    g = torch.Generator().manual_seed(ratio + d)
    total = sum(schedule)
    width = 2 * (2 if ratio == 4 else 1) * d
    xs = (torch.randn(total, width, generator=g) * 2).to(device)
    first = _case(0, schedule[0], ratio)
    # float32: the kit gives the compressor state the model's dtype, SGLang's pool float32 (our only one)
    fixture = kit.build_dsv4_attention_fixture(_TC(), first, dtype=torch.float32, device=device,
                                               max_context_len=-(-(total + 1) // 256) * 256, compression_ratios=[ratio],
                                               runner_batch_size=STATE_ROWS)
    runner, backend = fixture.runner, fixture.backend
    comp = StandInCompressor(ratio, d, d == L.INDEX_D, 0, g, total + 8, device)
    max_ctx = runner.req_to_token_pool.req_to_token.shape[1]
    done = 0
    for n in schedule:
        case = _case(done, n, ratio)
        fb = fixture.forward_batch if done == 0 else kit._make_forward_batch(case, runner, max_context_len=max_ctx,
                                                                              device=device)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(fb)
            (backend.forward_indexer_compressor if comp.is_in_indexer else backend.forward_core_compressor)(
                xs[done:done + n], fb, 0, comp)
        done += n

    pool = runner.token_to_kv_pool
    if comp.is_in_indexer:
        got_cache = dsv4.paged_view(pool.get_index_k_with_scale_buffer(0).view(torch.uint8), 64, L.INDEX_ROW_BYTES)
        read = dsv4.read_index_k
    else:
        got_cache = dsv4.paged_view(pool.get_extra_key_buffer(0).view(torch.uint8), pool.get_extra_key_page_size(0))
        read = dsv4.read_kv_v4
    # SGLang's slot of compressed row c: the full slot of its last position divided by the ratio
    pos = torch.arange(total, device=device)
    emit = (pos + 1) % ratio == 0
    slots = torch.where(emit, (256 + pos) // ratio, torch.full_like(pos, -1))
    want_cache = torch.zeros_like(got_cache)
    cos, sin = comp.freqs_cis.real.contiguous(), comp.freqs_cis.imag.contiguous()
    i32 = dict(dtype=torch.int32, device=device)
    dsv4.compress(xs, comp.checkpoint_ape, pos, torch.zeros(total, **i32), torch.tensor([0, total], **i32),
                  torch.tensor([total], **i32), ratio=ratio, state=torch.zeros(total + 1, width, device=device),
                  state_table=torch.zeros(1, 1, **i32),
                  state_block=1 << 30, state_ring=total + 1, norm_weight=comp.norm.weight, eps=1e-6, cos=cos, sin=sin,
                  cache=want_cache, out_slots=slots, rotate=comp.rotate, index_scale="exact", impl="reference")
    rows = slots[emit]
    assert rows.numel() == total // ratio > 0
    a, b = read(got_cache, rows).float(), read(want_cache, rows).float()
    tile = 64 if d == L.D else 128
    nope = L.D_NOPE if d == L.D else d
    amax = b[:, :nope].abs().view(len(rows), -1, tile).amax(-1, keepdim=True)
    assert ((a - b)[:, :nope].abs().view(len(rows), -1, tile) <= amax / 14 + 1e-6).all()
    if d == L.D:
        assert torch.allclose(a[:, nope:], b[:, nope:], rtol=2 ** -7, atol=1e-3)  # the bf16 RoPE dims
    assert b.abs().sum() > 0  # the reference wrote real rows


class StandInIndexer:
    """SGLang's ``C4Indexer`` as the backend sees it: ``compute_weights`` and ``wq_b`` return this call's rows."""

    def __init__(self, heads, g, max_pos, weights, q, device="cpu"):
        self.layer_id, self.n_local_heads, self.head_dim, self.use_fp4_indexer = 0, heads, L.INDEX_D, False
        self.weight_scale = L.INDEX_D ** -0.5 * heads ** -0.5
        self.compressor = StandInCompressor(4, L.INDEX_D, True, 0, g, max_pos, device)
        self.freqs_cis = self.compressor.freqs_cis
        self._w, self._q = weights, q

    def compute_weights(self, x, skip_scale=False):
        assert skip_scale  # the scale is folded in by the q kernel
        return self._w[: x.shape[0]]

    def wq_b(self, q_lora):
        return self._q[: q_lora.shape[0]].flatten(1), None


@pytest.mark.parametrize("device", DEVICES)
def test_c4_indexer_through_sglangs_pool_and_metadata(device):
    """A 2,600-token prompt in two chunks, then two decode steps: each query row's ``c4_sparse_page_indices`` is the
    SGLang slots of its (pos + 1) // 4 visible compressed rows when there are at most 512, else of the 512 whose
    logits, recomputed here in float64 from the cache SGLang holds and the FP8 q, are largest."""
    g = torch.Generator().manual_seed(5)
    heads, total, schedule = 16, 2600, [1800, 798, 1, 1]
    hidden = torch.randn(total, 8, generator=g).to(device)  # x: only its row count matters to the stand-ins
    xs = (torch.randn(total, 4 * L.INDEX_D, generator=g) * 2).to(device)
    w = torch.randn(total, heads, generator=g).to(device)
    q = torch.randn(total, heads, L.INDEX_D, generator=g).to(device)
    first = _case(0, schedule[0], 4)
    fixture = kit.build_dsv4_attention_fixture(_TC(), first, dtype=torch.float32, device=device, swa_size=4096,
                                               max_context_len=2816, compression_ratios=[4],
                                               runner_batch_size=STATE_ROWS)
    assert runner_page_aligned(fixture)
    runner, backend = fixture.runner, fixture.backend
    ind = StandInIndexer(heads, g, total + 8, w, q, device)
    max_ctx = runner.req_to_token_pool.req_to_token.shape[1]
    pool = runner.token_to_kv_pool
    cache = dsv4.paged_view(pool.get_index_k_with_scale_buffer(0).view(torch.uint8), 64, L.INDEX_ROW_BYTES)
    done, checked = 0, 0
    for n in schedule:
        case = _case(done, n, 4)
        fb = fixture.forward_batch if done == 0 else kit._make_forward_batch(case, runner, max_context_len=max_ctx,
                                                                              device=device)
        ind._w, ind._q = w[done:done + n], q[done:done + n]
        ind.compressor.compute_kv_score = lambda x, fb, rows=xs[done:done + n]: rows
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(fb)
            backend.forward_c4_indexer(hidden[done:done + n], hidden[done:done + n], ind, fb)
            got = backend.forward_metadata.core_metadata.c4_sparse_page_indices[:n].cpu()
        pos = torch.arange(done, done + n, device=device)
        cos, sin = ind.compressor.freqs_cis.real.contiguous(), ind.compressor.freqs_cis.imag.contiguous()
        q8, wq = dsv4.indexer_q(q[done:done + n], w[done:done + n], pos, cos, sin, weight_scale=ind.weight_scale,
                                impl="reference")
        q8, wq = q8.cpu(), wq.cpu()
        for t in list(range(0, n, 97)) + [n - 1]:
            p = done + t
            visible = (p + 1) // 4
            slots = (256 + 4 * torch.arange(visible) + 3) // 4  # SGLang's slot of compressed row c
            row = got[t]
            sel = row[row >= 0]
            assert row[len(sel):].eq(-1).all()
            if visible <= 512:
                assert torch.equal(sel.sort().values, slots.to(sel.dtype)), (p, visible)
                continue
            keys = dsv4.read_index_k(cache, slots.to(device)).double().cpu()
            logits = (torch.relu(q8[t].double() @ keys.T) * wq[t].double()[:, None]).sum(0)
            assert len(sel) == 512 and len(torch.unique(sel)) == 512, p
            if device == "cpu":  # the reference's logits: the same set
                want = slots[logits.topk(512).indices]
                assert torch.equal(sel.sort().values, want.sort().values.to(sel.dtype)), p
            else:  # the kernels' q may round a value the other way: every pick at or above the 512th, up to that
                kth = logits.topk(512).values[-1]
                picked = logits[(sel.long()[:, None] == slots[None, :]).nonzero()[:, 1]]
                assert picked.numel() == 512 and picked.min() >= kth - 1e-3 * logits.abs().max(), p
            checked += 1
        done += n
    assert checked > 5  # rows that chose 512 of more


def runner_page_aligned(fixture) -> bool:
    """The first request's first position sits at the start of a page (see ``page_aligned_locs``)."""
    return int(fixture.runner.req_to_token_pool.req_to_token[0, 0]) % 256 == 0


def test_pool_swa_store_is_ours_and_matches_float64_math():
    """The model writes its SWA rows through the pool (``set_swa_key_buffer_radix_fused_norm_rope``); with our
    backend the pool's method is ours: RMSNorm, GPT-J RoPE of the last 64 dims, FP8 rows at the SWA slots. Read
    back within one e4m3 step of the tile (nope) and of bf16 (rope) against float64 math from the inputs."""
    g = torch.Generator().manual_seed(11)
    case = _case(0, 8, 0)
    fixture = kit.build_dsv4_attention_fixture(_TC(), case, dtype=torch.bfloat16, device="cpu")
    pool = fixture.runner.token_to_kv_pool
    T = 40
    kv = (torch.randn(T, L.D, generator=g) * 3).to(torch.bfloat16)
    weight = torch.rand(L.D, generator=g) + 0.5
    freqs = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6.3)
    positions = torch.randint(0, 64, (T,), generator=g)
    loc = torch.randperm(500, generator=g)[:T] + 300
    pool.set_swa_key_buffer_radix_fused_norm_rope(layer_id=0, swa_loc=loc, kv=kv, kv_weight=weight, eps=1e-6,
                                                  freqs_cis=freqs, positions=positions)
    got = dsv4.read_kv_v4(dsv4.paged_view(pool.get_swa_raw_buffer(0).view(torch.uint8), 256), loc).double()
    x = kv.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight.double()
    c, s = freqs.real.double()[positions], freqs.imag.double()[positions]
    r0, r1 = y[:, L.D_NOPE::2], y[:, L.D_NOPE + 1::2]
    want = torch.cat([y[:, :L.D_NOPE], torch.stack([r0 * c - r1 * s, r0 * s + r1 * c], -1).flatten(1)], 1)
    amax = want[:, :L.D_NOPE].abs().view(T, -1, 64).amax(-1, keepdim=True)
    assert ((got - want)[:, :L.D_NOPE].abs().view(T, -1, 64) <= amax / 14 + 1e-6).all()
    assert torch.allclose(got[:, L.D_NOPE:], want[:, L.D_NOPE:], rtol=2 ** -7, atol=1e-3)
