"""vLLM 0.33 ``TILELANG_MUSA``: registration (incl. fork/spawn workers) and builder + impl on CPU vs SDPA,
following vLLM's own backend-test pattern (mixed decode/prefill/extend batch, shuffled blocks, NHD cache)."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from musa_attn_backend.testing import dense_attention, random_batch  # noqa: E402

REGISTER = """
from vllm.plugins import load_general_plugins
load_general_plugins()
"""


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_selection_survives_fork_and_spawn_workers(method, tmp_path):
    """The parent selects tilelang_musa; a worker started with ``method`` unpickles the config (before any
    plugin loads there) and gets the same backend class."""
    # Plugins load only in the parent (inside the main guard): a spawned child re-imports this file as
    # __mp_main__ and must unpickle the config without having loaded any plugin, as vLLM's workers do.
    code = f"""
import multiprocessing as mp

def worker(cfg, q):
    q.put((cfg.backend.name, cfg.backend.get_class().__name__))

if __name__ == "__main__":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config.attention import AttentionConfig
    cfg = AttentionConfig(backend="tilelang_musa")
    ctx = mp.get_context("{method}")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(cfg, q))
    p.start()
    print("RESULT", q.get(timeout=240))
    p.join(60)
    assert p.exitcode == 0, p.exitcode
"""
    # spawn re-imports __main__, so the parent runs from a file
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(code))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "RESULT ('TILELANG_MUSA', 'TileLangMusaBackend')" in res.stdout, res.stdout[-1500:] + res.stderr[-3000:]


def test_names_resolve_after_plugin_load():
    res = _run(REGISTER + """
from vllm.config.attention import AttentionConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
for name in ("tilelang_musa", "TILELANG_MUSA"):
    assert AttentionConfig(backend=name).backend is AttentionBackendEnum.TILELANG_MUSA
cls = AttentionBackendEnum.TILELANG_MUSA.get_class()
import torch
ok = cls.validate_configuration(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
    use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
    device_capability=None, attn_type="decoder")
bad = cls.validate_configuration(head_size=72, dtype=torch.int8, kv_cache_dtype="fp8_e5m2", block_size=16,
    use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
    device_capability=None, attn_type="decoder")
