"""SGLang 0.5.23's FP8 block-scaled MoE experts (and, on the ``deep_gemm`` runner, FP4 ones) on this package's op
(:func:`..kernels.moe.fused_experts`). :func:`install` sets up both hooks below.

**What it hooks.** :func:`install_fused_function` replaces the fused function SGLang registers for the standard
dispatcher and the ``triton`` runner, ``FusedOpPool._fused_funcs[("none", "triton")]``
(``fused_experts_none_to_triton``, ``layers/moe/moe_runner/triton.py``), with :func:`fused_experts_none_to_triton`,
which keeps SGLang's function in :data:`original`. ``Fp8MoEMethod.create_moe_runner`` resolves
``--moe-runner-backend auto`` to ``triton`` off ROCm and without DeepGEMM, and ``MoeRunner.run`` calls the pool's
fused function before its runner core, so DeepSeek-V4's FP8 experts (and ``SGLANG_DSV4_FP4_DEQUANT=1``'s FP4 ones,
dequantised to FP8 blocks at load) arrive here.

**Why there.** ``MoeRunner.__init__`` reads the pool once, when the layer's quantisation method builds its
runner, so the replacement has to be in the pool before any MoE layer is built: the plugin's ``register()``
installs it (SGLang calls that in each of its processes, before loading the model). A runner built earlier keeps
SGLang's function. A ``triton`` runner core registered instead would never run: the fused function wins.

**What it handles.** Only when our switch is on (:func:`..platform.moe_experts_enabled`, read at each call, so
``config.override`` works after installation; it is cached and costs no device work), and the call is what the
op computes: FP8 w8a8 weights with 128 x 128 block scales (``float8_e4m3fn`` weights, ``float32`` scales of the
block shapes), activations quantised 1 x 128 at run time (no static ``a13_scale`` / ``a2_scale``), no bias, no
zero points, gate rows then up rows (not interleaved), ``activation == "silu"`` gated with V4's optional
``swiglu_limit`` and no ``gemm1_alpha`` / ``gemm1_clamp_limit``, bf16 hidden states with no pre-quantised
payload scale, the standard top-k format, a combined output (no ``no_combine``). Everything else goes to
:data:`original` with the same arguments.

**The** ``deep_gemm`` **runner.** ``--moe-runner-backend deep_gemm`` makes ``Fp8MoEMethod`` build a
``MoeRunner("deep_gemm")`` and hand it ``DeepGemmMoeQuantInfo``: FP8 128 x 128 block-scaled experts, or (with
``is_fp4_experts``) DeepSeek-V4's FP4 experts, int8-packed E2M1 with float32 1 x 32 power-of-two scales. No fused
function exists for that runner, so ``MoeRunner.__init__`` takes a core registered in SGLang's
``_CUSTOM_RUNNER_CORE_FACTORIES`` (``register_moe_runner_core``) and ``MoeRunner.run`` calls its
``run_from_dispatch`` with the standard dispatcher's output. :func:`install_deep_gemm_core` registers
:func:`create_deep_gemm_core` there when our switch is on at installation. :class:`DeepGemmCore` runs the whole
layer as one :func:`..kernels.moe.fused_experts` call and returns ``StandardCombineInput``, as SGLang's core does.
It handles gated ``silu`` (V4's ``swiglu_limit`` included) on the standard dispatcher, bf16 hidden states, FP8
weights with float32 128 x 128 block scales and FP4 experts (SGLang's float32 scales as they are). A case outside
that raises ``NotImplementedError`` naming it, when the runner is built (runner config, all-to-all backend) or at
the first call (weights, dispatch output): there is nothing to hand such a call to where DeepGEMM is absent. Where
SGLang's DeepGEMM does run, a runner config ours cannot run gets SGLang's core at build time
(:func:`create_deep_gemm_core` says why only then).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..platform import moe_experts_enabled
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
    if unsupported_runner_config(c) is not None:  # the deep_gemm core's list: what the op cannot compute
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


def _run_op(dispatch_output, w13, w13_scale, w2, w2_scale, c) -> torch.Tensor:
    """The op on a standard dispatch output with the runner config ``c``: a new ``[T, H]`` bf16 tensor, the
    routed scaling factor applied where SGLang's experts apply it (:data:`ROUTED_SCALE_IN_EXPERTS`)."""
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
    out = moe_ops.fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                                swiglu_limit=None if c.swiglu_limit is None else float(c.swiglu_limit),
                                apply_router_weight_on_input=c.apply_router_weight_on_input)
    if scale is not None:
        out.mul_(scale)  # router weight on the input: the factor scales the output, as SGLang's top-k sum does
    return out


