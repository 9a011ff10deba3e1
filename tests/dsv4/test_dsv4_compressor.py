"""DeepSeek-V4's compressors on the CPU: requests fed in chunks and decode steps over several calls, the running
state in both engines' layouts (vLLM: every token in a paged state cache, ape stored with the score; SGLang: rings
of 8 / 128 rows holding only the tail, ape added at compress time), against a float64 implementation of the
official prefill math written here (pooling over the whole sequence at once, no state); ratio 4 and 128, the
attention (512) and indexer (128) widths, the Hadamard and both indexer scales; the cache rows read back; the
argument checks."""

import math

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.kernels.dsv4.compressor import compress
from musa_attn_backend.testing.dsv4_compress import call_args, make_case, run_calls


def official_pooled(x: torch.Tensor, ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """float64 pooled rows ``[S // ratio, d]`` of one request's whole sequence ``x [S, 2 coff d]`` (official
    ``Compressor.forward`` at ``start_pos == 0``: chunks of ``ratio``, ape added, the overlap transform)."""
    coff = 2 if ratio == 4 else 1
    S, width = x.shape
    d = width // (2 * coff)
    n = S // ratio
    t = x[:n * ratio].double().view(n, ratio, width)
    kv, score = t[..., :coff * d], t[..., coff * d:] + ape.double().view(1, ratio, coff * d)
    if coff == 1:
        return (kv * score.softmax(dim=1)).sum(dim=1)
    kv_w = torch.zeros(n, 2 * ratio, d, dtype=torch.float64)
    sc_w = torch.full((n, 2 * ratio, d), -math.inf, dtype=torch.float64)
    kv_w[:, ratio:], sc_w[:, ratio:] = kv[..., d:], score[..., d:]
    kv_w[1:, :ratio], sc_w[1:, :ratio] = kv[:-1, :, :d], score[:-1, :, :d]
    return (kv_w * sc_w.softmax(dim=1)).sum(dim=1)


def finish64(pooled, weight, eps, cos, sin, ratio, rotate):
    """Norm, RoPE at ``c * ratio``, Hadamard (by its matrix), in float64."""
    d = pooled.shape[1]
    y = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * weight.double()
    at = torch.arange(len(y)) * ratio
    c, s = cos[at].double(), sin[at].double()
    r = y[:, d - 64:].clone()
    y[:, d - 64::2] = r[:, 0::2] * c - r[:, 1::2] * s
    y[:, d - 63::2] = r[:, 0::2] * s + r[:, 1::2] * c
    if rotate:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        y = y @ h.T / math.sqrt(d)
    return y


def simulate(ratio, d, layout, schedules, rotate=False, index_scale="pow2", seed=0):
    """Run ``schedules`` through the reference; returns (rows emitted [b] -> {c: row}, expected [b] -> [n, d]
    float64 from the whole sequences, the cache, rows a request)."""
    case = make_case(ratio, d, layout, schedules, seed=seed)
    emitted = [dict() for _ in schedules]
    for pos, req, got in run_calls(case, "reference", rotate, index_scale):
        for t in range(len(pos)):
            if (int(pos[t]) + 1) % ratio == 0:
                assert int(pos[t]) // ratio not in emitted[int(req[t])]
                emitted[int(req[t])][int(pos[t]) // ratio] = got[t]
            else:
                assert torch.isnan(got[t]).all()
    expected = [finish64(official_pooled(x, case.ape, ratio), case.norm_weight, case.eps, case.cos, case.sin, ratio,
                         rotate) for x in case.xs]
    return emitted, expected, case.cache, case.max_rows


SCHEDULES = {4: [[13, 11, 1, 1, 1, 1, 1, 9], [5, 1, 1, 1, 30, 1, 1, 0], [0, 0, 8, 1, 1, 1, 1, 1]],
             128: [[200, 57, 1, 1, 70], [130, 1, 125, 1, 1], [1, 1, 1, 300, 0]]}


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("layout", ["paged", "ring"])
@pytest.mark.parametrize("d,rotate,scale", [(512, False, "pow2"), (128, True, "exact"), (128, False, "pow2")])
def test_compress_over_calls_matches_the_official_prefill(ratio, layout, d, rotate, scale):
    emitted, expected, cache, max_rows = simulate(ratio, d, layout, SCHEDULES[ratio], rotate, scale, seed=ratio + d)
    for b, want in enumerate(expected):
        assert sorted(emitted[b]) == list(range(len(want))), b  # one row per full window, none twice
        got = torch.stack([emitted[b][c] for c in range(len(want))]).double()
        rtol = 1e-4 if scale == "exact" else 2.0 ** -8 + 1e-4  # "pow2" rows are rounded to bf16 (2^-8 at most)
        assert torch.allclose(got, want, rtol=rtol, atol=1e-4), (b, (got - want).abs().max())
        slots = torch.arange(len(want)) + b * max_rows
        back = (dsv4.read_kv_v4(cache, slots).double() if d == L.D else dsv4.read_index_k(cache, slots).double())
        # FP8 e4m3 keeps 3 mantissa bits: within 1/16 of each value's tile scale (the bf16 RoPE values closer)
        tile = 64 if d == L.D else 128
        amax = want[:, :(L.D_NOPE if d == L.D else d)].abs().view(len(want), -1, tile).amax(-1, keepdim=True)
        err = (back - want)[:, :(L.D_NOPE if d == L.D else d)].abs().view(len(want), -1, tile)
        assert (err <= amax / 14 + 1e-6).all(), b
        if d == L.D:
            assert torch.allclose(back[:, L.D_NOPE:], want[:, L.D_NOPE:], rtol=1e-2, atol=1e-2)


def test_compress_index_scales_differ_as_the_engines_do():
    """``pow2``: the power-of-two scale of the bf16-rounded key (vLLM); ``exact``: ``amax / 448`` (SGLang)."""
    _, _, c_pow2, _ = simulate(4, 128, "paged", [[8]], False, "pow2", seed=1)
    _, _, c_exact, _ = simulate(4, 128, "paged", [[8]], False, "exact", seed=1)
    pages = [L.index_pages(c) for c in (c_pow2, c_exact)]
    s_pow2, s_exact = (p.pages[0, 64 * 128:64 * 128 + 8].view(torch.float32) for p in pages)
    assert torch.equal(torch.exp2(torch.log2(s_pow2).round()), s_pow2)  # powers of two
    assert not torch.equal(torch.exp2(torch.log2(s_exact).round()), s_exact)


def test_compress_argument_errors():
    T = 4
    kv = torch.randn(T, 2048)
    base = dict(ratio=4, state=torch.zeros(8, 2048), state_table=torch.zeros(1, 1, dtype=torch.int32),
                state_block=256, state_ring=8, norm_weight=torch.ones(512), eps=1e-6, cos=torch.ones(8, 32),
                sin=torch.zeros(8, 32), cache=L.new_kv_cache(1, 64), out_slots=torch.zeros(T, dtype=torch.int64))
    args = (kv, torch.zeros(4, 1024), torch.arange(T), torch.zeros(T, dtype=torch.int32),
            torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32))
    compress(*args, **base)
    with pytest.raises(ValueError, match="ratio must be one of"):
        compress(*args, **{**base, "ratio": 8})
    with pytest.raises(ValueError, match=r"kv_score must be float32 \[T, 2048\]"):
        compress(kv.bfloat16(), *args[1:], **base)
    with pytest.raises(ValueError, match=r"ape must be \[4, 1024\]"):
        compress(kv, torch.zeros(8, 512), *args[2:], **base)
    with pytest.raises(ValueError, match=r"query_start must be an integer \[2\]"):
        compress(*args[:4], torch.tensor([0], dtype=torch.int32), args[5], **base)
    with pytest.raises(ValueError, match="state must be float32"):
        compress(*args, **{**base, "state": torch.zeros(8, 1024)})
    with pytest.raises(ValueError, match="rotate .* indexer's keys only"):
        compress(*args, **{**base, "rotate": True})
    with pytest.raises(ValueError, match="index_scale must be one of"):
        compress(*args, **{**base, "index_scale": "ue8m0"})
    with pytest.raises(ValueError, match="impl='tilelang' needs the tensors on a CUDA or MUSA device"):
        compress(*args, **base, impl="tilelang")
    with pytest.raises(ValueError, match=r"cos must be a floating \[max_pos, 32\]"):
        compress(*args, **{**base, "cos": torch.ones(8, 64)})


@pytest.mark.parametrize("has_ape", [True, False])
def test_state_rows_hold_each_engines_format(has_ape):
    """What the op leaves in the state is what the engine's own kernels read: ``[kv | score + ape[pos % r]]``
    with ``state_has_ape`` (vLLM), ``[kv | score]`` without (SGLang), at the table's rows; other rows untouched."""
    g = torch.Generator().manual_seed(2)
    T, ratio = 6, 4
    kv = torch.randn(T, 2048, generator=g)
    ape = torch.randn(4, 1024, generator=g)
    state = torch.full((5, 4, 2048), float("nan"))
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    compress(kv, ape, torch.arange(T), torch.zeros(T, dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32),
             torch.tensor([T], dtype=torch.int32), ratio=ratio, state=state, state_table=table, state_block=4,
             state_ring=4, norm_weight=torch.ones(512), eps=1e-6, cos=torch.ones(8, 32), sin=torch.zeros(8, 32),
             cache=L.new_kv_cache(1, 64), out_slots=torch.arange(T), state_has_ape=has_ape)
    for p in range(T):
        want = kv[p].clone()
        if has_ape:
            want[1024:] += ape[p % 4]
        assert torch.equal(state[int(table[0, p // 4]), p % 4], want), p
    assert torch.isnan(state[[0, 2, 4]]).all() and torch.isnan(state[1, 2:]).all()


def test_default_state_rows_keep_nothing_past_the_table_or_the_state():
    """The rows both paths save tokens to when the caller names none: the table's row of the position, ``-1`` for
    padding, a column past the table, a negative entry, a row past the state."""
    from musa_attn_backend.kernels.dsv4.compressor.reference import default_state_rows

    table = torch.tensor([[3, 0], [-1, 2]], dtype=torch.int32)  # 2 requests, 2 blocks of 4 positions, ring 4
    req = torch.tensor([0, 0, 0, 1, 1, -1, 0])
    pos = torch.tensor([1, 6, 8, 2, 5, 0, 7])
    got = default_state_rows(req, pos, table, 4, 4, num_rows=14)
    # pos 1 -> block 3 row 13; pos 6 -> block 0 row 2; pos 8: column 2 past the table; request 1 pos 2: entry -1;
    # pos 5 -> block 2 row 9; padding; pos 7 -> block 0 row 3
    assert got.tolist() == [13, 2, -1, -1, 9, -1, 3]
    assert default_state_rows(req, pos, table, 4, 4, num_rows=13).tolist()[0] == -1  # row 13 past 13 rows


def test_compress_reference_keeps_nothing_for_a_position_past_the_table():
    """A token whose position lies past its request's state table: no read or write outside the buffers (the
    reference clamps its window reads as the kernel does) and no state row written for it."""
    case = make_case(4, L.INDEX_D, "paged", [[9]], seed=5)
    narrow = case.table[:, :1].contiguous()  # covers positions 0..3 only
    before = case.state.clone()
    kw = next(call_args(case))
    kw["state_table"] = narrow
    dsv4.compress(**kw, impl="reference")
    blocks = case.state
    block = int(narrow[0, 0])
    changed = ~(torch.isnan(blocks) & torch.isnan(before)) & (blocks != before)
    assert changed[block, :4].any(dim=-1).all()  # positions 0..3: kept in the table's block
    changed[block, :4] = False
    assert not changed.any()  # positions 4..8: past the table, nothing kept anywhere
