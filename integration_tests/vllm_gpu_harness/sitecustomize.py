"""The MUSA situation for vLLM 0.33.0 on a CUDA GPU, for the engine tests only (issue 40): vLLM installed
python-only (the lent GPU's torch 2.11 cannot load its compiled extensions), so ``vllm._C``, ``vllm._moe_C``,
flash-attention, FlashInfer and DeepGEMM are absent, as they are on MUSA. Put this folder first on PYTHONPATH: as
``sitecustomize`` it runs in every Python process vLLM starts (the model registry's inspection subprocess and the
engine core included). It

- answers vLLM's capability queries (``cutlass_scaled_mm_supports_*``) "no";
- lets ``vllm.vllm_flash_attn`` import without its extensions (its interface module reports FA2/FA3 unavailable);
- turns off the FlashInfer sampler and DeepGEMM;
- takes vLLM's FP8 Marlin linear kernel off its list (``VLLM_DISABLED_KERNELS``): for block-FP8 linears on sm_90
  without CUTLASS, DeepGEMM and FlashInfer, vLLM's selection (``kernels/linear``, ``_POSSIBLE_FP8_BLOCK_KERNELS``)
  reaches Marlin (weight-only, compiled ``gptq_marlin_repack`` / ``marlin_gemm``) before its Triton kernel, which
  it then picks by itself (``TritonFp8BlockScaledMMKernel``: Triton GEMM, activations quantised 1 x 128 by
  ``QuantFP8``);
- registers torch forms, under vLLM's own op names and schemas, of the compiled ops the tiny V4's path still
  reaches outside this package's layer: RMSNorm (plain and fused add), SiluAndMul (plain and clamped), the V4
  router's ``topk_softplus_sqrt``, ``moe_align_block_size`` and ``moe_sum`` for vLLM's Triton experts, and the
  two memory aliases model runner V2 and CUDA graphs take (``get_cuda_view_from_cpu_tensor``, ``weak_ref_tensor``);
  and of those an FP8 block-scaled V4 adds: ``per_token_group_fp8_quant`` (every FP8 linear's 1 x 128 activation
  quantisation: vLLM adds ``+quant_fp8`` to ``custom_ops`` for block-FP8 models, ``none`` or not, unless it
  holds ``-quant_fp8``, and ``QuantFP8.forward_cuda`` then calls the compiled op on any contiguous CUDA input);
- replaces DeepGEMM's ``tf32_hc_prenorm_gemm`` (``vllm.utils.deep_gemm``) by a torch form: the first V4 layer's
  mHC (``mhc_pre_broadcast_tilelang``) calls it whatever ``VLLM_USE_DEEP_GEMM`` says (no TileLang fallback for
  that shape), so without it the first layer needs DeepGEMM's JIT kernels (or fails where DeepGEMM is absent).

Never part of the package's CUDA path: a served V4 on MUSA gets these from the platform's vLLM."""
MUSA_VLLM_HARNESS = True

import os

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else Sampler.__init__ imports flashinfer (absent)
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")  # keep mHC on TileLang even if a deep_gemm package is on the path
# vLLM's FP8 block-linear selection on CUDA tries FlashInfer+DeepGEMM, DeepGEMM, CUTLASS, B12x, then Marlin
# (supported from sm_75, so chosen on sm_90 when the four before it are not), Humming, Triton, torch: without
# Marlin it picks its Triton kernel itself
_off = [k for k in os.environ.get("VLLM_DISABLED_KERNELS", "").split(",") if k]
if "MarlinFP8ScaledMMLinearKernel" not in _off:
    os.environ["VLLM_DISABLED_KERNELS"] = ",".join(_off + ["MarlinFP8ScaledMMLinearKernel"])

import torch
_lib = torch.library.Library("_C", "FRAGMENT")
def _q(name):  # capability queries: answer "not supported"
    _lib.define(f"{name}(int cuda_device_capability) -> bool")
    _lib.impl(name, lambda cap: False, "CompositeExplicitAutograd")
for n in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported",
          "cutlass_scaled_mm_supports_fp4"):
    _q(n)

import importlib.abc, importlib.machinery, importlib.util, os, sys


def _real_spec(finder, name):
    """The module spec the import system finds for ``name`` with ``finder`` taken off ``sys.meta_path``."""
    sys.meta_path.remove(finder)
    try:
        return importlib.util.find_spec(name)
    finally:
        sys.meta_path.insert(0, finder)


class _FaPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """vllm.vllm_flash_attn without its ImportError: the package raises when neither _vllm_fa2_C nor _vllm_fa3_C
    loads; its flash_attn_interface imports fine and reports FA2/FA3 unavailable."""

    def find_spec(self, name, path, target=None):
        if name != "vllm.vllm_flash_attn":
            return None
        real = _real_spec(self, name)
        spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
        spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from vllm.vllm_flash_attn import flash_attn_interface as fi
        for n in ("FA2_AVAILABLE", "FA3_AVAILABLE", "compile_flash_attn_varlen_func_from_specs",
                  "fa_version_unsupported_reason", "flash_attn_varlen_func", "get_scheduler_metadata",
                  "is_fa_version_supported"):
            setattr(module, n, getattr(fi, n))


