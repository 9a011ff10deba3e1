"""The warmup plan of a DeepSeek-V4 model (``musa-attn warmup --model-config <V4 config>``): every TileLang kernel
an engine's V4 path launches for it, as :class:`..warmup.Job` s of the launchers' own kernel getters.

What each engine launches, per rank (``tp``):

- **Attention** (both): the sparse MQA program (:mod:`.kernels.dsv4.sparse.tilelang_impl`) for the heads the engine hands
  it (SGLang pads a rank's heads to 64 under attention tensor parallelism, as FlashMLA wants; vLLM does not), with
  the sink, once with and once without the compressed set (window-only layers take none), unsplit and, where a
  token's index tiles can reach the split threshold (window plus compressed set, :func:`num_splits_for`), split
  with its combine. Decode, prefill and MTP verify take the same programs (a query token is a token).
- **Cache writers**: the SWA / compressed row writer; the indexer-key writer under the engine's scale rule (SGLang
  exact, from float32 rows; vLLM powers of two, from bf16).
- **Compressors**: per compress ratio, the rows and the state save of the main compressor and (ratio 4) of the
  indexer's, in the engine's state layout (SGLang: no APE in the state, Hadamard in the indexer; vLLM: the APE in
  the state, no Hadamard).
- **Indexer** (ratio-4 layers): the FP8 queries, the paged logits (one query row a token: both engines flatten
  MTP tokens), the top-k of ``index_topk`` (SGLang also through the page table).
- **vLLM's layer**: the q norm + RoPE, the K RoPE, the output's inverse RoPE, the slots of each layer kind.
- **SGLang's model-side kernels** on targets where its V4 model takes ours (MUSA: :mod:`.sglang.model_hooks`):
  the K path's norm + RoPE store (also on CUDA: it is part of our backend), q norm + RoPE, RoPE in place (both
  directions), the clamped SwiGLU of the shared and the routed experts, mHC pre (with and without the fused
  norm), post and head.
- **MoE experts** where the engines route them to :mod:`.kernels.moe` (``MUSA_ATTN_MOE``: on, or auto on MUSA):
  the layer's glue (quantise-scatter, SwiGLU + quantisation, combine) and both GEMMs on both layouts (masked up to
  :data:`.kernels.moe.layer.MASKED_MAX_TOKENS` tokens, contiguous above, with each tiling the layout's size
  selects), for the checkpoint's expert format (FP8 block scales, or MXFP4 with UE8M0 or float32 scales).

The plan is checked complete against what the engines' paths ask for: on a CPU, the kernels SGLang's V4 kit cases
and vLLM's V4 layer ask for, traced (``tests/sglang/test_sglang_dsv4_warmup_plan.py``,
``tests/vllm/test_vllm_dsv4_layer.py``); on a GPU, nothing compiles after a warmup
(``tests/dsv4/test_gpu_dsv4_warmup.py``). SGLang's model-side kernels are not driven by those cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .warmup import Job

ENGINES = ("sglang", "vllm")
EXPERT_FORMATS = ("fp8", "fp4")
KV_DTYPES = ("auto", "fp8", "fp8_e4m3")  # V4's caches are FP8 whatever the setting says; others are refused
FP8_KERNEL_HEADS = 64  # the heads SGLang pads a rank's queries to under attention tensor parallelism


def refuse_context_parallel(engine_config, names) -> None:
    """Refuse, naming the setting, DeepSeek-V4 under context parallelism (which our kernels do not serve): any of
    the engine's settings ``names`` on ``engine_config`` (SGLang's server args, vLLM's parallel config) above 1."""
    for name in names:
        if int(getattr(engine_config, name, 1) or 1) > 1:
            raise ValueError(f"tilelang_musa: context parallelism ({name}={getattr(engine_config, name)}) is not "
                             f"supported for DeepSeek-V4")


def is_v4(config: dict) -> bool:
    """Whether a Hugging Face config is a DeepSeek-V4 model's."""
    cfg = config.get("text_config", config)
    arch = " ".join(cfg.get("architectures") or [])
    return str(cfg.get("model_type", "")).startswith("deepseek_v4") or "DeepseekV4" in arch