print("OK", ok, len(bad))
""")
    assert "OK [] " in res.stdout, res.stdout[-1500:] + res.stderr[-3000:]
    assert int(res.stdout.split("OK [] ")[1].split()[0]) >= 3  # head size, dtype, kv dtype, MLA refused


def _common_metadata(batch, device="cpu"):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    v = batch.vllm_view()
    return CommonAttentionMetadata(
        query_start_loc=v["query_start_loc"], query_start_loc_cpu=v["query_start_loc"].cpu(),
        seq_lens=v["seq_lens"], num_reqs=batch.batch_size, num_actual_tokens=batch.num_tokens,
        max_query_len=max(batch.query_lens), max_seq_len=max(batch.seq_lens), block_table_tensor=v["block_table"],
        slot_mapping=v["slot_mapping"], causal=True, seq_lens_cpu_upper_bound=v["seq_lens"].cpu())


def _builder_impl_vs_reference(hq, hkv, block, opts, *, device="cpu", dtype=torch.float32, d=64, tol=1e-4,
                               query_lens=(1, 1, 1, 37, 20), prefix_lens=(30, 77, 5, 0, 44), max_seq_len=120):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    rng = random.Random(hq * 100 + block)
    # decodes first (vLLM reorders them to the front), then a fresh prefill and an extend with a prefix
    batch = random_batch(rng, batch_size=len(query_lens), page_size=block, max_seq_len=max_seq_len,
                         query_lens=list(query_lens), prefix_lens=list(prefix_lens), device=device)
    vllm_config = VllmConfig()
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=d, dtype=dtype)
    builder = TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], vllm_config, torch.device(device))
    md = builder.build(0, _common_metadata(batch, device))
    sinks = torch.randn(hq, device=device) if opts.get("sinks") else None
    window = opts.get("sliding_window")
    with set_current_vllm_config(vllm_config):
        impl = TileLangMusaBackend.get_impl_cls()(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv,
                                                  alibi_slopes=None, sliding_window=window, kv_cache_dtype="auto",
                                                  logits_soft_cap=opts.get("logits_soft_cap"), sinks=sinks)
    # vLLM's NHD storage [blocks, block, H, 2D], seen logically as [blocks, H, block, 2D]. Blocks no request
    # owns are NaN; owned blocks start as large finite junk (vLLM zero-allocates its cache and reuses slots,
    # so slots past a sequence end hold stale finite values, which whole-block loads read and mask).
    kv_cache = (1000 * torch.randn((batch.num_pages, block, hkv, 2 * d), device=device)).to(dtype)
    owned = torch.zeros(batch.num_pages, dtype=torch.bool)
    owned[[p for pages in batch.pages for p in pages]] = True
    kv_cache[~owned.to(device)] = float("nan")
    kv_cache = kv_cache.permute(0, 2, 1, 3)
    _, _, ks, vs = batch.make_kv(hkv, d, dtype)
    layer = type("L", (), {})()
    # the cached prefixes, written by the backend's own writer
    prefix_slots = torch.tensor([batch.slot(b, p) for b, n in enumerate(batch.prefix_lens) for p in range(n)],
                                device=device)
    impl.do_kv_cache_update(layer, torch.cat([k[:p] for k, p in zip(ks, batch.prefix_lens)]),
                            torch.cat([v[:p] for v, p in zip(vs, batch.prefix_lens)]), kv_cache, prefix_slots)
    key = torch.cat([k[p:] for k, p in zip(ks, batch.prefix_lens)])
    value = torch.cat([v[p:] for v, p in zip(vs, batch.prefix_lens)])
    impl.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
    query = torch.randn(batch.num_tokens, hq, d, device=device).to(dtype)
    output = torch.full((batch.num_tokens, hq, d), float("nan"), dtype=dtype, device=device)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    assert not output.isnan().any(), "unwritten output rows"
    assert impl.forward(layer, query, key, value, kv_cache, None, output.clone()).abs().sum() == 0  # profiling
    cu = 0
    for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
        ref = dense_attention(query[cu: cu + n].float(), ks[b].float(), vs[b].float(), prefix_len=p, causal=True,
                              sm_scale=d ** -0.5, sliding_window=window - 1 if window else None)
        if opts.get("logits_soft_cap") or sinks is not None:  # SDPA has neither: the reference op is the truth
            from musa_attn_backend.kernels import paged_attention

            ref = paged_attention(query, kv_cache.transpose(1, 2).split(d, -1)[0],
                                  kv_cache.transpose(1, 2).split(d, -1)[1], md.meta, sm_scale=d ** -0.5,
                                  logit_softcap=opts.get("logits_soft_cap"), sinks=sinks,
                                  impl="reference")[cu: cu + n].float()
        torch.testing.assert_close(output[cu: cu + n].float(), ref, atol=tol, rtol=tol)
        cu += n


@pytest.mark.parametrize("hq,hkv,block", [(8, 2, 16), (4, 4, 32), (8, 1, 1)])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 24}, {"logits_soft_cap": 20.0}, {"sinks": True}])
def test_builder_and_impl_match_sdpa_on_mixed_batch(hq, hkv, block, opts):
    _builder_impl_vs_reference(hq, hkv, block, opts)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,block", [(32, 8, 16), (32, 8, 128), (8, 1, 64), (16, 16, 1)])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 100}, {"logits_soft_cap": 30.0}, {"sinks": True}])
def test_builder_and_impl_on_gpu_run_tilelang(gpu_device, hq, hkv, block, opts, monkeypatch):
    """vLLM's real builder/impl classes on the GPU: the TileLang kernels (KV write, decode, prefill incl. the
    whole-page copy path at block 128) on a mixed batch with long prefixes, bf16, vs float32 math."""
    from musa_attn_backend.kernels.attention import tilelang_impl

    monkeypatch.setattr(tilelang_impl, "POISON", True)
    calls = []
    real = tilelang_impl.paged_attention_tilelang
    monkeypatch.setattr(tilelang_impl, "paged_attention_tilelang", lambda *a, **k: calls.append(1) or real(*a, **k))
    _builder_impl_vs_reference(hq, hkv, block, opts, device=gpu_device, dtype=torch.bfloat16, d=128, tol=2e-2,
                               query_lens=(1, 1, 1, 1, 300, 129), prefix_lens=(900, 77, 5, 2000, 0, 700),
                               max_seq_len=2200)
    assert calls, "the TileLang path did not run"


def test_impl_refuses_unsupported():
    from musa_attn_backend.vllm.backend import TileLangMusaImpl

    with pytest.raises(ValueError, match="ALiBi"):
        TileLangMusaImpl(4, 64, 0.1, 4, alibi_slopes=[1.0] * 4)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TileLangMusaImpl(4, 64, 0.1, 4, kv_cache_dtype="int8_per_token_head")


def test_spawn_trap_is_real_without_our_reduce(tmp_path):
    """Control: with our by-reference pickling removed, a spawned worker cannot unpickle the member."""
    code = """
import multiprocessing as mp

def worker(cfg, q):
    q.put(cfg.backend.name)

if __name__ == "__main__":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    del AttentionBackendEnum.TILELANG_MUSA.__dict__["__reduce_ex__"]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(AttentionConfig(backend="tilelang_musa"), q))
    p.start()
    p.join(120)
    print("EXIT", p.exitcode)
"""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(code))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "EXIT 1" in res.stdout and "is not a valid AttentionBackendEnum" in res.stderr, \
        res.stdout[-1000:] + res.stderr[-2000:]