sys.meta_path.insert(0, _FaPackage())


# ---- torch stand-ins for the compiled ops the V4 engine path reaches (schemas copied from the real .so)
def _def(lib, schema, fn):
    name = schema.split("(", 1)[0]
    lib.define(schema)
    lib.impl(name, fn, "CompositeExplicitAutograd")


def _rms(x, w, eps):
    y = x.float()
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    return (y * w.float() if w is not None else y).to(x.dtype)


def _rms_norm(out, x, w, eps):
    out.copy_(_rms(x, w, eps))


def _fused_add_rms_norm(x, res, w, eps):
    s = (x.float() + res.float()).to(x.dtype)
    res.copy_(s)
    x.copy_(_rms(s, w, eps))


def _silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_((torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(out.dtype))


def _silu_and_mul_with_clamp(out, x, limit, alpha=1.0, beta=0.0):
    d = x.shape[-1] // 2
    g = x[..., :d].float().clamp(max=limit)
    u = x[..., d:].float().clamp(min=-limit, max=limit)
    out.copy_((g * torch.sigmoid(alpha * g) * (u + beta)).to(out.dtype))


_def(_lib, "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()", _rms_norm)
_def(_lib, "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
     _fused_add_rms_norm)
_def(_lib, "silu_and_mul(Tensor! result, Tensor input) -> ()", _silu_and_mul)
_def(_lib, "silu_and_mul_with_clamp(Tensor! result, Tensor input, float limit, float alpha=1.0, float beta=0.0) -> ()",
     _silu_and_mul_with_clamp)

class _Memory:
    """``__cuda_array_interface__`` over ``nbytes`` bytes at ``ptr``: torch.as_tensor makes a CUDA tensor of them
    without owning them (``keep``: what holds the memory alive, if the alias should)."""

    def __init__(self, ptr, nbytes, keep=None):
        self.keep = keep
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _alias(t, keep):
    """A CUDA tensor over ``t``'s memory with its dtype, shape and strides (pinned host memory is addressable from
    the device under unified addressing, at the same pointer)."""
    span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
    raw = torch.as_tensor(_Memory(t.data_ptr(), span, t if keep else None), device="cuda")
    return raw.view(t.dtype).as_strided(t.shape, t.stride())


def _cuda_view_from_cpu_tensor(cpu):
    if not cpu.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor: the tensor must be in pinned memory")
    return _alias(cpu, keep=True)


def _weak_ref_tensor(t):  # the same memory, not keeping it alive (vLLM's CUDA-graph outputs)
    return _alias(t, keep=False) if t.is_cuda else t


_def(_lib, "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor", _cuda_view_from_cpu_tensor)
_def(_lib, "weak_ref_tensor(Tensor input) -> Tensor", _weak_ref_tensor)


def _per_token_group_fp8_quant(x, out_q, out_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0,
                               dummy_is_scale_transposed=False, dummy_is_tma_aligned=False):
    """vLLM's ``per_token_group_fp8_quant`` (csrc/quantization/w8a8/fp8/per_token_group_quant.cu): each run of
    ``group_size`` consecutive elements of the contiguous ``x`` is one group (a row's last dim in groups), its scale
    ``max(eps, max |x|) / fp8_max`` (a NaN ignored, as ``fmaxf`` does), with ``scale_ue8m0`` rounded up to a power of
    two (the exponent bumped when the mantissa is non-zero: the kernel's bit form of
    ``exp2(ceil(log2(max(s, 1e-10))))``); ``out_q`` = ``x / scale`` clamped to ``[fp8_min, fp8_max]`` (``fmin`` /
    ``fmax``: a NaN lands on ``fp8_min``) in ``out_q``'s dtype, ``out_s[row, group]`` = the scale, whatever
    ``out_s``'s strides (row-major, column-major, TMA-aligned: the kernel reads the layout from them; the two dummy
    flags are the call site's and change nothing)."""
    if not (x.is_contiguous() and out_q.is_contiguous()):
        raise ValueError("per_token_group_fp8_quant: input and output_q must be contiguous")
    if x.numel() % group_size or x.shape[-1] % group_size or out_s.dim() != 2:
        raise ValueError("per_token_group_fp8_quant: groups must tile the last dim and output_s must be 2-D")
    g = x.reshape(-1, group_size).float()
    lo, hi = g.new_full((), fp8_min), g.new_full((), fp8_max)  # fills, not host copies: graph-capturable
    amax = torch.fmax(g.abs(), g.new_full((), eps)).amax(-1, keepdim=True)
    s = amax / fp8_max
    if scale_ue8m0:
        bits = s.abs().clamp(min=1e-10).view(torch.int32)
        s = (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()).bitwise_left_shift(23).view(torch.float32)
    q = torch.fmin(torch.fmax(g / s, lo), hi)
    out_q.copy_(q.view(out_q.shape).to(out_q.dtype))
    out_s.copy_(s.view(out_s.shape))


_def(_lib, "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, "
           "float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
           "bool dummy_is_tma_aligned) -> ()", _per_token_group_fp8_quant)


_moe = torch.library.Library("_moe_C", "FRAGMENT")


def _topk_softplus_sqrt(w_out, ids_out, tei_out, logits, renormalize, scale, bias, input_ids, tid2eid, is_padding,
                        bias_vl=None, image_sentinel_lo=0):
    k = ids_out.shape[1]
    s = torch.nn.functional.softplus(logits.float()).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids.long()].long()
    else:
        ids = torch.topk(s + (bias.float() if bias is not None else 0.0), k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-20)
    w = w * scale
    if is_padding is not None:
        w = torch.where(is_padding[:, None], 0.0, w)
        ids = torch.where(is_padding[:, None], -1, ids)
    w_out.copy_(w)
    ids_out.copy_(ids)
    tei_out.copy_(torch.arange(ids.numel(), device=ids.device, dtype=tei_out.dtype).view_as(tei_out))


