"""Our indexer references against the engines' own torch paths, on the CPU (skipped where the engine does not
import): SGLang's ``fp8_paged_mqa_logits_torch`` (bf16 products: compared within 2e-2 of each row's largest
value, columns below the length) and ``topk_transform_pytorch_vectorized`` (the same slot sets); vLLM's
``fp8_paged_mqa_logits_torch`` (next_n 1, float32: 1e-4) and ``fp8_mqa_logits_torch`` (bf16 products: 2e-2)."""

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

E4M3 = torch.float8_e4m3fn


def sglang_indexer():
    try:
        from sglang.srt.layers.attention.dsv4 import indexer
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's V4 indexer does not import here: {type(e).__name__}: {e}")
    return indexer


def vllm_ops():
    try:
        from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM's indexer references do not import here: {type(e).__name__}: {e}")
    return ops


def paged_case(seed, B=4, P=6, H=64):
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(B * P, L.index_page_bytes(64), dtype=torch.uint8)
    cache = dsv4.paged_view(buf, 64, L.INDEX_ROW_BYTES)
    dsv4.write_index_k(torch.randn(B * P * 64, 128, generator=g), cache, torch.arange(B * P * 64))
    table = torch.randperm(B * P, generator=g).view(B, P).to(torch.int32)
    lens = torch.tensor([1, 64, 200, P * 64], dtype=torch.int32)[:B]
    q = (torch.randn(B, 1, H, 128, generator=g) * 2).to(E4M3)
    w = torch.randn(B, H, generator=g)
    return buf, cache, table, lens, q, w


def close_rows(a, b, n, rtol):
    for i in range(a.shape[0]):
        x, y = a[i, :n[i]].double(), b[i, :n[i]].double()
        if n[i]:
            assert (x - y).abs().max() <= rtol * y.abs().max().clamp(min=1e-30), i


def test_paged_logits_match_sglangs_torch_path():
    indexer = sglang_indexer()
    buf, cache, table, lens, q, w = paged_case(1)
    ours = dsv4.paged_indexer_logits(q, w, cache, lens, table, 6 * 64)
    theirs = indexer.fp8_paged_mqa_logits_torch(q, buf.view(-1, 64, 1, L.INDEX_ROW_BYTES), w, lens, table, None,
                                                6 * 64, clean_logits=False)
    close_rows(ours, theirs, lens.tolist(), 2e-2)


def test_paged_logits_match_vllms_torch_path():
    ops = vllm_ops()
    buf, cache, table, lens, q, w = paged_case(2)
    ours = dsv4.paged_indexer_logits(q, w, cache, lens, table, 6 * 64)
    theirs = ops.fp8_paged_mqa_logits_torch(q, buf.view(-1, 64, 1, L.INDEX_ROW_BYTES), w, lens, table, 6 * 64)
    close_rows(ours, theirs, lens.tolist(), 1e-4)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs))  # both -inf past each length


def test_prefill_logits_match_vllms_torch_path():
    ops = vllm_ops()
    g = torch.Generator().manual_seed(3)
    T, S, H = 9, 300, 64
    q = (torch.randn(T, H, 128, generator=g) * 2).to(E4M3)
    w = torch.randn(T, H, generator=g)
    k = torch.randn(S, 128, generator=g).to(E4M3)
    ks = torch.rand(S, generator=g) + 0.5
    starts = torch.randint(0, 100, (T,), generator=g, dtype=torch.int32)
    ends = starts + torch.randint(0, 200, (T,), generator=g, dtype=torch.int32)
    ours = dsv4.indexer_logits(q, w, k, ks, starts, ends)
    theirs = ops.fp8_mqa_logits_torch(q, (k, ks), w, starts, ends)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs))
    fin = torch.isfinite(theirs)
    scale = theirs.abs().where(fin, torch.zeros_like(theirs)).amax()
    assert ((ours - theirs).abs().where(fin, torch.zeros_like(ours)) <= 2e-2 * scale).all()


def test_topk_slots_match_sglangs_torch_path():
    indexer = sglang_indexer()
    g = torch.Generator().manual_seed(4)
    T, N, k = 6, 900, 512
    logits = torch.randn(T, N, generator=g)
    lens = torch.tensor([0, 3, 512, 513, 800, 900], dtype=torch.int32)
    table = torch.randint(0, 200, (T, 15), generator=g, dtype=torch.int32)
    ours = dsv4.indexer_topk(logits, lens, k, page_table=table)
    theirs = torch.empty(T, k, dtype=torch.int32)
    indexer.topk_transform_pytorch_vectorized(logits, lens, table, theirs, 64)
    for t in range(T):
        a, b = ours[t].tolist(), theirs[t].tolist()
        if lens[t] <= k:
            assert a == b, t  # short rows: the same slots in the same order, -1 padded
        else:
            assert sorted(a) == sorted(b), t  # no ties among random floats: the same set
