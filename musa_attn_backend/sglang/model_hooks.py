"""DeepSeek-V4's model-side kernels for SGLang 0.5.23 where SGLang has none: on MUSA and on a CPU, SGLang's V4
model calls JIT CUDA kernels outside attention (``docs/dsv4-engines.md`` part 2 maps them). :func:`install`
replaces them through SGLang's ``HookRegistry`` (``REPLACE``; SGLang rebinds the names other modules imported)
with this package's ops (:mod:`..kernels.dsv4.model`), with SGLang's signatures. On CUDA nothing is replaced unless
``MUSA_ATTN_MODEL_KERNELS=on`` asks (the MUSA situation on an NVIDIA GPU: issue 40's served runs); SGLang's own
kernels run there otherwise.

Replaced so far: the q head norm + RoPE, the (inverse) RoPE in place, the bf16 K path's norm + RoPE, the shared
expert's clamped SwiGLU, mHC (pre, post, the two fused across a layer boundary, Sinkhorn, the combine, the head;
the load-time prewarm of SGLang's TileLang mHC kernels is skipped), and on a CPU the RoPE factory's refusal of
the V4 layers that take no RoPE scaling, and the routed experts with unquantised weights (SGLang's CPU paths drop
V4's SwiGLU clamp, its MUSA path asserts CUDA; other MoEs keep SGLang's path), and on a CPU the KV-cache
configurator's refusal of an FP8 KV cache without Intel AMX, for V4 under ``tilelang_musa`` only. For speculative
decoding (V4's MTP draft): the last-location lookup of its allocation in torch under ``tilelang_musa`` (SGLang
takes Triton for any other backend), and on a CPU the draft's embedding / head swap without SGLang's CUDA
synchronisation.
"""

from __future__ import annotations

import logging

from ..kernels.dsv4 import model as ops
from ..metadata.sglang_dsv4 import rope_table

logger = logging.getLogger(__name__)

_installed = False
# (platform kind, replaced targets) once install() registered them; the V4 backend logs it again when it is made,
# since install() runs at plugin registration, before the server's processes have configured their logging
_replaced: tuple[str, list[str]] | None = None


def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions) -> None:
    cos, sin = rope_table(freqs_cis)
    ops.q_norm_rope(q_input, eps, cos, sin, positions, out=q_output)


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False) -> None:
    if q.shape[0] == 0:  # no token (an IDLE rank of DP attention): nothing to rotate, no table to build
        return
    cos, sin = rope_table(freqs_cis)
    ops.rope_(q, cos, sin, positions, inverse)
    if k is not None:
        ops.rope_(k, cos, sin, positions, inverse)


def fused_norm_rope_inplace(kv, weight, eps, freq_cis, positions) -> None:
    cos, sin = rope_table(freq_cis)
    ops.norm_rope_(kv, weight, float(eps), cos, sin, positions)


def silu_and_mul_clamp(input, output, swiglu_limit) -> None:  # noqa: A002 - SGLang's parameter name
    ops.silu_and_mul_clamp(input, float(swiglu_limit), out=output)


def mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
            sinkhorn_repeat, n_splits=1, n_splits_pre=32, *, norm_weight=None, norm_eps=None):
    return ops.mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                       sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)


def mhc_post(x, residual, post_layer_mix, comb_res_mix):
    return ops.mhc_post(x, residual, post_layer_mix, comb_res_mix)


def mhc_fused_post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                       hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1, *,
                       norm_weight=None, norm_eps=None):
    streams = ops.mhc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, layer_input = ops.mhc_pre(streams, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                                          hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight,
                                          norm_eps=norm_eps)
    return streams, post, comb, layer_input


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    return ops.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)


