"""``musa-attn demo``: a paged batch through the public ops, checked against SDPA.

Builds one ragged batch (requests with cached prefixes, fresh prompts and single-token decodes) with its
pages shuffled through a shared pool, makes the kernel metadata from both SGLang's and vLLM's view of it,
writes the new tokens' K/V with ``write_kv``, runs ``paged_attention`` (TileLang on a GPU, the PyTorch
reference on a CPU) and compares every request with ``scaled_dot_product_attention`` on unpaged tensors.
"""

from __future__ import annotations

import random
import time

import torch

from .kernels import paged_attention, write_kv
from .metadata import PagedKVMeta
from .testing import dense_attention, random_batch
from .testing.numeric import max_error, tolerance


def _sync(device: str) -> None:
    mod = getattr(torch, device, None) if device != "cpu" else None
    if mod is not None:
        mod.synchronize()


def run_demo(*, device: str, dtype: torch.dtype, seed: int = 0, impl: str = "auto", verbose: bool = True) -> bool:
    rng = random.Random(seed)
    hq, hkv, d, page = 32, 8, 128, 16
    tol = tolerance(dtype)  # the kernel bound the tests hold the same comparison to

    def say(msg: str) -> None:
        if verbose:
            print(msg)

    cases = {
        "extend (prefix + new tokens)": dict(prefix_lens=[0, 37, 300, 5], query_lens=[129, 64, 1, 200]),
        "decode (one token each)": dict(decode=True),
    }
    ok = True
    say(f"demo: device={device} dtype={str(dtype).replace('torch.', '')} q_heads={hq} kv_heads={hkv} "
        f"head_dim={d} page_size={page} impl={impl}")
    for name, spec in cases.items():
        batch = random_batch(rng, batch_size=8 if spec.get("decode") else 4, page_size=page, max_seq_len=512,
                             device=device, **spec)
        meta_s = PagedKVMeta.from_sglang(**batch.sglang_view())
        meta_v = PagedKVMeta.from_vllm(**batch.vllm_view())
        same = all(torch.equal(t, getattr(meta_v, n)) for n, t in meta_s.tensors().items())
        # Fill the cache with the prefixes, then write the new tokens as an engine would.
        k_cache, v_cache, ks, vs = batch.make_kv(hkv, d, dtype)
        new_k = torch.cat([k[p:] for k, p in zip(ks, batch.prefix_lens)])
        new_v = torch.cat([v[p:] for v, p in zip(vs, batch.prefix_lens)])
        k_cache.view(-1, hkv, d)[meta_v.slot_mapping] = float("nan")  # poison: write_kv must fill these
        v_cache.view(-1, hkv, d)[meta_v.slot_mapping] = float("nan")
        write_kv(new_k, new_v, k_cache, v_cache, meta_v.slot_mapping, impl=impl)
        q = torch.randn(batch.num_tokens, hq, d, device=device).to(dtype)
        paged_attention(q, k_cache, v_cache, meta_s, impl=impl)  # warm-up (compiles on a GPU)
        _sync(device)
        t0 = time.perf_counter()
        out = paged_attention(q, k_cache, v_cache, meta_s, impl=impl)
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3
        err, cu = 0.0, 0
        for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.query_lens)):
            ref = dense_attention(q[cu: cu + n], ks[b], vs[b], prefix_len=p, causal=True, sm_scale=d ** -0.5)
            err = max(err, max_error(out[cu: cu + n], ref))
            cu += n
        good = same and err <= tol and bool(torch.isfinite(out.float()).all())
        ok &= good
        say(f"  {name:30s} requests={batch.batch_size} tokens={batch.num_tokens:4d} "
            f"kv_tokens={sum(batch.seq_lens):5d} views_identical={same} max_error={err:.2e} "
            f"(tol {tol:.0e}) time={ms:.2f} ms  {'OK' if good else 'FAIL'}")
    say("demo: " + ("all checks passed" if ok else "FAILED"))
    return ok
