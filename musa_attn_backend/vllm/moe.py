"""vLLM's FP8 block-scaled MoE experts on :func:`musa_attn_backend.kernels.moe.fused_experts`.

The hook: vLLM's ``Fp8MoEMethod.__init__`` picks the experts class of an FP8 MoE layer through
``select_fp8_moe_backend``, a name bound in ``vllm.model_executor.layers.quantization.fp8``. :func:`install` rebinds
that name to :func:`_select`: when ``MUSA_ATTN_MOE`` says so (:func:`musa_attn_backend.platform.moe_experts_enabled`:
on a MUSA device by default) and the layer is 128 x 128 block-scaled FP8 weights with dynamic 1 x 128 activations
(DeepSeek-V4's FP8 "Base" experts, also V3's), it answers ``(Fp8MoeBackend.TRITON, MusaBlockFp8Experts)``; every
other layer gets vLLM's own answer. ``TRITON`` is the backend whose weight format is the checkpoint's (no
re-layout) and whose quant config carries the block shape and V4's SwiGLU clamp; vLLM then builds its usual
kernel, the no-EP prepare/finalize step around our experts class. Models other than V4 take the same path: the
experts class computes plain SwiGLU when the layer has no clamp.

FP4 (MXFP4) experts, the default V4 checkpoints: ``Mxfp4MoEMethod.__init__`` asks
``select_deepseek_v4_mxfp4_moe_backend`` (a name bound in ``vllm.model_executor.layers.quantization.mxfp4``;
on a MUSA platform vLLM's own answer raises, none of its MXFP4 kernels runs there). The same switch rebinds it
to :func:`_select_mxfp4`, which answers ``(Mxfp4MoeBackend.EMULATION, MusaBlockFp8Experts)``: EMULATION keeps the
checkpoint's packed layout (``w13 [E, 2I, H/2]`` uint8 with ``[E, 2I, H/32]`` UE8M0 scales), leaves the
activations in bf16 and carries the SwiGLU clamp; our op converts the weights in its kernels and quantises the
activations 1 x 128 to FP8 (V4's recipe in vLLM is MXFP8, 1 x 32; SGLang's FP4-to-FP8 path also uses 1 x 128).

Not hooked: all-to-all expert parallelism (our class refuses it through ``_supports_parallel_config``, so vLLM's
selection answers).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_MODULE = "vllm.model_executor.layers.quantization.fp8"
_MXFP4_MODULE = "vllm.model_executor.layers.quantization.mxfp4"
_original = None
_original_mxfp4 = None


def _experts_class():
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8Dynamic128Sym, kFp8Static128BlockSym,
                                                                           kMxfp4Static)

    class MusaBlockFp8Experts(mk.FusedMoEExpertsModular):
        """The routed experts of one layer in one call of :func:`~musa_attn_backend.kernels.moe.fused_experts`:
        routing, the 1 x 128 activation quantisation, both grouped GEMMs, the (clamped) SwiGLU and the weighted
        sum into vLLM's output. FP8 block-scaled or MXFP4 weights (the op tells them by dtype). It takes the
        bf16 hidden states (``expects_unquantized_inputs``: vLLM's prepare step would quantise with a Triton
        kernel) and needs no vLLM workspace."""

        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

        @staticmethod
        def _supports_current_device() -> bool:
            return True  # the op runs its TileLang programs on a GPU and its reference on a CPU

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            # block FP8 weights with 1 x 128 dynamic activations; MXFP4 weights with the activations left to us
            # (vLLM's EMULATION backend passes them in bf16)
            return ((weight_key == kFp8Static128BlockSym and activation_key == kFp8Dynamic128Sym)
                    or (weight_key == kMxfp4Static and activation_key is None))

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == MoEActivation.SILU

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return not moe_parallel_config.use_all2all_kernels

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()  # apply writes the weighted sum

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            from ..kernels.moe import fused_experts

            if a1q_scale is not None or hidden_states.dtype != torch.bfloat16:
                raise ValueError(f"MusaBlockFp8Experts: expects the bf16 hidden states, got {hidden_states.dtype}"
                                 + (" with activation scales" if a1q_scale is not None else ""))
            if apply_router_weight_on_input:  # the prepare step has weighted the input already
                topk_weights = torch.ones_like(topk_weights, dtype=torch.float32)
            fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, w13_scale=self.w1_scale,
                          w2_scale=self.w2_scale, swiglu_limit=self.activation_config.clamp_limit,
                          expert_map=expert_map, out=output)

    return MusaBlockFp8Experts


_cls = None


def experts_class():
    """The experts class (built on first use: it subclasses vLLM's, imported lazily)."""
    global _cls
    if _cls is None:
        _cls = _experts_class()
    return _cls


def _ours(config, weight_key, activation_key, kind: str):
    """Our experts class for a layer of this scheme when ``MUSA_ATTN_MOE`` is on and the class supports it, else
    None (logged: the caller asks vLLM)."""
    from ..platform import moe_experts_enabled

    if not moe_experts_enabled():
        return None
    cls = experts_class()
    ok, why = cls.is_supported_config(cls, config, weight_key, activation_key, cls.activation_format())
    if ok:
        logger.info("musa_attn_backend: an %s MoE layer runs on musa_attn_backend.kernels.moe", kind)
        return cls
    logger.info("musa_attn_backend: %s MoE layer left to vLLM's selection (%s)", kind, why)
    return None


def _select(*args, **kwargs):
    """``select_fp8_moe_backend`` with our experts for the block-FP8 scheme (module docstring)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    cls = _ours(kwargs.get("config", args[0] if args else None), kwargs.get("weight_key"),
                kwargs.get("activation_key"), "FP8")
    return (Fp8MoeBackend.TRITON, cls) if cls is not None else _original(*args, **kwargs)


def _select_mxfp4(config):
    """``select_deepseek_v4_mxfp4_moe_backend`` with our experts for MXFP4 layers (module docstring)."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static

    cls = _ours(config, kMxfp4Static, None, "MXFP4")
    return (Mxfp4MoeBackend.EMULATION, cls) if cls is not None else _original_mxfp4(config)


_select_mxfp4._musa_attn = True
_select._musa_attn = True


def _rebind(module, attr: str, wrapper, slot: str) -> None:
    """``module.attr = wrapper``, the original kept in this module's global ``slot`` (once: a second call finds
    the wrapper and leaves it)."""
    if getattr(getattr(module, attr), "_musa_attn", False):
        return
    globals()[slot] = getattr(module, attr)
    setattr(module, attr, wrapper)


def _patch(fp8) -> None:
    _rebind(fp8, "select_fp8_moe_backend", _select, "_original")


def _patch_mxfp4(mxfp4) -> None:
    _rebind(mxfp4, "select_deepseek_v4_mxfp4_moe_backend", _select_mxfp4, "_original_mxfp4")


def install() -> None:
    """Rebind ``select_fp8_moe_backend`` in vLLM's FP8 quantisation module and
    ``select_deepseek_v4_mxfp4_moe_backend`` in its MXFP4 module when vLLM imports them (idempotent; every
    process, from the plugin's ``register``): MoE layers built afterwards see :func:`_select` and
    :func:`_select_mxfp4`. The modules are not imported here: some installs cannot import them without their
    compiled extensions."""
    from ..import_hooks import patch_on_import

    patch_on_import(_MODULE, _patch)
    patch_on_import(_MXFP4_MODULE, _patch_mxfp4)