def mhc_combine(x_flat, pre, hc, out_dtype):
    """``y [m, H] = sum_k pre[m, k] * x_flat[m, k * H:(k + 1) * H]``. The stream width is ``H = x_flat.shape[1] //
    hc`` (not a ``-1`` in a reshape: with ``m = 0`` rows, an IDLE rank of DP attention, that is ambiguous)."""
    m, width = x_flat.shape
    if width % hc:
        raise ValueError(f"mhc_combine: x_flat's width {width} is not a multiple of hc={hc}")
    return ops.hc_combine(x_flat.reshape(m, hc, width // hc), pre.reshape(m, hc), out_dtype)


def fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    return ops.hc_head(x, hc_fn, hc_scale, hc_base, float(norm_eps), float(hc_eps))


def _experts(original, scale_in_experts: bool):
    """``UnquantizedFusedMoEMethod``'s forward for V4's routed experts (a SwiGLU clamp set, no bias, no alpha):
    SGLang's CPU paths drop the clamp, its MUSA path asserts CUDA and its CUDA path needs ``sgl_kernel``; every
    other MoE goes to ``original``. ``scale_in_experts``: the experts apply ``routed_scaling_factor`` (SGLang's
    ``DeepseekV2MoE`` leaves it to them on CUDA, MUSA and XPU, where its own kernels scale in their top-k sum, and
    multiplies after them elsewhere)."""

    def forward(self, layer, dispatch_output):
        cfg = self.moe_runner_config
        limit = getattr(cfg, "swiglu_limit", None)
        if (limit is None or cfg.activation != "silu" or cfg.gemm1_alpha is not None
                or getattr(cfg, "apply_router_weight_on_input", False)
                or getattr(layer, "w13_weight_bias", None) is not None):
            return original(self, layer, dispatch_output)
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        topk_weights, topk_ids = dispatch_output.topk_output[0], dispatch_output.topk_output[1]
        factor = getattr(cfg, "routed_scaling_factor", None)
        if scale_in_experts and factor not in (None, 1.0):
            topk_weights = topk_weights.float() * factor  # the sum runs in float32: no extra rounding
        out = ops.moe_swiglu_experts(dispatch_output.hidden_states, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, float(limit))
        return StandardCombineInput(hidden_states=out)

    return forward


class _NotACpu:
    """``current_platform`` for the one check in SGLang's KV-cache configurator that refuses an FP8 KV cache on a
    CPU without Intel AMX: DeepSeek-V4's pool is always FP8, and our backend reads it on a CPU."""

    def __init__(self, platform):
        self._platform = platform

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._platform, name)


def _configure_kv_cache(original, self, *args, **kwargs):
    """Around ``KVCacheConfigurator.configure``: for a DeepSeek-V4 model served by ``tilelang_musa``, without the CPU
    FP8-KV refusal (only its check reads the platform there); anything else unchanged."""
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.mem_cache import kv_cache_configurator as kc
    from sglang.srt.runtime_context import attention_backends

    from .. import BACKEND_NAME

    if not (is_deepseek_v4(self.model_config.hf_config) and set(attention_backends()) == {BACKEND_NAME}):
        return original(self, *args, **kwargs)
    real = kc.current_platform
    kc.current_platform = _NotACpu(real)
    try:
        return original(self, *args, **kwargs)
    finally:
        kc.current_platform = real


def _set_embed_and_head_cpu(self, embed, head) -> None:
    """``DeepseekV4ForCausalLM.set_embed_and_head`` on a CPU (the MTP draft shares the target's embedding and
    head): the same swap, without SGLang's device synchronisation, which calls CUDA on a CUDA build of torch."""
    del self.model.embed_tokens.weight
    del self.lm_head.weight
    self.model.embed_tokens.weight = embed
    self.lm_head.weight = head


def _get_last_loc():
    """SGLang's ``get_last_loc`` (the last KV location of each request, for speculative decoding's allocation)
    takes its Triton kernel for every backend but ``torch_native`` and ``ascend``: with ours off CUDA, the torch
    form; anything else unchanged."""
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache import allocation

    from .. import BACKEND_NAME

    original = allocation.get_last_loc

    def get_last_loc(req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
        if BACKEND_NAME in runtime_context.attention_backends():
            return allocation.get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
        return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)

    return get_last_loc


def _no_prewarm(self, *args, **kwargs) -> None:
    """SGLang prewarms its TileLang mHC kernels at load (and synchronises CUDA); ours need no warm-up."""


def _get_rope_cpu():
    """SGLang's CPU RoPE factory asserts a RoPE scaling; V4's uncompressed layers have none (their RoPE is ours
    and the layer's rotary module is unused off NPU): build the plain one for them."""
    from sglang.srt.layers.rotary_embedding import factory

    original = factory.get_rope_cpu

    def get_rope_cpu(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None, dtype=None,
                     partial_rotary_factor=1.0, device=None):
        if rope_scaling is None:
            return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, dtype,
                                    partial_rotary_factor)
        return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                        partial_rotary_factor, device)

    return get_rope_cpu