def fused_experts_none_to_triton(dispatch_output, quant_info, runner_config):
    """SGLang's fused function for ``("none", "triton")``: our op for the calls :func:`handles` accepts,
    :data:`original` for the rest. Returns ``StandardCombineInput`` as SGLang's does: ``hidden_states`` itself,
    overwritten, when ``runner_config.inplace``, else a new tensor."""
    if not handles(dispatch_output, quant_info, runner_config):
        return original(dispatch_output, quant_info, runner_config)
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    q, c = quant_info, runner_config
    hidden = dispatch_output.hidden_states
    out = _run_op(dispatch_output, q.w13_weight, q.w13_scale, q.w2_weight, q.w2_scale, c)
    if c.inplace:
        # SGLang's in-place path writes the result into hidden_states (the model allocates it for the all-reduce
        # that follows). The op does not promise to allow ``out`` to alias its input, hence a copy.
        hidden.copy_(out)
        out = hidden
    # Not mirrored: SGLang allocates the out-of-place output in NCCL's symmetric memory pool when
    # --enable-symm-mem is on; a plain allocation only loses that all-reduce fast path.
    return StandardCombineInput(hidden_states=out)


def install() -> None:
    """Both hooks: :func:`install_fused_function` and :func:`install_deep_gemm_core`. Idempotent; never raises
    (each logs what it could not do, and the attention backend's registration goes on)."""
    install_fused_function()
    install_deep_gemm_core()


def install_fused_function() -> None:
    """Put :func:`fused_experts_none_to_triton` into SGLang's ``FusedOpPool`` for ``("none", "triton")``,
    keeping SGLang's function in :data:`original`. Idempotent. Where SGLang's MoE runner does not import, or
    registers no such function, it logs that and changes nothing."""
    global original, ROUTED_SCALE_IN_EXPERTS
    try:
        import sglang.srt.layers.moe.moe_runner.triton  # noqa: F401  (registers SGLang's function for KEY)
        from sglang.srt.layers.moe.moe_runner.base import FusedOpPool
        from sglang.srt.utils import is_cuda, is_musa
    except Exception as e:  # noqa: BLE001 - the attention backend must still register
        logger.error("musa_attn_backend: SGLang's MoE runner does not import here (%s: %s); MoE layers keep "
                     "SGLang's kernels", type(e).__name__, e)
        return

    ROUTED_SCALE_IN_EXPERTS = bool(is_cuda() or is_musa())
    current = FusedOpPool._fused_funcs.get(KEY)
    if current is fused_experts_none_to_triton:
        return
    if current is None:
        logger.warning("musa_attn_backend: SGLang registers no MoE fused function for %s; FP8 experts keep "
                       "SGLang's path", KEY)
        return
    original = current
    FusedOpPool._fused_funcs[KEY] = fused_experts_none_to_triton
    logger.info("musa_attn_backend: SGLang's MoE fused function %s wrapped: FP8 block-scaled experts run on "
                "kernels.moe when MUSA_ATTN_MOE allows", KEY)


# --- the ``deep_gemm`` runner core -----------------------------------------------------------------------------

DEEP_GEMM = "deep_gemm"

try:  # the base class MoeRunner.run feeds the dispatch output directly (no permute step)
    from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore as _DispatchCore
    _DISPATCH_CORE_ERROR: Optional[BaseException] = None
except Exception as e:  # noqa: BLE001 - install_deep_gemm_core() logs it; the attention backend must still register
    _DispatchCore, _DISPATCH_CORE_ERROR = object, e

