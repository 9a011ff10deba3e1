"""``musa-attn tune``: pick the prefill tiling per shape class on this GPU and record it in the tuning table.

Every candidate of :func:`tilelang_impl.prefill_candidates` is first run on a ragged extend batch (cached
prefixes, shuffled pages, NaN in unowned slots) and compared with the reference op; only correct candidates
are timed, on one long sequence (CUDA/MUSA events, median). The fastest goes into the table that
:func:`tilelang_impl.prefill_config` reads (:mod:`musa_attn_backend.tuning`).
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Callable, Optional

import torch

from . import tuning
from .metadata import PagedKVMeta
from .platform import get_platform
from .testing import random_batch
from .testing.numeric import max_error, tolerance
from .kernels.attention import tilelang_impl as impl
from .kernels.attention.reference import paged_attention_reference


def _events(device: torch.device):
    mod = getattr(torch, device.type)  # torch.cuda / torch.musa
    return mod, (lambda: mod.Event(enable_timing=True))


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, rep: int = 10) -> float:
    """Median time of ``fn`` in ms with device events."""
    mod, event = _events(device)
    for _ in range(warmup):
        fn()
    mod.synchronize()
    times = []
    for _ in range(rep):
        a, b = event(), event()
        a.record()
        fn()
        b.record()
        mod.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def tune_prefill(hq: int, hkv: int, d: int, dv: Optional[int] = None, *, dtype: torch.dtype = torch.bfloat16,
                 fp8_kv: bool = False, page_size: int = 1, sliding_window: Optional[int] = None,
                 softcap: Optional[float] = None, sinks: bool = False, seqlen: int = 8192, causal: bool = True,
                 record: bool = True, log: Callable[[str], None] = print) -> dict:
    """Tune the prefill tiling of one shape class; returns ``{"key", "best", "ms", "rows", "table"}``."""
    dv = dv or d
    platform = get_platform()
    if not platform.has_gpu:
        raise RuntimeError("musa-attn tune needs a GPU (the candidates are timed on it)")
    device = torch.device(platform.torch_device)
    key = impl.prefill_shape_class(d, dv, fp8_kv, page_size, sliding_window is not None)
    candidates = impl.prefill_candidates(d, dv, fp8_kv, page_size, sliding_window is not None)
    sink_t = torch.randn(hq, device=device) if sinks else None
    opts = dict(causal=causal, sliding_window=sliding_window, logit_softcap=softcap, sinks=sink_t)

    def caches(batch):
        k, v, _, _ = batch.make_kv(hkv, d, dtype, head_dim_v=dv)
        if not fp8_kv:
            return k, v, {}
        scale = 0.02
        return ((k.float() / scale).to(torch.float8_e4m3fn), (v.float() / scale).to(torch.float8_e4m3fn),
                dict(k_scale=scale, v_scale=scale))

    rng = random.Random(0)
    small = random_batch(rng, batch_size=4, page_size=page_size, max_seq_len=900, max_query_len=300, device=device)
    kc, vc, scales = caches(small)
    q_small = torch.randn(small.num_tokens, hq, d, device=device).to(dtype)
    meta_small = small.meta()
    ref = paged_attention_reference(q_small, kc, vc, meta_small, **opts, **scales).float()

    big = random_batch(rng, batch_size=1, page_size=page_size, max_seq_len=seqlen, query_lens=[seqlen],
                       prefix_lens=[0], device=device)
    kb, vb, scales_b = caches(big)
    q_big = torch.randn(seqlen, hq, d, device=device).to(dtype)
    meta_big: PagedKVMeta = big.meta()

    def check(cfg_dict):
        cfg = impl.PrefillConfig(**cfg_dict)
        out = impl.paged_attention_tilelang(q_small, kc, vc, meta_small, prefill_cfg=cfg, **opts, **scales).float()
        if not torch.isfinite(out).all():
            return "non-finite output"
        # the tests' criterion and bound: max |out - ref| / (1 + |ref|) within the kernel table's tolerance
        err = max_error(out, ref)
        tol = tolerance(dtype, fp8_kv=fp8_kv)
        return None if err <= tol else f"max error {err:.3g} > {tol:g}"

    def timed(cfg_dict):
        cfg = impl.PrefillConfig(**cfg_dict)
        return time_ms(lambda: impl.paged_attention_tilelang(q_big, kb, vb, meta_big, prefill_cfg=cfg, **opts,
                                                             **scales_b), device)

    log(f"tune prefill {key} on {platform.device_name}: {len(candidates)} candidates, {seqlen} tokens")
    best, ms, rows = tuning.search([asdict(c) for c in candidates], check, timed, log=log)
    result = {"key": key, "best": best, "ms": ms if best else None, "rows": rows, "table": None}
    if best and record:
        result["table"] = str(tuning.record("prefill", key, best, ms, details={"seqlen": seqlen, "causal": causal,
                                                                              "heads": [hq, hkv]}))
    return result
