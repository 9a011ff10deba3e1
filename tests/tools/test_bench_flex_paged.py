"""The paged FlexAttention peer of the benchmark reads the shuffled paged pool correctly (CPU, unfused Flex)."""

import math
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_paged_prefill_matches_sdpa(causal, page_size):
    import bench_attention as bench

    torch.manual_seed(0)
    s, hq, hkv, d = 200, 4, 2, 32
    # pages the request does not own hold large finite junk (Flex, like any masked dense product, multiplies
    # masked positions by zero, so NaN there would spread): a slot mapped wrong would dominate the result
    pages = math.ceil(s / page_size) + 5
    order = list(range(pages))
    random.Random(1).shuffle(order)
    table = torch.tensor(order[: math.ceil(s / page_size)], dtype=torch.int32).view(1, -1)
    k = 1e3 * torch.randn(pages, page_size, hkv, d)
    v = 1e3 * torch.randn(pages, page_size, hkv, d)
    rows = (table[0].long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    k.view(-1, hkv, d)[rows] = torch.randn(len(rows), hkv, d)
    v.view(-1, hkv, d)[rows] = torch.randn(len(rows), hkv, d)
    q = torch.randn(s, hq, d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # unfused Flex on a CPU
        out = bench.flex_paged_prefill(q, k, v, table, causal, compiled=False)()[0].transpose(0, 1)
    kk = k.reshape(-1, hkv, d)[rows[:s]].transpose(0, 1)[None]
    vv = v.reshape(-1, hkv, d)[rows[:s]].transpose(0, 1)[None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=causal,
                                                           enable_gqa=True)[0].transpose(0, 1)
    # float32 Flex (unfused, on a CPU) against float32 SDPA: 1e-5, tighter than the table's float32 reference
    # bound (2e-5); kept as it is
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