_UNSUPPORTED = "musa_attn_backend's deep_gemm MoE runner (MUSA_ATTN_MOE) does not run "
_OFF_HINT = "; set MUSA_ATTN_MOE=off for SGLang's own DeepGEMM runner, or choose another --moe-runner-backend"


def unsupported_runner_config(config) -> Optional[str]:
    """What, in a layer's ``MoeRunnerConfig`` or the all-to-all backend, :class:`DeepGemmCore` cannot run (None:
    nothing). Known when the runner is built."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    c = config
    if c.activation != "silu" or not c.is_gated:
        return f"activation {c.activation!r}{'' if c.is_gated else ' without a gate'} (only gated silu: SwiGLU)"
    extras = [n for n in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit") if getattr(c, n, None) is not None]
    if extras:
        return "a SwiGLU with " + " / ".join(extras) + " (only swiglu_limit)"
    if c.swiglu_limit is not None and not c.swiglu_limit > 0:
        return f"swiglu_limit {c.swiglu_limit!r} (a positive clamp or None)"
    if c.no_combine:
        return "no_combine (per-choice rows left uncombined)"
    if getattr(c, "silu_mul_keep_fp32", False):
        return "silu_mul_keep_fp32 (the op rounds the first GEMM's output to bf16 before SwiGLU)"
    a2a = get_moe_a2a_backend()
    if not a2a.is_none():
        return f"--moe-a2a-backend {a2a.value} (only the standard dispatcher, --moe-a2a-backend none)"
    return None


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(_UNSUPPORTED + what + _OFF_HINT)


def fp4_scales(scale: torch.Tensor, name: str) -> torch.Tensor:
    """SGLang's FP4 expert scales as the op takes them, with no copy: float32 (SGLang's storage of the UE8M0
    powers of two, ``Fp8MoEMethod.create_fp8_moe_weight_``) as they are, ``float8_e8m0fnu`` (AITER, XPU) as its
    bytes, uint8 as it is. DeepGEMM's packed layout (int32, made at load on SM100 / SM120) and other dtypes raise
    ``NotImplementedError``; so does a non-contiguous tensor."""
    if not isinstance(scale, torch.Tensor):
        raise _unsupported(f"FP4 experts without a scale tensor {name}")
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    if scale.dtype not in (torch.float32, torch.uint8):
        raise _unsupported(f"FP4 expert scales {name} of dtype {scale.dtype} (float32 powers of two, "
                           f"float8_e8m0fnu or uint8 UE8M0, [experts, rows, columns / 32]; int32 is DeepGEMM's "
                           f"packed layout)")
    if not scale.is_contiguous():
        raise _unsupported(f"non-contiguous FP4 expert scales {name}")
    return scale


class DeepGemmCore(_DispatchCore):
    """The core :func:`create_deep_gemm_core` gives ``MoeRunner("deep_gemm")``: the layer's routed experts on
    :func:`..kernels.moe.fused_experts` (the module docstring's list of what it runs).

    One per MoE layer (each quantisation method builds its own runner). It holds no tensor: the weights and
    scales are SGLang's, read where SGLang keeps them."""

    def __init__(self, config):
        reason = unsupported_runner_config(config)
        if reason is not None:
            raise _unsupported(reason)
        super().__init__(config)

    @property
    def runner_backend(self):
        from sglang.srt.layers.moe.utils import MoeRunnerBackend

        return MoeRunnerBackend.DEEP_GEMM

    def expert_weights(self, quant_info) -> tuple:
        """``(w13, w13_scale, w2, w2_scale)`` as the op takes them, from SGLang's ``DeepGemmMoeQuantInfo``.

        - FP8: ``float8_e4m3fn`` weights with float32 ``[E, rows/128, columns/128]`` scales, ``block_shape [128,
          128]`` (per-tensor FP8 arrives that way too: ``Fp8MoEMethod.apply`` repeats its scales per block); passed
          as they are.
        - FP4 (``is_fp4_experts``): ``[E, 2I, H/2]`` / ``[E, H, I/2]`` int8, two E2M1 codes a byte, element ``2j``
          in the low nibble, as the op packs them, so viewed as uint8 (no copy); scales ``[E, rows, columns/32]``
          through :func:`fp4_scales` (no copy). The activations are quantised 1 x 128 either way, as SGLang's runner
          does (its activation group is ``block_shape[1]``, 128)."""
        q = quant_info
        if getattr(q, "use_mxfp8", False):
            raise _unsupported("MXFP8 experts (use_mxfp8: 1 x 32 UE8M0 weight and activation scales)")
        block = None if q.block_shape is None else list(q.block_shape)
        w13, w2 = q.w13_weight, q.w2_weight
        if getattr(q, "is_fp4_experts", False):
            if block not in (None, [BLOCK, BLOCK]):
                raise _unsupported(f"FP4 experts with block_shape {block} (the activation group must be 128)")
            if not all(isinstance(w, torch.Tensor) and w.dtype in (torch.int8, torch.uint8) for w in (w13, w2)):
                raise _unsupported(f"FP4 experts stored as {getattr(w13, 'dtype', None)} / "
                                   f"{getattr(w2, 'dtype', None)} (int8 or uint8, two E2M1 codes a byte)")
            return (w13.view(torch.uint8), fp4_scales(q.w13_scale, "w13_scale"),
                    w2.view(torch.uint8), fp4_scales(q.w2_scale, "w2_scale"))
        dtypes = {getattr(w, "dtype", None) for w in (w13, w2)}
        if not q.use_fp8 or dtypes != {FP8}:
            raise _unsupported(f"expert weights of dtype {'/'.join(sorted(map(str, dtypes)))}"
                               f"{'' if q.use_fp8 else ' (use_fp8=False)'} (FP8 e4m3 block-scaled or FP4 experts)")
        if block != [BLOCK, BLOCK]:
            raise _unsupported(f"FP8 experts with block_shape {block} (only [128, 128])")
        for name in ("w13_scale", "w2_scale"):
            scale = getattr(q, name)
            if not (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32):
                raise _unsupported(f"FP8 expert scales {name} of dtype {getattr(scale, 'dtype', None)} (float32 "
                                   f"128 x 128 block scales; int32 is DeepGEMM's UE8M0-packed layout)")
        return w13, q.w13_scale, w2, q.w2_scale

    def run_from_dispatch(self, dispatch_output, quant_info, runner_config, hooks=None):
        """The layer on the op; returns ``StandardCombineInput`` with a new ``[T, H]`` bf16 tensor, as SGLang's
        deep_gemm core does (it does not write into ``hidden_states``, whatever ``inplace`` says, and neither
        does this)."""
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput, StandardDispatchOutput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        if hooks is not None:
            raise _unsupported("LoRA MoE hooks")
        if not isinstance(dispatch_output, StandardDispatchOutput):
            raise _unsupported(f"a {type(dispatch_output).__name__} (only the standard dispatcher's output)")
        hidden = dispatch_output.hidden_states
        if dispatch_output.hidden_states_scale is not None or not (
                isinstance(hidden, torch.Tensor) and hidden.dtype == torch.bfloat16 and hidden.dim() == 2):
            raise _unsupported(f"hidden states of dtype {getattr(hidden, 'dtype', None)}"
                               f"{' with a scale' if dispatch_output.hidden_states_scale is not None else ''} "
                               f"(bf16 [tokens, hidden], quantised by the op)")
        if not TopKOutputChecker.format_is_standard(dispatch_output.topk_output):
            raise _unsupported(f"top-k output format {dispatch_output.topk_output.format} (only standard)")
        w13, w13_scale, w2, w2_scale = self.expert_weights(quant_info)
        # Shapes, contiguity and apply_router_weight_on_input (top-1 only) are checked by the op (ValueError).
        # Not mirrored: SGLang allocates this output in NCCL's symmetric memory pool when --enable-symm-mem is
        # on; a plain allocation only loses that all-reduce fast path.
        out = _run_op(dispatch_output, w13, w13_scale, w2, w2_scale, runner_config)
        return StandardCombineInput(hidden_states=out)


def _sglang_deep_gemm_usable() -> bool:
    """Whether SGLang's own DeepGEMM runner can run here (the ``deep_gemm`` package imports on CUDA / MUSA)."""
    try:
        from sglang.srt.layers import deep_gemm_wrapper

        return bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM)
    except Exception:  # noqa: BLE001 - without its wrapper SGLang's DeepGEMM runner cannot run either
        return False


