"""Fixtures shared by the SGLang tests."""

import pytest
import torch


def _store(buffer: torch.Tensor, rows: int, slots: torch.Tensor, k: torch.Tensor) -> None:
    from musa_attn_backend.kernels import dsv4

    buffer = buffer.view(torch.uint8)  # the pool hands its FP8 pages out as float8_e4m3fn
    dsv4.write_kv_v4(k.to(torch.bfloat16), dsv4.paged_view(buffer, rows), slots.to(torch.int64))


@pytest.fixture
def cpu_kit(monkeypatch):
    """SGLang's V4 attention kit made to run on a CPU: the kit writes the caches with Triton and saves the CUDA
    RNG, neither of which runs there. Its packer becomes the identity and the pool's two store methods this
    package's writer (``write_kv_v4``, the bytes SGLang's own writers produce; checked on the H200); the RNG
    calls are no-ops. The backend itself is not patched."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit

    monkeypatch.setattr(kit, "quant_to_nope_fp8_rope_bf16_pack_triton", lambda k: k)

    def set_swa(self, layer_id, swa_loc, cache_nope_fp8_rope_bf16_pack):
        _store(self.get_swa_key_buffer_radix(layer_id), self.get_swa_key_page_size(), swa_loc,
               cache_nope_fp8_rope_bf16_pack)

    def set_extra(self, layer_id, loc, cache_nope_fp8_rope_bf16_pack):
        _store(self.get_extra_key_buffer(layer_id), self.get_extra_key_page_size(layer_id), loc,
               cache_nope_fp8_rope_bf16_pack)

    monkeypatch.setattr(DeepSeekV4TokenToKVPool, "set_swa_key_buffer_radix", set_swa)
    monkeypatch.setattr(DeepSeekV4TokenToKVPool, "set_extra_key_buffer", set_extra)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.empty(0, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)
