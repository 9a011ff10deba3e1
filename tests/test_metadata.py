import random

import pytest
import torch

from musa_attn_backend.metadata import PagedKVMeta
from musa_attn_backend.testing import random_batch

PAGE_SIZES = [1, 2, 16, 32, 64, 128]


def _assert_same(a: PagedKVMeta, b: PagedKVMeta):
    for name, t in a.tensors().items():
        u = getattr(b, name)
        assert t.dtype == u.dtype, name
        assert t.shape == u.shape, (name, t.shape, u.shape)
        assert torch.equal(t, u), name
    assert (a.page_size, a.max_seqlen_q, a.max_seqlen_k) == (b.page_size, b.max_seqlen_q, b.max_seqlen_k)


def _expected(batch):
    cu = [0]
    for q in batch.query_lens:
        cu.append(cu[-1] + q)
    table = torch.zeros(batch.batch_size, batch.max_pages, dtype=torch.int32)
    for i, pages in enumerate(batch.pages):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return cu, table


@pytest.mark.parametrize("seed", range(6))
def test_sglang_and_vllm_views_agree_on_random_batches(seed):
    """Property: for 400 random logical batches both engine views give identical kernel arguments."""
    rng = random.Random(seed)
    for _ in range(400 // 6 + 1):
        page_size = rng.choice(PAGE_SIZES)
        decode = rng.random() < 0.3
        batch = random_batch(rng, batch_size=rng.randint(1, 9), page_size=page_size,
                             max_seq_len=rng.randint(1, 300), decode=decode, max_query_len=rng.choice([1, 8, 64]))
        from_v = PagedKVMeta.from_vllm(**batch.vllm_view())
        from_s = PagedKVMeta.from_sglang(**batch.sglang_view())
        _assert_same(from_s, from_v)
        # The derived slots (out_cache_loc omitted) equal the engine-given ones.
        _assert_same(PagedKVMeta.from_sglang(**batch.sglang_view(with_out_cache_loc=False)), from_v)
        # A decode batch may also arrive in extend form.
        if decode:
            _assert_same(PagedKVMeta.from_sglang(**batch.sglang_view(decode_form=False)), from_v)
        # ...and the arguments are the logical batch.
        cu, table = _expected(batch)
        assert from_v.cu_seqlens_q.tolist() == cu
        assert from_v.seqlens_k.tolist() == batch.seq_lens
        assert from_v.prefix_lens.tolist() == batch.prefix_lens
        assert torch.equal(from_v.page_table, table)
        assert from_v.slot_mapping.tolist() == batch.new_token_slots().tolist()
        assert from_v.max_seqlen_q == max(batch.query_lens)
        assert from_v.max_seqlen_k >= max(batch.seq_lens)
        assert from_v.is_decode == batch.is_decode
        from_v.validate()


def test_out_buffers_are_written_in_place():
    rng = random.Random(7)
    cap = PagedKVMeta.allocate(max_batch=16, max_tokens=512, max_pages=40, page_size=16, device="cpu")
    addrs = {n: t.data_ptr() for n, t in cap.tensors().items()}
    for _ in range(50):
        batch = random_batch(rng, batch_size=rng.randint(1, 16), page_size=16, max_seq_len=600,
                             decode=rng.random() < 0.5, max_query_len=30)
        plain = PagedKVMeta.from_vllm(**batch.vllm_view())
        for meta in (PagedKVMeta.from_vllm(**batch.vllm_view(), out=cap),
                     PagedKVMeta.from_sglang(**batch.sglang_view(), out=cap)):
            for name, t in meta.tensors().items():
                assert t.data_ptr() == addrs[name], f"{name} was reallocated"
                ref = getattr(plain, name)
                if name == "page_table":
                    assert torch.equal(t[:, : ref.shape[1]], ref) and not t[:, ref.shape[1]:].any()
                else:
                    assert torch.equal(t, ref), name
            assert meta.max_seqlen_k == 40 * 16


def test_decode_path_never_syncs_to_host(monkeypatch):
    """The decode constructor (CUDA-graph replay path) reads no device value on the host."""
    rng = random.Random(3)
    batch = random_batch(rng, batch_size=8, page_size=16, max_seq_len=200, decode=True)
    cap = PagedKVMeta.allocate(max_batch=8, max_tokens=8, max_pages=batch.max_pages, page_size=16, device="cpu")
    view = batch.sglang_view()
    vview = batch.vllm_view()

    def boom(*a, **k):
        raise AssertionError("host sync on the decode path")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    m1 = PagedKVMeta.from_sglang(**view, out=cap)
    m2 = PagedKVMeta.from_vllm(**vview, out=cap)
    monkeypatch.undo()
    assert m1.is_decode and m2.is_decode
    assert m2.seqlens_k.tolist() == batch.seq_lens


def test_meta_errors_name_the_argument():
    rng = random.Random(0)
    batch = random_batch(rng, batch_size=3, page_size=16, max_seq_len=50)
    view = batch.vllm_view()
    with pytest.raises(ValueError, match="query_start_loc"):
        PagedKVMeta.from_vllm(**{**view, "query_start_loc": view["query_start_loc"][:-1]})
    with pytest.raises(ValueError, match="page_size"):
        PagedKVMeta.from_vllm(**{**view, "page_size": 0})
    with pytest.raises(ValueError, match="block_table"):
        PagedKVMeta.from_vllm(**{**view, "block_table": view["block_table"][0]})
    s = batch.sglang_view(decode_form=False)
    with pytest.raises(ValueError, match="extend_prefix_lens and extend_seq_lens"):
        PagedKVMeta.from_sglang(**{**s, "extend_prefix_lens": None})
    with pytest.raises(ValueError, match="seq_lens"):
        PagedKVMeta.from_sglang(**{**s, "seq_lens": s["seq_lens"][:1]})
    cap = PagedKVMeta.allocate(max_batch=2, max_tokens=1000, max_pages=10, page_size=16, device="cpu")
    with pytest.raises(ValueError, match="capacity"):
        PagedKVMeta.from_vllm(**view, out=cap)
    bad = PagedKVMeta.from_vllm(**view)
    bad.prefix_lens[0] += 1
    with pytest.raises(ValueError, match="prefix"):
        bad.validate()