@dataclass(frozen=True)
class V4Model:
    """What the V4 kernels are specialised on, for one rank."""

    heads: int  # attention heads of the model
    tp: int
    ratios: tuple  # the compress ratios of the layers (0: window only), MTP layers included
    window: int
    index_heads: int
    index_topk: int
    max_positions: int
    hidden: int
    hc_mult: int
    hc_iters: int
    experts: int  # routed experts of the model
    top_k: int
    moe_intermediate: int
    shared_experts: int
    swiglu_limit: Optional[float]

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp


def from_hf_config(config: dict, *, tp: int = 1) -> V4Model:
    """The :class:`V4Model` of a DeepSeek-V4 ``config.json`` on tensor-parallel size ``tp``. Refuses what the V4
    kernels do not take (V4.1's ratios, other head dims), naming it."""
    cfg = config.get("text_config", config)
    if not is_v4(cfg):
        raise ValueError(f"not a DeepSeek-V4 config (model_type {cfg.get('model_type')!r})")
    heads = int(cfg["num_attention_heads"])
    if heads % tp:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tp={tp}")
    if int(cfg.get("head_dim", 512)) != 512 or int(cfg.get("qk_rope_head_dim", 64)) != 64:
        raise ValueError("DeepSeek-V4 heads of 512 dims with 64 RoPE dims are supported; the config has "
                         f"head_dim {cfg.get('head_dim')}, qk_rope_head_dim {cfg.get('qk_rope_head_dim')}")
    ratios = tuple(sorted({int(r) for r in cfg.get("compress_ratios") or [0]}))
    bad = [r for r in ratios if r not in (0, 4, 128)]
    if bad:
        raise ValueError(f"compress ratios {bad} are not supported (V4.1's 1 and 2); V4's 0, 4 and 128 are")
    limit = cfg.get("swiglu_limit")
    return V4Model(
        heads=heads, tp=tp, ratios=ratios, window=int(cfg.get("sliding_window") or cfg.get("window_size") or 128),
        index_heads=int(cfg.get("index_n_heads", 64)), index_topk=int(cfg.get("index_topk", 512)),
        max_positions=int(cfg.get("max_position_embeddings", 65536)), hidden=int(cfg["hidden_size"]),
        hc_mult=int(cfg.get("hc_mult", 4)), hc_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        experts=int(cfg.get("n_routed_experts", 0)), top_k=int(cfg.get("num_experts_per_tok", 0)),
        moe_intermediate=int(cfg.get("moe_intermediate_size", 0)), shared_experts=int(cfg.get("n_shared_experts", 0)),
        swiglu_limit=None if limit is None else float(limit))


def attention_heads(model: V4Model, engine: str) -> int:
    """The heads an engine hands the sparse MQA kernel on one rank: vLLM the rank's own, SGLang the same without
    attention tensor parallelism and 64 (FlashMLA's width; the model's own count past it) with it."""
    local = model.local_heads
    if engine == "vllm" or model.tp == 1:
        return local
    return FP8_KERNEL_HEADS if local <= FP8_KERNEL_HEADS else model.heads


def _index_tiles(model: V4Model, ratio: int, block_n: int) -> int:
    """The most index tiles of ``block_n`` entries a token reads in a layer of ``ratio``: its window, plus the
    indexer's top-k (ratio 4) or every compressed row of the longest context (ratio 128)."""
    extra = model.index_topk if ratio == 4 else math.ceil(model.max_positions / 128) if ratio == 128 else 0
    return math.ceil(model.window / block_n) + math.ceil(extra / block_n)


def _attention(model: V4Model, engine: str) -> list[Job]:
    from .kernels.dsv4.sparse.tilelang_impl import (WORKSPACE_PROGRAMS, _sched_cluster, sparse_mqa_block_n,
                                                     sparse_mqa_program)

    H = attention_heads(model, engine)
    jobs = []
    program = sparse_mqa_program()
    for ratio in model.ratios:
        extra = ratio > 0
        jobs.append(Job("dsv4_sparse_mqa", (H, extra, True, False, "bfloat16")))
        if program == "scheduled":  # one program, split or not, and its combine, launched every time
            jobs.append(Job("dsv4_sparse_combine", (H, True, "bfloat16")))
            if _sched_cluster(H, None):  # the job above built the clustered form, for calls of many tokens;
                # calls of fewer take the unclustered one (tilelang_impl.SCHED_CLUSTER_MIN_TOKENS)
                jobs.append(Job("dsv4_sched", (H, extra, True, "bfloat16"), (("cluster", False),)))
        elif program in WORKSPACE_PROGRAMS:  # one program, never split, and its workspace's gather
            jobs.append(Job("dsv4_workspace_rows", ()))
        elif program == "paired":  # one program, never split
            pass
        elif _index_tiles(model, ratio, sparse_mqa_block_n()) >= 4:  # num_splits_for splits from 4 tiles on
            jobs += [Job("dsv4_sparse_mqa", (H, extra, True, True, "bfloat16")),
                     Job("dsv4_combine", (H, True, "bfloat16"))]
    jobs.append(Job("dsv4_write_kv", ("bfloat16",)))
    return jobs


