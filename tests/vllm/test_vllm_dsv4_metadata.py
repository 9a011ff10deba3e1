"""The torch index metadata of our vLLM DeepSeek-V4 builders (:mod:`musa_attn_backend.metadata.vllm_dsv4`) against
plain loops transcribed from vLLM 0.33.0's Triton kernels (``compressor_utils.CompressedSlotMappingKernel``,
``ops/metadata.compute_token_to_req_indices``, ``sparse_swa``'s decode window indices, ``sparse_mla``'s C128 top-k
and ``cpu_utils.map_local_to_global_slots_cpu``), on random ragged batches: requests with no query rows, padding
rows, ``-1`` (PAD) slots, block tables with unassigned (-1) entries, ratios 4 and 128. Exact equality."""

import pytest
import torch

from musa_attn_backend.metadata import vllm_dsv4 as m


def batch(seed: int, B: int = 6, pad: int = 3, width: int = 12, qmax: int = 40):
    g = torch.Generator().manual_seed(seed)
    qlens = torch.randint(0, qmax, (B,), generator=g)
    qlens[1] = 0  # a request with no rows
    qlens[2] = 1
    ctx = torch.randint(0, 600, (B,), generator=g)
    seq = ctx + qlens
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]).to(torch.int32)
    T = int(qsl[-1]) + pad
    table = torch.randperm(500, generator=g)[:B * width].view(B, width).to(torch.int32)
    table[0, 3:] = -1  # unassigned blocks
    return g, qsl, seq.to(torch.int32), T, table


def loop_req_pos(qsl, seq, T):
    req, pos = [], []
    for t in range(T):
        b = next((i for i in range(len(seq)) if qsl[i] <= t < qsl[i + 1]), -1)
        req.append(b)
        pos.append(-1 if b < 0 else int(seq[b]) - int(qsl[b + 1] - qsl[b]) + t - int(qsl[b]))
    return torch.tensor(req, dtype=torch.int32), torch.tensor(pos)


@pytest.mark.parametrize("seed", range(4))
def test_token_requests_and_positions(seed):
    _, qsl, seq, T, _ = batch(seed)
    want_req, want_pos = loop_req_pos(qsl, seq, T)
    out = torch.full((T + 5,), 99, dtype=torch.int32)
    req = m.token_to_req(qsl, T, out=out)
    assert torch.equal(req, want_req) and req.data_ptr() == out.data_ptr() and int(out[T]) == 99
    assert torch.equal(m.token_positions(qsl, seq, req), want_pos)
    pos_out = torch.full((T + 5,), 77, dtype=torch.int64)
    pos = m.token_positions(qsl, seq, req, out=pos_out)
    assert torch.equal(pos, want_pos) and pos.data_ptr() == pos_out.data_ptr() and int(pos_out[T]) == 77


def loop_slots(local, req, table, rows):
    out = torch.full(local.shape, -1, dtype=torch.int32)
    for t in range(local.shape[0]):
        for j in range(local.shape[1]):
            lo, b = int(local[t, j]), int(req[t])
            if lo < 0 or b < 0 or lo // rows >= table.shape[1] or table[b, lo // rows] < 0:
                continue
            out[t, j] = int(table[b, lo // rows]) * rows + lo % rows
    return out


@pytest.mark.parametrize("rows", [64, 2, 1])
def test_local_to_global(rows):
    g, qsl, seq, T, table = batch(rows)
    req, _ = loop_req_pos(qsl, seq, T)
    local = torch.randint(-3, table.shape[1] * rows + 5, (T, 17), generator=g)
    assert torch.equal(m.local_to_global(local, req, table, rows), loop_slots(local, req, table, rows))


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("seed", range(3))
def test_compressed_slot_mapping_matches_vllms_kernel(ratio, seed):
    g, qsl, seq, T, table = batch(seed + 10 * ratio, qmax=4 * ratio)
    req, pos = loop_req_pos(qsl, seq, T)
    slot_mapping = torch.randint(0, 10_000, (T,), generator=g)
    slot_mapping[torch.rand(T, generator=g) < 0.1] = -1  # replayed tokens (PAD)
    # CompressedSlotMappingKernel: per request, per query row (dcp 1)
    want = torch.full((T,), -1, dtype=torch.long)
    rows = 256 // ratio
    for b in range(len(seq)):
        start = int(seq[b]) - int(qsl[b + 1] - qsl[b])
        for i in range(int(qsl[b + 1] - qsl[b])):
            p, t = start + i, int(qsl[b]) + i
            if (p + 1) % ratio == 0 and slot_mapping[t] != -1:
                c = p // ratio
                if table[b, c // rows] >= 0:
                    want[t] = int(table[b, c // rows]) * rows + c % rows
    out = torch.full((T + 2,), 7, dtype=torch.long)
    got = m.compressed_slot_mapping(pos, req, slot_mapping, table, 256, ratio, out=out)
    assert torch.equal(got, want) and int(out[T]) == 7
    assert int((got >= 0).sum()) > 0


def test_window_is_vllms_decode_window_as_a_set():
    g, qsl, seq, T, table = batch(5)
    req, pos = loop_req_pos(qsl, seq, T)
    got = m.local_to_global(m.window_local(pos, 128), req, table, 64)
    for t in range(T):
        if req[t] < 0:
            assert (got[t] == -1).all()
            continue
        p = int(pos[t])  # vLLM: slots of positions max(p - 127, 0) .. p, -1 padded
        want = loop_slots(torch.arange(max(p - 127, 0), p + 1).view(1, -1), req[t:t + 1], table, 64)
        assert sorted(got[t][got[t] >= 0].tolist()) == sorted(want[want >= 0].tolist())
        assert int((got[t] >= 0).sum()) == int((want >= 0).sum())


@pytest.mark.parametrize("ratio,width", [(128, 8), (4, 16)])
def test_dense_compressed_sets(ratio, width):
    pos = torch.tensor([-1, 0, 3, 4, 127, 128, 255, 1000, 5000])
    got = m.dense_local(pos, ratio, width)
    for t, p in enumerate(pos.tolist()):
        n = max((p + 1) // ratio, 0)
        assert got[t].tolist() == [j if j < n else -1 for j in range(width)]
    buf = torch.full((12, width), 5, dtype=torch.int32)
    cand = m.all_candidates(pos, ratio, width, out=buf)
    assert torch.equal(cand, got.to(torch.int32)) and cand.data_ptr() == buf.data_ptr() and (buf[9:] == 5).all()