def install() -> None:
    """Register the replacements (idempotent); on CUDA only where ``MUSA_ATTN_MODEL_KERNELS=on`` asks (SGLang's own
    kernels run there by default), nowhere where it is ``off``."""
    global _installed
    if _installed:
        return
    _installed = True
    from ..platform import get_platform, model_kernels_enabled

    kind = get_platform().kind
    if not model_kernels_enabled(kind):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    targets = {
        "sglang.kernels.ops.attention.dsv4.norm_rope.fused_q_norm_rope": fused_q_norm_rope,
        "sglang.kernels.ops.attention.dsv4.norm_rope.fused_rope_inplace": fused_rope_inplace,
        "sglang.kernels.ops.attention.dsv4.norm_rope.fused_norm_rope_inplace": fused_norm_rope_inplace,
        "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp": silu_and_mul_clamp,
        "sglang.kernels.ops.layernorm.mhc.mhc_pre": mhc_pre,
        "sglang.kernels.ops.layernorm.mhc.mhc_post": mhc_post,
        "sglang.kernels.ops.layernorm.mhc.mhc_fused_post_pre": mhc_fused_post_pre,
        "sglang.kernels.ops.layernorm.mhc.hc_split_sinkhorn": hc_split_sinkhorn,
        "sglang.kernels.ops.layernorm.mhc.mhc_combine": mhc_combine,
        "sglang.kernels.ops.layernorm.mhc_head.fused_hc_head": fused_hc_head,
        "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM._prewarm_mhc_kernels": _no_prewarm,
    }
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as moe

    from sglang.srt.utils import is_cuda, is_musa, is_xpu

    scale_in_experts = bool(is_cuda() or is_musa() or is_xpu())  # DeepseekV2MoE's own test of the device
    for method in ("forward_cpu", "forward_native", "forward_musa") + (("forward_cuda",) if kind == "cuda" else ()):
        targets[f"sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod.{method}"] = _experts(
            getattr(moe, method), scale_in_experts)
    targets["sglang.srt.mem_cache.allocation.get_last_loc"] = _get_last_loc()
    if kind == "cpu":
        targets["sglang.srt.layers.rotary_embedding.factory.get_rope_cpu"] = _get_rope_cpu()
        targets["sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.set_embed_and_head"] = _set_embed_and_head_cpu
    for target, fn in targets.items():
        HookRegistry.register(target, fn, HookType.REPLACE)
    if kind == "cpu":
        HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
                              _configure_kv_cache, HookType.AROUND)
    global _replaced
    _replaced = (kind, list(targets))
    log_replaced()


def log_replaced() -> None:
    """Log which of SGLang's V4 model kernels :func:`install` replaced (nothing where it replaced none)."""
    if _replaced is not None:
        logger.info("musa_attn_backend: DeepSeek-V4 model kernels replaced on %s: %s", _replaced[0],
                    ", ".join(_replaced[1]))
