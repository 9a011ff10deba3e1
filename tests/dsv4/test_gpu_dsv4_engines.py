"""DeepSeek-V4 caches written by the engines' own writers (their Triton kernels, run on the GPU with the
python-only SGLang and vLLM the device carries): our writers give the same bytes, and our sparse MQA on the
engines' caches gives the reference result. SGLang: its kit's packer (``quant_to_nope_fp8_rope_bf16_pack_triton``)
and the pool's store (``SetKAndS``'s Triton kernel); vLLM: ``quantize_and_insert_k_cache``, imported under empty
parent packages (its ``deepseek_v4`` package ``__init__`` pulls in compiled ops). Skipped where an engine does not
import."""

import importlib
import os
import sys
import types

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

pytestmark = pytest.mark.gpu

VLLM_OPS = ("vllm.models.deepseek_v4", "vllm.models.deepseek_v4.common", "vllm.models.deepseek_v4.common.ops")


def sglang_writer():
    """``write(kv, cache, slots, rows)`` through SGLang's kit packer and pool store."""
    try:
        from sglang.kernels.ops.kvcache.dsv4_main_kv_store import _set_k_and_s_triton
        from sglang.test.kernels.deepseek_v4.k_cache_reference import quant_to_nope_fp8_rope_bf16_pack_triton
    except Exception as e:  # noqa: BLE001 - any import failure means this engine cannot run here
        pytest.skip(f"SGLang's V4 writers do not import here: {type(e).__name__}: {e}")

    def write(kv, cache, slots, rows):
        _set_k_and_s_triton(cache, slots, quant_to_nope_fp8_rope_bf16_pack_triton(kv), rows)

    return write


@pytest.fixture
def vllm_writer(monkeypatch):
    """``write(kv, cache, slots, rows)`` through vLLM's ``quantize_and_insert_k_cache``."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM does not import here: {type(e).__name__}: {e}")
    if getattr(vllm, "__file__", None) is None:  # only a namespace package (tests/vllm): no vLLM installed
        pytest.skip("vLLM is not installed here")
    base = os.path.dirname(vllm.__file__)
    for name in VLLM_OPS:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(base, *name.split(".")[1:])]
        monkeypatch.setitem(sys.modules, name, pkg)
    mod = VLLM_OPS[-1] + ".cache_utils"
    try:
        cache_utils = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM's V4 cache writer does not import here: {type(e).__name__}: {e}")
    finally:
        sys.modules.pop(mod, None)

    def write(kv, cache, slots, rows):
        cache_utils.quantize_and_insert_k_cache(kv, cache, slots.to(torch.int64), block_size=rows)

    return write


def rows_with_magnitudes(n, seed, device):
    """Rows whose 64-value tiles span magnitudes 1e-3 .. 1e2 (every tile's max stays above the 1e-4 floor, where
    the kit's packer, with its own floor, would differ)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, 64, generator=g) * 10 ** (torch.rand(n, 8, 1, generator=g) * 5 - 3)
    return x.view(n, 512).to(torch.bfloat16).to(device)


def as_pages(cache):
    """The engines' view of a cache: ``[pages, page bytes]`` uint8 with the cache's page stride."""
    pages, rows, _ = cache.shape
    return cache.as_strided((pages, L.page_bytes(rows)), (cache.stride(0), 1))


GEOMETRIES = [(3, 256, 0), (9, 64, 93888), (40, 2, 0)]  # SGLang SWA, vLLM packed blocks, C128


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("pages,rows,stride", GEOMETRIES)
def test_engine_writers_match_ours_byte_for_byte(gpu_device, request, engine, pages, rows, stride):
    if engine == "sglang" and stride:
        pytest.skip("SGLang's pool store takes contiguous pages only")
    write = sglang_writer() if engine == "sglang" else request.getfixturevalue("vllm_writer")
    dev = gpu_device
    n = pages * rows
    T = max(1, n * 3 // 4)
    slots = torch.randperm(n, device=dev)[:T]
    kv = rows_with_magnitudes(T, seed=n, device=dev)
    theirs = L.new_kv_cache(pages, rows, dev, page_stride=stride)
    ours = L.new_kv_cache(pages, rows, dev, page_stride=stride)
    write(kv, as_pages(theirs), slots, rows)
    dsv4.write_kv_v4(kv, ours, slots, impl="tilelang")
    raw = lambda c: torch.as_strided(c, (c.untyped_storage().nbytes(),), (1,), 0)  # noqa: E731
    diff = (raw(theirs) != raw(ours)).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at byte {diff[0].item()}"
    assert (raw(ours) != 0).any()


def test_flash_mla_on_engine_written_caches(gpu_device, vllm_writer):
    """SWA cache written by SGLang's store (256-row pages), C4 cache by vLLM's writer (64-row pages in packed
    blocks); the decode entry point against the reference on those bytes; rows nobody writes are NaN."""
    dev = gpu_device
    swa = L.new_kv_cache(4, 256, dev)
    c4 = L.new_kv_cache(20, 64, dev, page_stride=93888)
    for cache in (swa, c4):
        torch.as_strided(cache, (cache.untyped_storage().nbytes(),), (1,), 0).fill_(0xFF)
    s_swa = torch.randperm(4 * 256, device=dev)[:700]
    s_c4 = torch.randperm(20 * 64, device=dev)[:900]
    sglang_writer()(rows_with_magnitudes(700, 1, dev), as_pages(swa), s_swa, 256)
    vllm_writer(rows_with_magnitudes(900, 2, dev), as_pages(c4), s_c4, 64)
    B, H = 6, 64
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = s_swa.cpu()[torch.randint(0, 700, (B, 1, 128), generator=g)].to(torch.int32).to(dev)
    xidx = s_c4.cpu()[torch.randint(0, 900, (B, 1, 512), generator=g)].to(torch.int32).to(dev)
    xidx[:, :, ::5] = -1
    q = torch.randn(B, 1, H, 512, device=dev).to(torch.bfloat16)
    sink = torch.randn(H, device=dev)
    lens = torch.tensor([128, 100, 1, 128, 64, 7], dtype=torch.int32, device=dev)
    xlens = torch.tensor([512, 0, 300, 511, 64, 512], dtype=torch.int32, device=dev)
    out, lse = dsv4.flash_mla_with_kvcache(q, swa.unsqueeze(2), None, None, 512, dsv4.get_mla_metadata()[0],
                                           indices=idx, attn_sink=sink, extra_k_cache=c4.unsqueeze(2),
                                           extra_indices_in_kvcache=xidx, topk_length=lens,
                                           extra_topk_length=xlens, is_fp8_kvcache=True)
    ref, ref_lse = dsv4.sparse_mqa(q[:, 0], swa, idx[:, 0], lens, extra_cache=c4, extra_indices=xidx[:, 0],
                                   extra_lengths=xlens, sink=sink, return_lse=True, impl="reference")
    assert torch.isfinite(out).all()
    # rows span 1e-3 .. 1e2: the bf16 P times values of order 1e2 sets the absolute error
    torch.testing.assert_close(out[:, 0].float(), ref.float(), atol=1e-2 * ref.abs().max().item(), rtol=2e-2)
    torch.testing.assert_close(lse[:, :, 0], ref_lse, atol=2e-3, rtol=1e-4)
