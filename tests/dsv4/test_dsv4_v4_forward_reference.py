"""The independent V4 forward that the engine tests and the V4 demo check served tokens against
(``integration_tests/dsv4_reference.py``): properties its teacher-forced check relies on."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integration_tests"))
import dsv4_reference as R  # noqa: E402
from tiny_dsv4 import CONFIG  # noqa: E402

CFG = dict(CONFIG, vocab_size=300)


@pytest.fixture(scope="module")
def ref():
    return R.Reference(CFG, R.checkpoint(CFG, seed=1), query_chunk=64)


def test_checkpoint_names_and_dtypes():
    w = R.checkpoint(CFG)
    assert w["layers.1.attn.indexer.compressor.ape"].shape == (4, 2 * CFG["index_head_dim"])
    assert w["layers.2.attn.compressor.ape"].shape == (128, CFG["head_dim"])
    assert "layers.0.attn.compressor.ape" not in w and "layers.2.attn.indexer.wq_b.weight" not in w
    assert w["layers.3.ffn.experts.3.w2.weight"].dtype == torch.bfloat16
    assert all(w[k].dtype == torch.float32 for k in w if "hc_" in k or k.endswith(("attn_sink", ".ape", "gate.bias")))


def test_prefix_logits_do_not_see_later_tokens(ref):
    """Position t's logits from the whole sequence equal those from its first t + 1 tokens (so one forward over a
    served prompt and its output checks every step), past the window, C4 rows and the first C128 row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(32, CFG["vocab_size"], (300,), generator=g).tolist()
    full = ref.logits(ids)
    for cut in (1, 3, 7, 129, 200):
        # float32 sums of other lengths round differently, and an FP8 rounding may then land on the next step
        torch.testing.assert_close(ref.logits(ids[:cut]), full[:cut], rtol=0, atol=1e-2)


def test_quant_sim_rounds_to_the_formats():
    x = torch.randn(4, 256) * 3
    y = R.quant_sim(x, 64, "fp8")
    scale = torch.exp2(torch.ceil(torch.log2(x.unflatten(-1, (-1, 64)).abs().amax(-1, keepdim=True) / 448)))
    q = y.unflatten(-1, (-1, 64)) / scale
    assert torch.equal(q, q.to(torch.float8_e4m3fn).float())  # representable in e4m3 after the power-of-two scale
    assert (y - x).abs().max() <= (scale * 2.0 ** -4 * 448 / 2 * 2).max()  # within half an e4m3 step of the top
    z = R.quant_sim(x, 32, "fp4").unflatten(-1, (-1, 32))
    s4 = torch.exp2(torch.ceil(torch.log2(x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 6)))
    assert set((z / s4).abs().unique().tolist()) <= set(R.FP4_GRID.tolist())


def test_agreement_catches_a_wrong_model(ref):
    """The same forward agrees with itself; one with the sinks changed does not."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(32, CFG["vocab_size"], (150,), generator=g).tolist()
    for _ in range(12):  # a greedy continuation
        ids.append(int(ref.logits(ids)[-1].argmax()))
    lp = ref.logits(ids).log_softmax(-1)
    served = [None] + lp[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:])].tolist()
    assert R.agreement(ref, ids, served, 150)["failures"] == []
    w = dict(ref.w)
    w["layers.0.attn.attn_sink"] = w["layers.0.attn.attn_sink"] + 8.0
    wrong = R.Reference(CFG, w)
    res = R.agreement(wrong, ids, served, 150)
    assert res["failures"] and res["median_err"] > 0.06