def create_deep_gemm_core(config):
    """The factory registered for ``deep_gemm``, called by ``MoeRunner.__init__`` once per layer.

    - Switch off now (``config.override`` after installation): SGLang's own ``DeepGemmRunnerCore``, what
      ``MoeRunner`` builds with nothing registered.
    - A runner config :class:`DeepGemmCore` handles: :class:`DeepGemmCore`.
    - Otherwise SGLang's own core where DeepGEMM runs here, else ``NotImplementedError`` naming the case. The
      decision is made here, at build time, because SGLang's core is a permute-style core: ``MoeRunner.run``
      feeds it through pre- and post-permute functions with state (overlap arguments) a dispatch core never
      sees, so a call cannot be handed over later. Calls our core turns out not to handle (weights, dispatch
      output) therefore raise rather than fall back."""
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmRunnerCore

    if not moe_experts_enabled():
        return DeepGemmRunnerCore(config)
    reason = unsupported_runner_config(config)
    if reason is None:
        return DeepGemmCore(config)
    if _sglang_deep_gemm_usable():
        logger.info("musa_attn_backend: MoE layer %s runs on SGLang's DeepGEMM runner: %s is not handled by "
                    "kernels.moe", config.layer_id, reason)
        return DeepGemmRunnerCore(config)
    raise _unsupported(reason + " (and SGLang's own DeepGEMM runner cannot run here: the deep_gemm package is "
                       "missing or disabled)")


