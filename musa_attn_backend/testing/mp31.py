"""Every program the launchers build for MUSA MP31 across a set of reference plans, with MP31's lowering rules
(:func:`musa_attn_backend.kernels._tir.violations`) on each: what CI checks (``tests/tools/test_mp31_rules.py``)
and what the README's per-family table says (``scripts/update_readme.py``).

The programs are collected by intercepting ``compile_cached`` while the warmup plans are built under the MUSA
target (so the launchers' own choice for MUSA is what is checked): the dense plans of a matrix of models, engines,
page sizes, FP8 caches, windows and speculative lengths, with every prefill tiling the tuner may pick; the
DeepSeek-V4 plans of V4-Flash and V4-Pro for both engines, at tensor-parallel sizes 1 and 8, with FP8 and FP4
experts routed to our MoE; and every MoE form (layouts, weight formats, packings, fused epilogues) at both
models' expert shapes.
"""

from __future__ import annotations

import functools
from typing import Optional

from .. import _tilelang, config, platform, warmup, warmup_dsv4
from ..kernels._tir import RULES, violations
from .dsv4_configs import CONFIGS

# (q heads, kv heads, head dim, v head dim, window, softcap, sinks): GQA 8/2/4, MHA, MQA; head dims 64-256
DENSE_MODELS = [
    (32, 8, 128, 128, False, False, False),
    (8, 8, 64, 64, True, False, True),
    (16, 1, 256, 256, False, True, False),
    (16, 4, 192, 128, False, False, False),
    (64, 8, 64, 64, True, False, True),  # gpt-oss-like: sinks, windows, 8 heads a KV head
]
DENSE_PAGES = [("sglang", 1), ("sglang", 64), ("vllm", 16), ("vllm", 128), ("sglang", 256)]

# key prefix -> family (first match)
FAMILIES = [
    ("('prefill'", "dense attention"), ("('decode'", "dense attention"), ("('combine'", "dense attention"),
    ("('write_kv'", "dense attention"),
    ("('dsv4_sparse_mqa", "V4 sparse attention"), ("('dsv4_combine'", "V4 sparse attention"),
    ("('dsv4_sparse_combine'", "V4 sparse attention"),
    ("('dsv4_write", "V4 cache writers"),
    ("('dsv4_indexer", "V4 indexer and top-k"), ("('dsv4_paged_indexer", "V4 indexer and top-k"),
    ("('dsv4_compress", "V4 compressors"), ("('dsv4_save_state'", "V4 compressors"),
    ("('dsv4_", "V4 model-side kernels and slots"),
    ("('moe_fp", "MoE grouped GEMMs"), ("('moe_", "MoE glue"),
]


def family(key: str) -> str:
    return next((name for prefix, name in FAMILIES if key.startswith(prefix)), "other")


def _collector(programs: dict):
    def capture(key, build, tgt, pass_configs):
        if repr(key) not in programs:
            programs[repr(key)] = (build(), tgt)
    return capture


def dense_programs(target: str = "mp_31", shared_p: bool = False) -> dict:
    """``{key: (prim_func, compile target)}`` of every dense attention kernel the launchers build for ``target``."""
    from ..kernels.attention import tilelang_impl as ti

    programs: dict = {}
    with config.override(target=target, shared_p=shared_p), _tilelang.intercepting(_collector(programs)):
        for hq, hkv, d, dv, window, softcap, sinks in DENSE_MODELS:
            model = warmup.ModelAttention(hq, hkv, d, dv, has_window=window, has_softcap=softcap, has_sinks=sinks)
            for kv in (None, "fp8"):
                for engine, page in DENSE_PAGES:
                    for spec_tokens in (0, 1, 3, 7):  # decode tilings for 1, 2, 4 and 8 tokens a request
                        for job in warmup.plan(model, engine=engine, kv_dtype=kv, speculative_tokens=spec_tokens,
                                               page_size=page):
                            warmup._build(job)
                    # every prefill tiling the tuner may record, causal or not, for each window choice
                    for job in warmup.plan(model, engine=engine, kv_dtype=kv, page_size=page):
                        if job.kind != "prefill" or len(job.args) > 3:
                            continue
                        spec = job.args[0]
                        for cfg in ti.prefill_candidates(d, dv, spec.is_fp8, page, spec.has_window):
                            for causal in (True, False):
                                ti.prefill_kernel(spec, causal, page, cfg=cfg)
    return programs


