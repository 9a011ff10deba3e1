"""The launchers pass the TileLang kernels what their signatures declare (checked on a CPU, no GPU).

``compile_cached`` is replaced by a stub that builds the real ``@T.prim_func`` and, instead of running it,
checks every argument against the parameter it binds to: tensors by rank and dtype, scalars by kind, and
named dims (heads, head dims) by size.
"""

import random

import pytest
import torch

from musa_attn_backend.kernels.attention import tilelang_impl as attn_impl
from musa_attn_backend.kernels.kv_cache import tilelang_impl as kv_impl
from musa_attn_backend.testing import random_batch

TL = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
      "int64": torch.int64, "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}


class Recorder:
    def __init__(self):
        self.calls = []

    def compile_cached(self, key, build, **kw):
        func = build()

        def run(*args):
            params = list(func.params)
            assert len(args) == len(params), f"{func.attrs['global_symbol'] if func.attrs else key}: " \
                                             f"{len(args)} args for {len(params)} params"
            for arg, param in zip(args, params):
                buf = func.buffer_map.get(param)
                if buf is None:
                    assert isinstance(arg, (int, float)) and not isinstance(arg, bool), (param.name, arg)
                    assert ("int" in str(param.dtype)) == isinstance(arg, int), (param.name, param.dtype, arg)
                    continue
                assert isinstance(arg, torch.Tensor), (buf.name, type(arg))
                assert arg.dim() == len(buf.shape), (buf.name, arg.shape, buf.shape)
                assert arg.dtype == TL[str(buf.dtype)], (buf.name, arg.dtype, buf.dtype)
                for size, dim in zip(arg.shape, buf.shape):
                    if hasattr(dim, "value"):  # a compile-time dim must match exactly
                        assert size == dim.value, (buf.name, tuple(arg.shape), buf.shape)
            self.calls.append(key[0])

        return run


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(attn_impl, "compile_cached", r.compile_cached)
    monkeypatch.setattr(kv_impl, "compile_cached", r.compile_cached)
    return r


def _case(decode, batch_size, max_len, hq=8, hkv=2, d=64, fp8=False, **opts):
    b = random_batch(random.Random(0), batch_size=batch_size, page_size=16, max_seq_len=max_len, decode=decode,
                     max_query_len=40)
    kc, vc, _, _ = b.make_kv(hkv, d, torch.bfloat16)
    if fp8:
        kc, vc = kc.nan_to_num(0).to(torch.float8_e4m3fn), vc.nan_to_num(0).to(torch.float8_e4m3fn)
        opts.update(k_scale=0.5, v_scale=torch.ones(hkv))
    q = torch.randn(b.num_tokens, hq, d).bfloat16()
    return q, kc, vc, b.meta(), opts


@pytest.mark.parametrize("decode,batch_size,max_len,expect", [
    (False, 3, 100, ["prefill"]),
    (True, 64, 100, ["decode"]),  # enough blocks: no split
    (True, 1, 4000, ["decode", "combine"]),  # split-KV + combine
])
@pytest.mark.parametrize("fp8", [False, True])
def test_attention_launch_matches_signatures(rec, decode, batch_size, max_len, expect, fp8):
    q, kc, vc, meta, opts = _case(decode, batch_size, max_len, fp8=fp8)
    sinks = torch.randn(q.shape[1])
    out, lse = attn_impl.paged_attention_tilelang(q, kc, vc, meta, sliding_window=16, logit_softcap=5.0,
                                                  sinks=sinks, return_lse=True, **opts)
    assert rec.calls == expect
    assert out.shape == q.shape and lse.shape == q.shape[:2]


def test_non_causal_decode_shape_uses_prefill(rec):
    q, kc, vc, meta, opts = _case(True, 4, 100)
    attn_impl.paged_attention_tilelang(q, kc, vc, meta, causal=False)
    assert rec.calls == ["prefill"]


def test_write_kv_launch_matches_signature(rec):
    buf = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)  # vLLM NHD: [blocks, block, heads, 2D]
    kc, vc = buf.split(64, dim=-1)
    k = torch.randn(5, 2, 64).bfloat16()
    kv_impl.write_kv_tilelang(k, k, kc, vc, torch.arange(5))
    kv_impl.write_kv_tilelang(k, k, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), torch.arange(5),
                              k_scale=0.5, v_scale=0.25)
    assert rec.calls == ["write_kv", "write_kv"]