def _compressors(model: V4Model, engine: str) -> list[Job]:
    from .kernels.dsv4 import layout as L

    sglang = engine == "sglang"
    ape = not sglang  # vLLM keeps the APE in its compressor state
    jobs = []
    for ratio in model.ratios:
        if ratio == 0:
            continue
        coff = 2 if ratio == 4 else 1
        jobs += [Job("dsv4_compress_rows", (L.D, ratio, False, ape, "bfloat16")),
                 Job("dsv4_save_state", (2 * coff * L.D, ratio, ape, False))]
        if ratio == 4:  # the indexer's compressor: SGLang rotates (Hadamard) and keeps float32 rows, exact scales
            jobs += [Job("dsv4_compress_rows", (L.INDEX_D, 4, sglang, ape, "float32" if sglang else "bfloat16")),
                     Job("dsv4_save_state", (2 * coff * L.INDEX_D, 4, ape, False)),
                     Job("dsv4_write_index_k", ("float32",), (("scale_rule", "exact"),)) if sglang
                     else Job("dsv4_write_index_k", ("bfloat16",))]
    return jobs


def _indexer(model: V4Model, engine: str) -> list[Job]:
    if 4 not in model.ratios:
        return []
    H, k = model.index_heads, model.index_topk
    if engine == "sglang":  # q from SGLang's projection (bf16; float32 where its kit feeds it), exact scales
        return ([Job("dsv4_indexer_q", (H, dtype, True, False, False)) for dtype in ("bfloat16", "float32")]
                + [Job("dsv4_paged_indexer_logits", (H, 1, False)),
                   Job("dsv4_indexer_topk", (k, 0)), Job("dsv4_indexer_topk", (k, 256 // 4))])
    return [Job("dsv4_indexer_q", (H, "bfloat16", False, True, True)), Job("dsv4_paged_indexer_logits", (H, 1, True)),
            Job("dsv4_indexer_topk", (k, 0))]


def _vllm_layer(model: V4Model) -> list[Job]:
    from .kernels.dsv4 import layout as L

    H = model.local_heads
    rope = L.D_ROPE
    jobs = [Job("dsv4_norm_rope", (L.D, H, "bfloat16", "bfloat16", "plain", True, False)),
            Job("dsv4_norm_rope", (rope, 1, "bfloat16", "bfloat16", "none", False, False)),
            Job("dsv4_norm_rope", (rope, H, "bfloat16", "bfloat16", "none", False, True))]
    return jobs + [Job("dsv4_attention_slots", (model.window, ratio if ratio else 1)) for ratio in model.ratios]


def _sglang_model_side(model: V4Model, engine_owned_only: bool) -> list[Job]:
    """SGLang's model-side kernels: the K path's store (our backend's, every target) and, unless
    ``engine_owned_only``, those :mod:`.sglang.model_hooks` puts in SGLang's V4 model."""
    from .kernels.dsv4 import layout as L

    bf16 = "bfloat16"
    jobs = [Job("dsv4_norm_rope", (L.D, 1, bf16, bf16, "weight", False, False))]
    if engine_owned_only:
        return jobs
    heads = sorted({model.local_heads, attention_heads(model, "sglang")})
    for h in heads:
        jobs += [Job("dsv4_norm_rope", (L.D, h, bf16, bf16, "plain", True, False)),
                 Job("dsv4_norm_rope", (L.D_ROPE, h, bf16, bf16, "none", False, True)),
                 Job("dsv4_norm_rope", (L.D_ROPE, h, bf16, bf16, "none", False, False))]
    jobs += [Job("dsv4_norm_rope", (L.D_ROPE, 1, bf16, bf16, "none", False, inverse)) for inverse in (False, True)]
    jobs.append(Job("dsv4_norm_rope", (L.D, 1, bf16, bf16, "weight", True, False)))
    widths = {model.moe_intermediate * model.shared_experts // model.tp, model.moe_intermediate}
    jobs += [Job("dsv4_silu_mul_clamp", (i, bf16)) for i in sorted(w for w in widths if w > 0)]
    n, H = model.hc_mult, model.hidden
    jobs += [Job("dsv4_mhc_pre", (n, H, model.hc_iters, False, norm, bf16)) for norm in (False, True)]
    jobs += [Job("dsv4_mhc_post", (n, H, bf16)), Job("dsv4_mhc_pre", (n, H, 1, True, False, bf16))]
    return jobs


def _moe(model: V4Model, experts: str, ep: int = 1) -> list[Job]:
    """The kernels of :func:`.kernels.moe.fused_experts` for the model's experts on one rank."""
    from .kernels.moe import tilelang_impl as mi
    from .kernels.moe.layer import MASKED_MAX_TOKENS
    from .kernels.moe.reference import ALIGN

    if not model.experts or not model.top_k:
        return []
    H, I, k = model.hidden, model.moe_intermediate, model.top_k
    E = max(1, model.experts // ep)
    jobs = [Job("moe_quantize_scatter", (H, k)), Job("moe_swiglu_quant", (I, model.swiglu_limit)),
            Job("moe_combine", (H, k))]
    gemms = ((2 * I, H), (H, I))
    if experts == "fp8":
        for N, K in gemms:
            jobs.append(Job("moe_fp8_masked", (N, K)))
            jobs.append(Job("moe_fp8_contiguous", (N, K)))
            if mi.LARGE_M_STAGES is not None:  # layouts of LARGE_M_STAGES' rows and more (long prefills)
                jobs.append(Job("moe_fp8_contiguous", (N, K), (("num_stages", mi.LARGE_M_STAGES[1]),)))
        return jobs
    for scales in ({}, {"scale_dtype": "float32"}):  # UE8M0 bytes (vLLM) or float32 powers of two (SGLang)
        kw = tuple(scales.items())
        # contiguous "auto": the FP8-tensor-core form while the layout holds few rows an expert, words above
        small = mi._contiguous_fp4_overrides((MASKED_MAX_TOKENS + 1) * k + E * (ALIGN - 1), E)["packing"]
        packings = {small, mi._contiguous_fp4_overrides(1 << 20, E)["packing"]}
        for N, K in gemms:
            jobs.append(Job("moe_fp4_masked", (N, K), kw))
            jobs += [Job("moe_fp4_contiguous", (N, K), kw + (("packing", p),)) for p in sorted(packings)]
    return jobs


def moe_enabled(target_kind: Optional[str]) -> bool:
    """Whether the engines route MoE experts to our kernels on a target of ``target_kind`` (``MUSA_ATTN_MOE``)."""
    from .config import settings

    value = settings().moe
    return target_kind == "musa" if value == "auto" else value == "on"


def plan(model: V4Model, *, engine: str = "sglang", kv_dtype: Optional[str] = None, speculative_tokens: int = 0,
         experts: str = "fp8", target_kind: Optional[str] = None) -> list[Job]:
    """The kernels ``engine`` launches serving ``model`` on a ``target_kind`` (``cuda``/``musa``; default this
    platform's compile target) device. ``speculative_tokens`` (MTP) adds no kernel of its own: the draft layers
    and the verify tokens run the same programs. ``experts``: the checkpoint's expert format."""
    from .platform import get_platform, model_kernels_enabled

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if (kv_dtype or "auto") not in KV_DTYPES:
        raise ValueError(f"DeepSeek-V4's caches are FP8 (e4m3, V4's layout): --kv-cache-dtype must be one of "
                         f"{KV_DTYPES}, got {kv_dtype!r}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS} (the checkpoint's expert format), got {experts!r}")
    if speculative_tokens < 0:
        raise ValueError(f"speculative_tokens must be >= 0, got {speculative_tokens}")
    target_kind = target_kind or get_platform().target_kind
    jobs = _attention(model, engine) + _compressors(model, engine) + _indexer(model, engine)
    if engine == "vllm":
        jobs += _vllm_layer(model)
    else:
        jobs += _sglang_model_side(model, engine_owned_only=not model_kernels_enabled(target_kind))
    if moe_enabled(target_kind):
        jobs += _moe(model, experts)
    return list(dict.fromkeys(jobs))
