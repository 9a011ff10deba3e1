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


# ------------------------------------------------------------------------------------ engine translations
# metadata.sglang / metadata.vllm read engine objects by attribute: stand-ins here, the real engines in
# test_sglang_kit.py / test_vllm_backend.py.
class _Mode:
    def __init__(self, name):
        self.name = name

    def is_draft_extend_v2(self):
        return self.name == "DRAFT_EXTEND_V2"

    def is_dllm_extend(self):
        return self.name == "DLLM_EXTEND"

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")


def _forward_batch(batch, mode, **extra):
    import types

    s = batch.sglang_view(decode_form=mode == "DECODE")
    fb = types.SimpleNamespace(forward_mode=_Mode(mode), req_pool_indices=s["req_pool_indices"],
                               seq_lens=s["seq_lens"], out_cache_loc=s["out_cache_loc"],
                               seq_lens_cpu=s["seq_lens"].cpu(), extend_prefix_lens=s.get("extend_prefix_lens"),
                               extend_seq_lens=s.get("extend_seq_lens"),
                               extend_seq_lens_cpu=list(batch.query_lens),
                               extend_prefix_lens_cpu=list(batch.prefix_lens), **extra)
    return fb, s["req_to_token"]


def test_sglang_forward_batch_translation():
    from musa_attn_backend.metadata import sglang as sm

    rng = random.Random(5)
    for prefixes, decode in (([0, 0, 0], False), ([3, 0, 40], False), ([9, 30, 2], True)):
        batch = random_batch(rng, batch_size=3, page_size=16, max_seq_len=120, decode=decode,
                             prefix_lens=None if decode else prefixes)
        fb, r2t = _forward_batch(batch, "DECODE" if decode else "EXTEND")
        meta = sm.forward_batch_meta(fb, r2t, 16)
        _assert_same(meta, dataclasses_replace(batch.meta(), max_seqlen_k=max(batch.seq_lens)))
        assert meta.new_kv_only == (not decode and not any(batch.prefix_lens))
        # under a CUDA graph: the capacity buffers, the key bound their capacity, never the new-K/V flag
        cap = sm.graph_buffers(r2t, max_bs=8, max_num_tokens=4, page_size=16, device="cpu")
        assert cap.num_tokens == 8 and cap.max_pages == -(-r2t.shape[1] // 16)
        if decode:
            g = sm.forward_batch_meta(fb, r2t, 16, out=cap)
            assert g.seqlens_k.data_ptr() == cap.seqlens_k.data_ptr() and g.max_seqlen_k == cap.max_pages * 16
    for mode in ("DRAFT_EXTEND_V2", "DLLM_EXTEND"):
        with pytest.raises(NotImplementedError, match=mode):
            sm.forward_batch_meta(type("FB", (), {"forward_mode": _Mode(mode)})(), None, 1)


def test_sglang_target_verify_is_a_causal_extend_after_the_accepted_tokens():
    import types

    from musa_attn_backend.metadata import sglang as sm

    accepted = [10, 3, 33]
    batch = random_batch(random.Random(6), batch_size=3, page_size=1, max_seq_len=60, query_lens=[4, 4, 4],
                         prefix_lens=accepted)
    spec = types.SimpleNamespace(draft_token_num=4, topk=1)
    fb, r2t = _forward_batch(batch, "TARGET_VERIFY", spec_info=spec)
    fb.seq_lens = torch.tensor(accepted, dtype=torch.int32)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    meta = sm.forward_batch_meta(fb, r2t, 1)
    assert meta.prefix_lens.tolist() == accepted and meta.query_lens().tolist() == [4, 4, 4]
    assert meta.max_seqlen_q == 4 and meta.max_seqlen_k == max(accepted) + 4
    with pytest.raises(NotImplementedError, match="tree attention mask"):
        sm.chain_draft_tokens(types.SimpleNamespace(draft_token_num=4, topk=2))


def test_sglang_output_buffer_used_only_where_it_fits():
    import types

    from musa_attn_backend.metadata import sglang as sm

    fb = types.SimpleNamespace(_attn_output=torch.empty(5, 8 * 16, dtype=torch.bfloat16))
    view = sm.attn_output_buffer(fb, 5, 8, 16, torch.bfloat16)
    assert view.shape == (5, 8, 16) and view.data_ptr() == fb._attn_output.data_ptr()
    assert sm.attn_output_buffer(types.SimpleNamespace(_attn_output=None), 5, 8, 16, torch.bfloat16) is None
    assert sm.attn_output_buffer(types.SimpleNamespace(), 5, 8, 16, torch.bfloat16) is None
    for bad in (torch.empty(5, 128, dtype=torch.float16), torch.empty(6, 128, dtype=torch.bfloat16),
                torch.empty(5, 256, dtype=torch.bfloat16)[:, ::2]):
        assert sm.attn_output_buffer(types.SimpleNamespace(_attn_output=bad), 5, 8, 16, torch.bfloat16) is None


def _common(batch, **kw):
    import types

    v = batch.vllm_view()
    fields = dict(query_start_loc=v["query_start_loc"], query_start_loc_cpu=v["query_start_loc"].cpu(),
                  seq_lens=v["seq_lens"], num_reqs=batch.batch_size, num_actual_tokens=batch.num_tokens,
                  max_query_len=max(batch.query_lens), max_seq_len=max(batch.seq_lens),
                  block_table_tensor=v["block_table"], slot_mapping=v["slot_mapping"], causal=True,
                  seq_lens_cpu_upper_bound=v["seq_lens"].cpu())
    return types.SimpleNamespace(**{**fields, **kw})


def test_vllm_common_metadata_translation():
    from musa_attn_backend.metadata import vllm as vm

    batch = random_batch(random.Random(8), batch_size=5, page_size=16, max_seq_len=120,
                         query_lens=[1, 1, 7, 20, 1], prefix_lens=[30, 4, 0, 0, 9])
    cm = _common(batch)
    meta = vm.common_metadata_meta(cm, 16, split_decodes=True)
    _assert_same(meta, dataclasses_replace(batch.meta(), max_seqlen_k=max(batch.seq_lens)))
    assert meta.num_decodes == 2 and not meta.new_kv_only  # the trailing decode has a prefix
    assert vm.common_metadata_meta(cm, 16).num_decodes == 0
    assert vm.leading_decodes(torch.tensor([0, 1, 2, 3])) == 3
    assert vm.new_kv_only(torch.tensor([0, 1, 8, 28]), torch.tensor([31, 7, 20]), 1)
    assert not vm.new_kv_only(torch.tensor([0, 1, 8, 28]), None, 1)
    decode = random_batch(random.Random(9), batch_size=4, page_size=16, max_seq_len=120, decode=True)
    dcm = _common(decode)
    assert vm.is_uniform_decode(dcm) and not vm.is_uniform_decode(cm)
    cap = vm.graph_buffers(dcm, max_num_seqs=6, page_size=16, device="cpu")
    assert vm.graph_buffers_fit(cap, dcm) and cap.batch_size == 6
    g = vm.common_metadata_meta(dcm, 16, out=cap)
    assert g.page_table.data_ptr() == cap.page_table.data_ptr() and g.max_seqlen_k == cap.max_pages * 16
    assert not vm.graph_buffers_fit(vm.graph_buffers(dcm, 2, 16, "cpu"), _common(decode, num_reqs=4 + 3))


def test_vllm_cache_views_are_the_nhd_storage():
    from musa_attn_backend.metadata import vllm as vm

    storage = torch.randn(3, 16, 2, 2 * 64)  # NHD [blocks, block, H, 2D]
    k, v = vm.kv_cache_views(storage.permute(0, 2, 1, 3), 64)
    assert k.shape == (3, 16, 2, 64) and torch.equal(k, storage[..., :64]) and torch.equal(v, storage[..., 64:])
    assert k.data_ptr() == storage.data_ptr()


def test_from_lengths_is_what_both_engines_build():
    batch = random_batch(random.Random(10), batch_size=4, page_size=2, max_seq_len=50, max_query_len=8)
    ref = PagedKVMeta.from_vllm(**batch.vllm_view())
    again = PagedKVMeta.from_lengths(query_lens=ref.query_lens(), seqlens_k=ref.seqlens_k,
                                     prefix_lens=ref.prefix_lens, page_table=ref.page_table,
                                     slot_mapping=ref.slot_mapping, page_size=2, max_seqlen_k=ref.max_seqlen_k)
    _assert_same(again, ref)


def dataclasses_replace(meta, **kw):
    import dataclasses

    return dataclasses.replace(meta, **kw)