def _moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, ntpp, expert_map=None,
                          scatter_idx=None):
    """vLLM's ``moe_align_block_size`` without a host read, so that it can be captured in a CUDA graph: the counts
    by ``scatter_add_`` (``bincount`` reads its maximum on the host), every entry sorted (the invalid ones last and
    sent to a spare slot) and each block's expert found by ``searchsorted`` over the experts' block ends."""
    flat = topk_ids.flatten().long()
    n, dev = flat.numel(), flat.device
    if expert_map is not None:
        flat = torch.where(flat >= 0, expert_map.long()[flat.clamp(min=0)], -1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    cstarts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    e = key[order]
    ec = e.clamp(max=num_experts - 1)
    rank = torch.arange(n, device=dev) - cstarts[ec]
    dest = torch.where(e < num_experts, starts[ec] + rank, sorted_ids.numel())
    buf = torch.full((sorted_ids.numel() + 1,), n, dtype=sorted_ids.dtype, device=dev)
    buf.scatter_(0, dest, order.to(sorted_ids.dtype))
    sorted_ids.copy_(buf[:-1])
    ends = torch.cumsum(padded // block_size, 0)
    owner = torch.searchsorted(ends, torch.arange(expert_ids.numel(), device=dev), right=True)
    expert_ids.copy_(torch.where(owner < num_experts, owner, -1).to(expert_ids.dtype))
    ntpp.copy_(padded.sum().to(ntpp.dtype).expand_as(ntpp))
    if scatter_idx is not None:
        scatter_idx.copy_(torch.where(valid, torch.arange(n, device=dev), -1).view_as(scatter_idx))


def _moe_sum(inp, out, topk_ids=None, expert_map=None):
    x = inp.float()
    if topk_ids is not None and expert_map is not None:
        ok = (topk_ids >= 0) & (expert_map[topk_ids.long().clamp(min=0)] >= 0)
        x = x * ok[..., None]
    out.copy_(x.sum(1).to(out.dtype))


_def(_moe, "topk_softplus_sqrt(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, Tensor "
           "gating_output, bool renormalize, float routed_scaling_factor, Tensor? bias, Tensor? input_ids, Tensor? "
           "tid2eid, Tensor? is_padding, Tensor? bias_vl=None, int image_sentinel_lo=0) -> ()", _topk_softplus_sqrt)
_def(_moe, "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, "
           "Tensor! experts_ids, Tensor! num_tokens_post_pad, Tensor? maybe_expert_map, "
           "Tensor(a!)? scatter_idx=None) -> ()", _moe_align_block_size)
_def(_moe, "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()", _moe_sum)


# ---- DeepGEMM's mHC pre-norm GEMM, the one DeepGEMM call the V4 path makes whatever VLLM_USE_DEEP_GEMM says
def tf32_hc_prenorm_gemm(x, fn, out, sqrsum, num_split):
    """DeepGEMM's ``tf32_hc_prenorm_gemm`` (``vllm.utils.deep_gemm``): ``out [num_split, T, N]`` and
    ``sqrsum [num_split, T]`` hold partial sums over ``num_split`` slices of K that the mHC kernels add up, of
    ``x.float() @ fn.T`` and ``x.float().square().sum(-1)``. Here the whole sums go in split 0 (float32, not TF32)
    and the other splits are zero: the same sums, in a CUDA graph too."""
    xf = x.float()
    out.zero_()
    torch.mm(xf, fn.float().t(), out=out[0])
    sqrsum.zero_()
    sqrsum[0] = xf.square().sum(-1)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after the module ``name`` is executed, before anyone imports from it."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = _real_spec(self, name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _no_deep_gemm_prenorm(module):
    module.tf32_hc_prenorm_gemm = tf32_hc_prenorm_gemm


sys.meta_path.insert(0, _AfterImport({"vllm.utils.deep_gemm": _no_deep_gemm_prenorm}))