def install_deep_gemm_core() -> None:
    """Register :func:`create_deep_gemm_core` for ``deep_gemm`` with SGLang's ``register_moe_runner_core``, only
    when our switch is on (read here: the registration cannot be undone, and a layer built while the switch is
    off gets SGLang's core from the factory anyway). Idempotent. Where SGLang lacks the hook, or another plugin
    registered a core for ``deep_gemm`` first, it logs that and changes nothing."""
    if not moe_experts_enabled():
        return
    if _DISPATCH_CORE_ERROR is not None:
        logger.error("musa_attn_backend: SGLang's MoE runner base does not import here (%s: %s); "
                     "--moe-runner-backend deep_gemm keeps SGLang's runner", type(_DISPATCH_CORE_ERROR).__name__,
                     _DISPATCH_CORE_ERROR)
        return
    try:
        from sglang.srt.layers.moe.moe_runner import runner as sglang_runner
    except Exception as e:  # noqa: BLE001 - the attention backend must still register
        logger.error("musa_attn_backend: SGLang's MoE runner does not import here (%s: %s); "
                     "--moe-runner-backend deep_gemm keeps SGLang's runner", type(e).__name__, e)
        return
    register = getattr(sglang_runner, "register_moe_runner_core", None)
    factories = getattr(sglang_runner, "_CUSTOM_RUNNER_CORE_FACTORIES", None)
    if register is None or not isinstance(factories, dict):
        logger.warning("musa_attn_backend: this SGLang has no register_moe_runner_core; "
                       "--moe-runner-backend deep_gemm keeps SGLang's runner")
        return
    current = factories.get(DEEP_GEMM)
    if current is create_deep_gemm_core:
        return
    if current is not None:
        logger.warning("musa_attn_backend: a MoE runner core for %r is already registered (%r); ours is not",
                       DEEP_GEMM, current)
        return
    try:
        register(DEEP_GEMM, create_deep_gemm_core)
    except Exception as e:  # noqa: BLE001 - the attention backend must still register
        logger.error("musa_attn_backend: registering the %r MoE runner core failed (%s: %s)", DEEP_GEMM,
                     type(e).__name__, e)
        return
    logger.info("musa_attn_backend: MoE runner core %r registered: --moe-runner-backend deep_gemm runs FP8 "
                "block-scaled and FP4 experts on kernels.moe", DEEP_GEMM)