def v4_programs(target: str = "mp_31") -> dict:
    """Every kernel of the DeepSeek-V4 plans (V4-Flash, V4-Pro; both engines; TP 1 and 8; FP8 and FP4 experts on
    our MoE) built for ``target``."""
    programs: dict = {}
    with config.override(target=target, moe="on"), _tilelang.intercepting(_collector(programs)):
        kind = platform.get_platform().target_kind
        for cfg in CONFIGS.values():
            for tp in (1, 8):
                model = warmup_dsv4.from_hf_config(cfg, tp=tp)
                for engine in warmup_dsv4.ENGINES:
                    for experts in warmup_dsv4.EXPERT_FORMATS:
                        for job in warmup_dsv4.plan(model, engine=engine, experts=experts, target_kind=kind):
                            warmup._build(job)
    return programs


def moe_programs(target: str = "mp_31") -> dict:
    """Every MoE form at V4-Flash's and V4-Pro's expert shapes: FP8 contiguous (both stage counts), masked, both
    fused SwiGLU epilogues; FP4 masked and contiguous in each packing, with UE8M0 and float32 scales; the glue."""
    from ..kernels.moe import tilelang_impl as mi

    programs: dict = {}
    with config.override(target=target), _tilelang.intercepting(_collector(programs)):
        for cfg in CONFIGS.values():
            H, I, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
            limit = cfg.get("swiglu_limit")
            for N, K in ((2 * I, H), (H, I)):
                mi.contiguous_kernel(N, K)
                mi.contiguous_kernel(N, K, num_stages=mi.LARGE_M_STAGES[1])
                mi.masked_kernel(N, K)
                for scales in ({}, {"scale_dtype": "float32"}):
                    for packing in mi.FP4_PACKINGS:
                        mi.masked_fp4_kernel(N, K, packing=packing, **scales)
                        mi.contiguous_fp4_kernel(N, K, packing=packing, **scales)
            mi.contiguous_swiglu_kernel(I, H, limit)
            mi.masked_swiglu_kernel(I, H, limit)
            mi.swiglu_quant_kernel(I, limit)
            mi.combine_kernel(H, k)
            mi.quantize_scatter_kernel(H, k)
            for has_map in (False, True):
                mi.route_masked_kernel(cfg["n_routed_experts"], k, "int32", "float32", has_map)
    return programs


@functools.lru_cache(maxsize=None)
def programs(target: str = "mp_31") -> dict:
    """``{key: (prim_func, compile target)}`` of every program of the reference plans on ``target`` (cached per
    process: building them takes about a minute)."""
    return {**dense_programs(target), **v4_programs(target), **moe_programs(target)}


@functools.lru_cache(maxsize=None)
def checked(target: str = "mp_31") -> tuple:
    """``((key, family, [violations]) ...)`` for every program of the reference plans on ``target``."""
    programs_ = programs(target)
    with config.override(target=target):
        flags = platform.features_of(None)
    return tuple((key, family(key), violations(func, flags)) for key, (func, _) in programs_.items())


def markdown_table(target: str = "mp_31", rows: Optional[tuple] = None) -> str:
    """The README's table: per family, the programs of the reference plans checked for ``target`` and how many
    keep every rule."""
    rows = rows if rows is not None else checked(target)
    order = list(dict.fromkeys(name for _, name in FAMILIES))
    counts = {name: [0, 0] for name in order}
    for _, fam, bad in rows:
        counts.setdefault(fam, [0, 0])
        counts[fam][0] += 1
        counts[fam][1] += not bad
    rules = "; ".join(f"`{flag}`: {what}" for flag, (what, _) in RULES.items())
    lines = ["| family | programs checked | within every rule |", "|---|---|---|"]
    lines += [f"| {name} | {n} | {ok} |" for name, (n, ok) in counts.items() if n]
    total, good = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
    lines.append(f"| all | {total} | {good} |")
    return "\n".join(lines) + f"\n\nThe rules, each the absence of a `platform.py` flag on {target}: {rules}."
