"""Bad input to ``paged_attention`` is refused before any kernel runs, with a message naming the argument."""

import random

import pytest
import torch

from musa_attn_backend.kernels import paged_attention
from musa_attn_backend.testing import random_batch


@pytest.fixture(scope="module")
def case():
    batch = random_batch(random.Random(0), batch_size=2, page_size=16, max_seq_len=40)
    k_cache, v_cache, _, _ = batch.make_kv(2, 64, torch.bfloat16)
    q = torch.randn(batch.num_tokens, 4, 64).bfloat16()
    return q, k_cache, v_cache, batch.meta()


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda q, k, v, m: (q[0], k, v, m, {}), "q must be a 3-D tensor"),
        (lambda q, k, v, m: (q.to(torch.int32), k, v, m, {}), "q dtype"),
        (lambda q, k, v, m: (q[..., :32], k, v, m, {}), "head_dim of q"),
        (lambda q, k, v, m: (q[:, :3], k, v, m, {}), "multiple of num_kv_heads"),
        (lambda q, k, v, m: (q[1:], k, v, m, {}), "tokens, meta describes"),
        (lambda q, k, v, m: (q, k[:, :8], v[:, :8], m, {}), "page size"),
        (lambda q, k, v, m: (q, k, v[:, :, :1], m, {}), "v_cache shape"),
        (lambda q, k, v, m: (q, k.half(), v.half(), m, {}), "KV cache dtype"),
        (lambda q, k, v, m: (q, k, v.half(), m, {}), "k_cache .* and v_cache .* differ"),
        (lambda q, k, v, m: (q, k, v, m, {"k_scale": 0.5}), "only to an FP8"),
        (lambda q, k, v, m: (q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), m,
                             {"k_scale": torch.ones(3)}), "k_scale must be a scalar"),
        (lambda q, k, v, m: (q, k, v, m, {"sinks": torch.zeros(3)}), "sinks must be"),
        (lambda q, k, v, m: (q, k, v, m, {"sm_scale": -1.0}), "sm_scale"),
        (lambda q, k, v, m: (q, k, v, m, {"sliding_window": 3.5}), "sliding_window"),
        (lambda q, k, v, m: (q, k, v, m, {"logit_softcap": -2.0}), "logit_softcap"),
        (lambda q, k, v, m: (q, k, v, m, {"impl": "cuda"}), "impl must be one of"),
        (lambda q, k, v, m: (q, k, v, m, {"impl": "tilelang"}), "impl='tilelang' needs"),
        (lambda q, k, v, m: (q, k, v, "meta", {}), "meta must be a PagedKVMeta"),
        (lambda q, k, v, m: (q, k, v, m, {"new_kv": torch.zeros(3)}), "new_kv must be a \\(k, v\\) pair"),
        (lambda q, k, v, m: (q, k, v, m, {"new_kv": (torch.zeros(q.shape[0], 2, 64),)}), "new_kv must be a"),
        (lambda q, k, v, m: (q, k, v, m, {"new_kv": (torch.zeros(q.shape[0] - 1, 2, 64), torch.zeros(
            q.shape[0], 2, 64))}), r"new_kv\[0\] \(k\) must be .* with at least"),
        (lambda q, k, v, m: (q, k, v, m, {"new_kv": (torch.zeros(q.shape[0], 2, 64), torch.zeros(
            q.shape[0]))}), r"new_kv\[1\] \(v\) must be"),
        (lambda q, k, v, m: (q, k, v, m, {"out": [0.0]}), "out must be a torch.Tensor"),
        (lambda q, k, v, m: (q, k, v, m, {"out": torch.empty_like(q)[:, :2]}),
         r"out must have shape .*\[.*, 4, 64\], got \[.*, 2, 64\]"),
        (lambda q, k, v, m: (q, k, v, m, {"out": torch.empty_like(q)[1:]}), "out must have shape"),
        (lambda q, k, v, m: (q, k, v, m, {"out": torch.empty_like(q, dtype=torch.float32)}), "out dtype must be"),
        (lambda q, k, v, m: (q, k, v, m, {"out": torch.empty_like(q, device="meta")}), "out is on meta"),
        (lambda q, k, v, m: (q, k, v, m, {"out": torch.empty(q.shape[0], 64, 4, dtype=q.dtype).transpose(1, 2)}),
         "out must be contiguous"),
        (lambda q, k, v, m: (q, k, v, m, {"out": q}), "out overlaps q"),
    ],
)
def test_paged_attention_rejects(case, mutate, match):
    q, k, v, meta, kw = mutate(*case)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, k, v, meta, **kw)
