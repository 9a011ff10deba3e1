"""Every prefill tiling the tuner (``musa-attn tune``) may pick, on a GPU against the PyTorch reference
(``pytest -m gpu``): a tiling the tuning table records must be correct wherever it is chosen, not only the
default one the attention tests run.

Outputs are poisoned with NaN before each run (MUSA_ATTN_POISON) and caches hold NaN in every slot no request
owns; bounds from :mod:`musa_attn_backend.testing.numeric` (the kernel table, and the kernel LSE bound).
"""

import random

import pytest
import torch

from musa_attn_backend.kernels import paged_attention
from musa_attn_backend.kernels.attention import tilelang_impl
from musa_attn_backend.testing import random_batch
from musa_attn_backend.testing.numeric import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(use_settings):
    use_settings(poison=True)


@pytest.mark.parametrize("variant", ["causal", "non_causal", "softcap", "sinks", "fp16", "hd64", "mqa"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_prefill_every_tiling(gpu_device, page_size, variant, use_settings):
    """Every prefill tiling this platform offers for the pages (ping-pong with TMA tiles or with a gathering
    producer, whole-tile TMA and row gathers at each tile width, the ones ``musa-attn tune`` picks from; plus the
    ping-pong kernel with TMA copies of page chunks), on one ragged extend batch with odd lengths."""
    use_settings(pingpong_gather=True)  # the default: gathering ping-pong offered
    hq, hkv, d, dtype = 16, 4, 128, torch.bfloat16
    opts, causal = {}, variant != "non_causal"
    if variant == "softcap":
        opts["logit_softcap"] = 25.0
    elif variant == "sinks":
        opts["sinks"] = torch.randn(hq, device=gpu_device)
    elif variant == "fp16":
        dtype = torch.float16
    elif variant == "hd64":
        d = 64
    elif variant == "mqa":
        hq, hkv = 24, 1
    b = random_batch(random.Random(page_size + len(variant)), device=gpu_device, batch_size=5, page_size=page_size,
                     max_seq_len=2000, prefix_lens=[0, 500, 129, 3, 64], query_lens=[1, 77, 300, 1030, 191])
    k_cache, v_cache, _, _ = b.make_kv(hkv, d, dtype)
    q = torch.randn(b.num_tokens, hq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(gpu_device)
    meta = b.meta()
    ref, ref_lse = paged_attention(q, k_cache, v_cache, meta, causal=causal, return_lse=True, impl="reference",
                                   **opts)
    use_settings(tma_chunks=True)  # the default: page-chunk TMA tiles offered
    cfgs = tilelang_impl.prefill_candidates(d, d, False, page_size, False)
    plat = tilelang_impl.get_platform()
    assert any(c.tma and not c.tma_rows for c in cfgs) == (plat.bulk_copy and page_size % 64 == 0)
    # (the ping-pong kernels keep P in registers: none where MUSA_ATTN_SHARED_P=1 says GEMMs cannot read it)
    pingpong = plat.warp_specialized and plat.gemm_a_in_registers
    assert any(c.tma_rows for c in cfgs) == (pingpong and d in (64, 128) and page_size % 16 == 0
                                             and page_size % 128 != 0)
    for cfg in cfgs:
        out, lse = tilelang_impl.paged_attention_tilelang(q, k_cache, v_cache, meta, causal=causal, return_lse=True,
                                                          prefill_cfg=cfg, **opts)
        assert not torch.isnan(out).any(), f"{cfg}: unwritten (NaN-poisoned) output elements"
        assert_close(out, ref, dtype, msg=lambda m: f"{cfg}: {m}")
        assert_close(lse, ref_lse, lse=True, msg=lambda m: f"{cfg} (LSE): {m}")
