"""The V4 attention slots op (``dsv4.attention_slots``): its reference against loops over each entry on random
ragged batches (padding rows, unassigned table entries, rows past the table, negative indexer entries), and
its argument checks. The TileLang program against the reference: ``test_gpu_dsv4_slots.py``."""

import pytest
import torch

from musa_attn_backend.kernels import dsv4


def case(seed, T=23, B=4, W=6, K=16, ratio=4, rows=64):
    g = torch.Generator().manual_seed(seed)
    req = torch.randint(-1, B, (T,), generator=g).to(torch.int32)
    pos = torch.randint(0, 1500, (T,), generator=g)
    pos[req < 0] = -1
    swa = torch.randint(-1, 500, (B, 24), generator=g).to(torch.int32)
    main = torch.randint(-1, 500, (B, W), generator=g).to(torch.int32)
    topk = torch.randint(-1, W * rows + 40, (T, K), generator=g).to(torch.int32)
    return pos, req, swa, main, topk


def slot(table, r, local, rows):
    if local < 0 or r < 0 or local // rows >= table.shape[1] or table[r, local // rows] < 0:
        return -1
    return int(table[r, local // rows]) * rows + local % rows


@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_loops(ratio, seed):
    pos, req, swa, main, topk = case(seed)
    rows = {1: 0, 4: 64, 128: 2}[ratio]
    width = 13
    win, comp = dsv4.attention_slots(pos, req, swa, 64, 128, ratio, main if ratio > 1 else None, rows,
                                     topk if ratio == 4 else None, width if ratio == 128 else 0)
    for t in range(pos.numel()):
        p, r = int(pos[t]), int(req[t])
        want = [slot(swa, r, p - 127 + j if p >= 0 and p - 127 + j >= 0 else -1, 64) for j in range(128)]
        assert win[t].tolist() == want
        if ratio == 4:
            assert comp[t].tolist() == [slot(main, r, int(x), rows) for x in topk[t]]
        elif ratio == 128:
            seen = (p + 1) // 128 if p >= 0 else 0
            assert comp[t].tolist() == [slot(main, r, j if j < seen else -1, rows) for j in range(width)]
        else:
            assert comp is None


def test_refuses_bad_arguments():
    pos, req, swa, main, topk = case(0)
    with pytest.raises(ValueError, match="ratio must be one of"):
        dsv4.attention_slots(pos, req, swa, 64, 128, 2)
    with pytest.raises(ValueError, match="topk_local must be an integer"):
        dsv4.attention_slots(pos, req, swa, 64, 128, 4, main, 64, None)
    with pytest.raises(ValueError, match="req must be an integer"):
        dsv4.attention_slots(pos, req[:3], swa, 64, 128)
    with pytest.raises(ValueError, match="width must be a positive int"):
        dsv4.attention_slots(pos, req, swa, 64, 128, 128, main, 2, None, 0)
