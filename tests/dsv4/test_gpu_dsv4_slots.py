"""The V4 attention slots program on the GPU against its reference, exactly: each mode, padding rows, unassigned
table entries, rows past the table, negative indexer entries, a decode batch and a long prefill."""

import pytest
import torch

from musa_attn_backend.kernels import dsv4

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,B,K", [(37, 5, 512), (1, 1, 16), (4096, 1, 512)])
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_program_matches_reference(gpu_device, T, B, K, ratio):
    g = torch.Generator().manual_seed(T + ratio)
    req = torch.randint(-1, B, (T,), generator=g).to(torch.int32)
    pos = torch.randint(0, 70_000, (T,), generator=g)
    pos[req < 0] = -1
    swa = torch.randint(-1, 9000, (B, 1100), generator=g).to(torch.int32)
    rows = 64 if ratio == 4 else 2
    main = torch.randint(-1, 9000, (B, 280), generator=g).to(torch.int32)
    topk = torch.randint(-1, 280 * rows + 100, (T, K), generator=g).to(torch.int32)
    args = (pos, req, swa, 64, 128, ratio, main if ratio > 1 else None, rows if ratio > 1 else 0,
            topk if ratio == 4 else None, 547 if ratio == 128 else 0)
    want = dsv4.attention_slots(*args, impl="reference")
    dev = [a.to(gpu_device) if isinstance(a, torch.Tensor) else a for a in args]
    got = dsv4.attention_slots(*dev, impl="tilelang")
    assert torch.equal(got[0].cpu(), want[0])
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        assert torch.equal(got[1].cpu(), want[1])
