"""SGLang 0.5.23's FP8 block-scaled MoE experts on this package's op (:func:`..kernels.moe.fused_experts`).

**What it hooks.** :func:`install` replaces the fused function SGLang registers for the standard dispatcher and
the ``triton`` runner, ``FusedOpPool._fused_funcs[("none", "triton")]`` (``fused_experts_none_to_triton``,
``layers/moe/moe_runner/triton.py``), with :func:`fused_experts_none_to_triton`, which keeps SGLang's function in
:data:`original`. ``Fp8MoEMethod.create_moe_runner`` resolves ``--moe-runner-backend auto`` to ``triton`` off
ROCm and without DeepGEMM, and ``MoeRunner.run`` calls the pool's fused function before its runner core, so
DeepSeek-V4's FP8 experts (and ``SGLANG_DSV4_FP4_DEQUANT=1``'s FP4 ones, dequantised to FP8 blocks at load)
arrive here.

**Why there.** ``MoeRunner.__init__`` reads the pool once, when the layer's quantisation method builds its
runner, so the replacement has to be in the pool before any MoE layer is built: the plugin's ``register()``
installs it (SGLang calls that in each of its processes, before loading the model). A runner built earlier keeps
SGLang's function. A ``triton`` runner core registered instead would never run: the fused function wins.

**What it handles.** Only when our switch is on (:func:`..config.moe_experts_enabled`, read at each call, so
``config.override`` works after installation; it is cached and costs no device work), and the call is what the
op computes: FP8 w8a8 weights with 128 x 128 block scales (``float8_e4m3fn`` weights, ``float32`` scales of the
block shapes), activations quantised 1 x 128 at run time (no static ``a13_scale`` / ``a2_scale``), no bias, no
zero points, gate rows then up rows (not interleaved), ``activation == "silu"`` gated with V4's optional
``swiglu_limit`` and no ``gemm1_alpha`` / ``gemm1_clamp_limit``, bf16 hidden states with no pre-quantised
payload scale, the standard top-k format, a combined output (no ``no_combine``). Everything else goes to
:data:`original` with the same arguments.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..config import moe_experts_enabled
from ..kernels import moe as moe_ops

logger = logging.getLogger(__name__)

KEY = ("none", "triton")  # (a2a backend, runner backend)
BLOCK = 128
FP8 = torch.float8_e4m3fn

# SGLang's own fused function, set by install()
original: Optional[Callable] = None

# Whether the experts apply ``routed_scaling_factor`` (rather than the model after them). SGLang's Triton path
# scales in its top-k sum on CUDA and MUSA (``moe_combine_topk``), and DeepseekV2MoE then leaves the output
# alone; on other devices the model multiplies after the experts (``models/deepseek_v2.py``'s forward). Set by
# install() from SGLang's device checks.
ROUTED_SCALE_IN_EXPERTS = True


def _block_weights(w: torch.Tensor, scale: Optional[torch.Tensor], n: int, k: int) -> bool:
    """``w`` is contiguous FP8 ``[E, n, k]`` with contiguous float32 block scales ``[E, n/128, k/128]``."""
    return (isinstance(w, torch.Tensor) and w.dtype == FP8 and w.dim() == 3 and tuple(w.shape[1:]) == (n, k)
            and w.is_contiguous() and isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
            and tuple(scale.shape) == (w.shape[0], n // BLOCK, k // BLOCK) and scale.is_contiguous())


def handles(dispatch_output, quant_info, runner_config) -> bool:
    """Whether :func:`fused_experts_none_to_triton` runs this call on our op (the module docstring's list)."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    q, c = quant_info, runner_config
    if not moe_experts_enabled():
        return False
    if not (q.use_fp8_w8a8 and list(q.block_shape or ()) == [BLOCK, BLOCK]):
        return False
    if (q.use_mxfp8 or q.use_int8_w8a8 or q.use_int8_w8a16 or q.use_int4_w4a16 or q.per_channel_quant
            or q.fuse_swiglu_interleaved):
        return False
    if any(t is not None for t in (q.b13, q.b2, q.w13_zp, q.w2_zp, q.a13_scale, q.a2_scale)):
        return False
    if not (c.activation == "silu" and c.is_gated and c.gemm1_alpha is None and c.gemm1_clamp_limit is None
            and not c.no_combine and (c.swiglu_limit is None or c.swiglu_limit > 0)):
        return False
    hidden, topk = dispatch_output.hidden_states, dispatch_output.topk_output
    if dispatch_output.hidden_states_scale is not None or not TopKOutputChecker.format_is_standard(topk):
        return False
    if not (isinstance(hidden, torch.Tensor) and hidden.dtype == torch.bfloat16 and hidden.dim() == 2
            and hidden.is_contiguous()):
        return False
    if c.apply_router_weight_on_input and topk.topk_ids.shape[-1] != 1:
        return False  # SGLang allows it for top-1 only; its own path raises the error
    w13, w2 = q.w13_weight, q.w2_weight
    if not (isinstance(w13, torch.Tensor) and w13.dim() == 3):
        return False
    H, N = hidden.shape[1], w13.shape[1]  # w13 [E, 2I, H], w2 [E, H, I]
    return (H % BLOCK == 0 and N % (2 * BLOCK) == 0 and _block_weights(w13, q.w13_scale, N, H)
            and _block_weights(w2, q.w2_scale, H, N // 2) and w2.shape[0] == w13.shape[0])


def fused_experts_none_to_triton(dispatch_output, quant_info, runner_config):
    """SGLang's fused function for ``("none", "triton")``: our op for the calls :func:`handles` accepts,
    :data:`original` for the rest. Returns ``StandardCombineInput`` as SGLang's does: ``hidden_states`` itself,
    overwritten, when ``runner_config.inplace``, else a new tensor."""
    if not handles(dispatch_output, quant_info, runner_config):
        return original(dispatch_output, quant_info, runner_config)
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    q, c = quant_info, runner_config
    hidden = dispatch_output.hidden_states
    # Top-k ids arrive local to this rank: the standard dispatcher maps global ids under expert parallelism and
    # marks other ranks' experts -1, which the op skips. A pre-quantised copy of the activation
    # (hidden_states_pre_quant) is not read: the op quantises hidden_states 1 x 128 itself.
    topk_weights, topk_ids = dispatch_output.topk_output.topk_weights, dispatch_output.topk_output.topk_ids
    scale = c.routed_scaling_factor
    if not ROUTED_SCALE_IN_EXPERTS or scale in (None, 1.0):
        scale = None
    if scale is not None and not c.apply_router_weight_on_input:
        # folded into the weights, the factor costs no extra rounding (the op sums the choices in float32)
        topk_weights, scale = topk_weights.float() * scale, None
    out = moe_ops.fused_experts(hidden, q.w13_weight, q.w2_weight, topk_weights, topk_ids, w13_scale=q.w13_scale,
                                w2_scale=q.w2_scale,
                                swiglu_limit=None if c.swiglu_limit is None else float(c.swiglu_limit),
                                apply_router_weight_on_input=c.apply_router_weight_on_input)
    if scale is not None:
        out.mul_(scale)  # router weight on the input: the factor scales the output, as SGLang's top-k sum does
    if c.inplace:
        # SGLang's in-place path writes the result into hidden_states (the model allocates it for the all-reduce
        # that follows). The op does not promise to allow ``out`` to alias its input, hence a copy.
        hidden.copy_(out)
        out = hidden
    # Not mirrored: SGLang allocates the out-of-place output in NCCL's symmetric memory pool when
    # --enable-symm-mem is on; a plain allocation only loses that all-reduce fast path.
    return StandardCombineInput(hidden_states=out)


def install() -> None:
    """Put :func:`fused_experts_none_to_triton` into SGLang's ``FusedOpPool`` for ``("none", "triton")``,
    keeping SGLang's function in :data:`original`. Idempotent. Where SGLang's MoE runner does not import, or
    registers no such function, it logs that and changes nothing: the attention backend's registration goes on."""
    global original, ROUTED_SCALE_IN_EXPERTS
    try:
        import sglang.srt.layers.moe.moe_runner.triton  # noqa: F401  (registers SGLang's function for KEY)
        from sglang.srt.layers.moe.moe_runner.base import FusedOpPool
        from sglang.srt.utils import is_cuda, is_musa
    except Exception as e:  # noqa: BLE001 - the attention backend must still register
        logger.error("musa_attn_backend: SGLang's MoE runner does not import here (%s: %s); MoE layers keep "
                     "SGLang's kernels", type(e).__name__, e)
        return

    current = FusedOpPool._fused_funcs.get(KEY)
    if current is fused_experts_none_to_triton:
        return
    if current is None:
        logger.warning("musa_attn_backend: SGLang registers no MoE fused function for %s; FP8 experts keep "
                       "SGLang's path", KEY)
        return
    ROUTED_SCALE_IN_EXPERTS = bool(is_cuda() or is_musa())
    original = current
    FusedOpPool._fused_funcs[KEY] = fused_experts_none_to_triton
    logger.info("musa_attn_backend: SGLang's MoE fused function %s wrapped: FP8 block-scaled experts run on "
                "kernels.moe when MUSA_ATTN_MOE allows", KEY)