def test_split_count_heuristic():
    f = attn_impl.num_splits_for
    h200 = dict(block_N=64, sm_count=132, ctas_per_sm=3)  # 396 resident blocks (the tune-decode run)
    # the split counts an H200 sweep measured best (docs/kernel-choice.md: the wave model)
    assert f(batch=64, num_kv_heads=8, max_seqlen_k=4096, **h200) == 3  # 512 blocks = 1.29 waves -> 3.88
    assert f(batch=32, num_kv_heads=8, max_seqlen_k=16384, **h200) == 3
    assert f(batch=8, num_kv_heads=8, max_seqlen_k=32768, **h200) == 6
    assert f(batch=256, num_kv_heads=8, max_seqlen_k=32768, **h200) == 2
    assert f(batch=1, num_kv_heads=8, max_seqlen_k=4096, **h200) == 32
    assert f(batch=48, num_kv_heads=8, max_seqlen_k=32768, **h200) == 1  # 384 blocks: one full wave already
    assert f(batch=1, num_kv_heads=8, max_seqlen_k=128, **h200) == 1  # 2 tiles: each split keeps >= 2
    for b in (1, 3, 17, 100):
        for sk in (1, 64, 1000, 10**6):
            s = f(batch=b, num_kv_heads=2, max_seqlen_k=sk, block_N=64, sm_count=132)
            assert s == 1 or (s in attn_impl.SPLIT_COUNTS and s <= attn_impl.MAX_SPLITS and s <= -(-sk // 64) // 2)


def test_decode_blocks_per_sm_estimate():
    est = attn_impl.decode_ctas_per_sm
    cfg = attn_impl.decode_config(1, 4)  # 16-row tile, 64-key tiles, 2 stages: ~72 KiB of shared memory
    assert est(cfg, 128, 128, False, 228 * 1024) == 3
    assert est(cfg, 128, 128, False, 100 * 1024) == 1
    assert est(attn_impl.decode_config(8, 16), 128, 128, False, 228 * 1024) == 1  # 128 rows, 256 threads
    # FP8: one stage of fp8 tiles + the converted bf16 tiles, ~60 KB as TileLang lays it out: 3, not 4
    assert est(attn_impl.decode_config(1, 4, True), 128, 128, True, 228 * 1024) == 3


def test_decode_tiling_choice():
    c = attn_impl.decode_config
    assert c(1, 4).block_M == 16 and c(1, 16).block_M == 16
    assert c(2, 16).block_M == 64 and c(8, 8).block_M == 64 and c(8, 16).block_M == 128
    assert c(8, 32) is None and c(9, 1) is None  # too many rows / too long: prefill kernel
    assert c(3, 4).max_q == 4  # padded to a power of two


def test_unsupported_cache_layouts_are_refused_before_launch(rec):
    q, kc, vc, meta, _ = _case(False, 2, 50)
    hnd = torch.zeros(kc.shape[0], kc.shape[2], 16, 2 * kc.shape[3], dtype=torch.bfloat16)  # [blocks, H, N, 2D]
    k_hnd, v_hnd = hnd.transpose(1, 2).split(kc.shape[3], dim=-1)
    with pytest.raises(ValueError, match="layout not supported"):
        attn_impl.paged_attention_tilelang(q, k_hnd, v_hnd, meta)
    odd = torch.zeros(kc.shape[0], 16, kc.shape[2], kc.shape[3] + 4, dtype=torch.bfloat16)[..., : kc.shape[3]]
    with pytest.raises(ValueError, match="multiples of 8"):
        attn_impl.paged_attention_tilelang(q, odd, odd, meta)
    with pytest.raises(ValueError, match="multiple of 16"):
        attn_impl.paged_attention_tilelang(q[..., :40], kc[..., :40], vc[..., :40], meta)
    assert rec.calls == []  # nothing was compiled or launched


def test_forced_prefill_tiling_must_be_valid(rec, use_settings):
    """``prefill_cfg`` (the tuner's override) is checked against the tilings valid for the batch: whole-tile
    copies on 16-token pages would read the wrong rows."""
    use_settings(target="sm_90a")
    q, kc, vc, meta, _ = _case(False, 2, 50)
    tma = attn_impl.PrefillConfig(block_M=128, block_N=128, num_stages=2, threads=256, tma=True)
    with pytest.raises(ValueError, match="prefill_cfg .* is not valid .* page size 16"):
        attn_impl.paged_attention_tilelang(q, kc, vc, meta, prefill_cfg=tma)
    assert rec.calls == []
    attn_impl.paged_attention_tilelang(q, kc, vc, meta, prefill_cfg=attn_impl.prefill_candidates(64, 64, False, 16)[0])
    assert rec.calls == ["prefill"]


@pytest.mark.parametrize("max_len,expect", [(100, ["decode", "prefill"]), (4000, ["decode", "combine", "prefill"])])
def test_mixed_split_launches_match_signatures(rec, use_settings, max_len, expect):
    """The two launches of a split mixed batch (MUSA_ATTN_SPLIT_MIXED) against the real kernel signatures."""
    import dataclasses

    use_settings(split_mixed=True)
    b = random_batch(random.Random(1), batch_size=5, page_size=16, max_seq_len=max_len,
                     query_lens=[1, 1, 1, 30, 12])
    kc, vc, _, _ = b.make_kv(2, 64, torch.bfloat16)
    q = torch.randn(b.num_tokens, 8, 64).bfloat16()
    attn_impl.paged_attention_tilelang(q, kc, vc, dataclasses.replace(b.meta(), num_decodes=3))
    assert rec.calls == expect


def test_gathers_that_copy_in_two_loops_a_stage_get_one_stage(use_settings):
    """Row gathers whose stage copies K and V in more than one loop (head dims 192 / 128, or 192 cut in two for
    MUSA) are built with one pipeline stage: TileLang 0.1.15 does not generate them pipelined. Equal head dims and
    whole-tile (TMA) copies keep their stages."""
    from musa_attn_backend import _tilelang

    keys = []
    use_settings(target="sm_90a")
    with _tilelang.intercepting(lambda key, build, tgt, pc: keys.append(key)):
        for d, dv in ((192, 128), (128, 128)):
            spec = attn_impl.AttnSpec(16, 4, d, dv, "bfloat16", "bfloat16", k_layout=(4 * d, 4 * d, d),
                                      v_layout=(4 * dv, 4 * dv, dv))
            attn_impl.decode_kernel(spec, attn_impl.decode_config(1, 4), False)
            gather = attn_impl.PrefillConfig(block_M=128, block_N=64, num_stages=2, threads=256)
            attn_impl.prefill_kernel(spec, True, 16, cfg=gather)
            attn_impl.prefill_kernel(spec, True, 64, cfg=attn_impl.PrefillConfig(128, 64, 2, 256, tma=True))
    stages = [k[3].num_stages for k in keys]
    assert stages == [1, 1, 2, 2, 2, 2], stages
