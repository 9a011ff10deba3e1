"""TileLang KV write on a GPU against the reference (run with ``pytest -m gpu`` on a CUDA or MUSA machine)."""

import pytest
import torch

from musa_attn_backend.kernels import write_kv, write_kv_reference

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def _case(device, n, pages, page_size, h, d, dv, in_dtype, cache_dtype, strided, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(n, h, d, generator=g).to(in_dtype).to(device)
    v = torch.randn(n, h, dv, generator=g).to(in_dtype).to(device)
    slots = torch.randperm(pages * page_size, generator=g)[:n].to(device)
    slots[torch.rand(n, generator=g).to(device) < 0.2] = -1
    if strided:  # vLLM (NHD): K and V are views of one [blocks, block_size, heads, d + dv] buffer
        buf = torch.full((pages, page_size, h, d + dv), float("nan"), device=device).to(cache_dtype)
        kc, vc = buf.split([d, dv], dim=-1)
    else:
        kc = torch.full((pages, page_size, h, d), float("nan"), device=device).to(cache_dtype)
        vc = torch.full((pages, page_size, h, dv), float("nan"), device=device).to(cache_dtype)
    return k, v, kc, vc, slots


@pytest.mark.parametrize("in_dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.bfloat16, FP8), (torch.float16, FP8)])
@pytest.mark.parametrize("page_size,h,d,dv", [(1, 8, 128, 128), (16, 2, 64, 64), (64, 1, 576, 512),
                                              (128, 4, 256, 256), (32, 3, 96, 96)])
@pytest.mark.parametrize("strided", [False, True])
def test_write_kv_tilelang_matches_reference(gpu_device, in_dtype, cache_dtype, page_size, h, d, dv, strided):
    pages = -(-400 // page_size) + 2
    args = _case(gpu_device, 300, pages, page_size, h, d, dv, in_dtype, cache_dtype, strided, seed=page_size + d)
    k, v, kc, vc, slots = args
    kr, vr = kc.clone(), vc.clone()
    scales = {}
    if cache_dtype == FP8:
        scales = dict(k_scale=torch.rand(h, device=gpu_device) * 0.05 + 0.01, v_scale=0.03)
    write_kv(k, v, kc, vc, slots, impl="tilelang", **scales)
    write_kv_reference(k, v, kr, vr, slots, **scales)
    # Bit-exact, NaN poison included (untouched slots must stay NaN).
    assert torch.equal(kc.float().nan_to_num(7.0), kr.float().nan_to_num(7.0))
    assert torch.equal(vc.float().nan_to_num(7.0), vr.float().nan_to_num(7.0))
    assert torch.isnan(kc.float()).any(), "every slot written: the skip test means nothing"


def test_write_kv_tilelang_refuses_hnd_layout(gpu_device):
    buf = torch.zeros(4, 2, 16, 128, device=gpu_device, dtype=torch.bfloat16)  # [blocks, heads, block, 2D]
    kc, vc = buf.transpose(1, 2).split(64, dim=-1)
    k = torch.randn(3, 2, 64, device=gpu_device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layout not supported"):
        write_kv(k, k, kc, vc, torch.arange(3, device=gpu_device), impl="tilelang")
