"""DeepSeek-V4's model-side kernels for SGLang 0.5.23 where SGLang has none: on MUSA and on a CPU, SGLang's V4
model calls JIT CUDA kernels outside attention (``docs/dsv4-sglang-model-kernels.md`` maps them). :func:`install`
replaces them through SGLang's ``HookRegistry`` (``REPLACE``; SGLang rebinds the names other modules imported)
with this package's ops (:mod:`..kernels.dsv4.model`), with SGLang's signatures. On CUDA nothing is replaced:
SGLang's own kernels run there.

Replaced so far: the q head norm + RoPE, the (inverse) RoPE in place, the bf16 K path's norm + RoPE, the shared
expert's clamped SwiGLU, and on a CPU the RoPE factory's refusal of the V4 layers that take no RoPE scaling.
Not yet: mHC (pre, post, Sinkhorn, combine, head), the routed experts' clamp, the CPU FP8-KV guard.
"""

from __future__ import annotations

import logging

import torch

from ..kernels.dsv4 import model as ops

logger = logging.getLogger(__name__)

_tables: dict = {}
_installed = False


def _cos_sin(freqs_cis: torch.Tensor):
    """SGLang's complex ``freqs_cis [max_pos, 32]`` as float cos / sin tables (made once per table)."""
    key = (freqs_cis.data_ptr(), tuple(freqs_cis.shape), str(freqs_cis.device))
    if key not in _tables:
        parts = torch.view_as_real(freqs_cis)
        _tables[key] = (parts[..., 0].float().contiguous(), parts[..., 1].float().contiguous())
    return _tables[key]


def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions) -> None:
    cos, sin = _cos_sin(freqs_cis)
    ops.q_norm_rope(q_input, eps, cos, sin, positions, out=q_output)


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False) -> None:
    cos, sin = _cos_sin(freqs_cis)
    ops.rope_(q, cos, sin, positions, inverse)
    if k is not None:
        ops.rope_(k, cos, sin, positions, inverse)


def fused_norm_rope_inplace(kv, weight, eps, freq_cis, positions) -> None:
    cos, sin = _cos_sin(freq_cis)
    ops.norm_rope_(kv, weight, float(eps), cos, sin, positions)


def silu_and_mul_clamp(input, output, swiglu_limit) -> None:  # noqa: A002 - SGLang's parameter name
    ops.silu_and_mul_clamp(input, float(swiglu_limit), out=output)


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
    """Register the replacements (idempotent); nothing on CUDA."""
    global _installed
    if _installed:
        return
    _installed = True
    from ..platform import get_platform

    kind = get_platform().kind
    if kind == "cuda":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    targets = {
        "sglang.kernels.ops.attention.dsv4.norm_rope.fused_q_norm_rope": fused_q_norm_rope,
        "sglang.kernels.ops.attention.dsv4.norm_rope.fused_rope_inplace": fused_rope_inplace,
        "sglang.kernels.ops.attention.dsv4.norm_rope.fused_norm_rope_inplace": fused_norm_rope_inplace,
        "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp": silu_and_mul_clamp,
    }
    if kind == "cpu":
        targets["sglang.srt.layers.rotary_embedding.factory.get_rope_cpu"] = _get_rope_cpu()
    for target, fn in targets.items():
        HookRegistry.register(target, fn, HookType.REPLACE)
    logger.info("musa_attn_backend: DeepSeek-V4 model kernels replaced on %s: %s", kind, ", ".join(targets))
