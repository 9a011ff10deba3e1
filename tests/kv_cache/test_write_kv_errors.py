"""Bad input to ``write_kv`` is refused before any kernel runs, with a message naming the argument."""

import pytest
import torch

from musa_attn_backend.kernels import write_kv


def _kv():
    k = torch.randn(5, 2, 64)
    return k, k.clone(), torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64), torch.arange(5)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda k, v, kc, vc, s: (k[0], v, kc, vc, s, {}), "k must be a 3-D"),
        (lambda k, v, kc, vc, s: (k, v, kc[0], vc, s, {}), "k_cache must be a 4-D"),
        (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:4], {}), "slot_mapping has 4 entries for 5 tokens"),
        (lambda k, v, kc, vc, s: (k, v, kc, vc, s.float(), {}), "slot_mapping must be a 1-D integer"),
        (lambda k, v, kc, vc, s: (k, v, kc[..., :32], vc, s, {}), "k_cache .* does not hold"),
        (lambda k, v, kc, vc, s: (k, v, kc.half(), vc.half(), s, {}), "only an FP8 cache converts"),
        (lambda k, v, kc, vc, s: (k, v, kc, vc, s, {"k_scale": 2.0}), "only to an FP8 cache"),
        (lambda k, v, kc, vc, s: (k, v, kc.to(torch.int8), vc, s, {}), "k_cache dtype must be"),
        (lambda k, v, kc, vc, s: (k, v[:, :1], kc, vc, s, {}), "differ in tokens or heads"),
    ],
)
def test_write_kv_rejects(mutate, match):
    k, v, kc, vc, s, kw = mutate(*_kv())
    with pytest.raises(ValueError, match=match):
        write_kv(k, v, kc, vc, s, **kw)
