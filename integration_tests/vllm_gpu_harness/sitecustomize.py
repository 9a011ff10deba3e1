"""The MUSA situation for vLLM 0.33.0 on a CUDA GPU, for the engine tests only (issue 40): vLLM installed
python-only (the lent GPU's torch 2.11 cannot load its compiled extensions), so ``vllm._C``, ``vllm._moe_C``,
flash-attention, FlashInfer and DeepGEMM are absent, as they are on MUSA. Put this folder first on PYTHONPATH: as
``sitecustomize`` it runs in every Python process vLLM starts (the model registry's inspection subprocess and the
engine core included). It

- answers vLLM's capability queries (``cutlass_scaled_mm_supports_*``) "no";
- lets ``vllm.vllm_flash_attn`` import without its extensions (its interface module reports FA2/FA3 unavailable);
- turns off the FlashInfer sampler and DeepGEMM;
- registers torch forms, under vLLM's own op names and schemas, of the compiled ops the tiny V4's path still
  reaches outside this package's layer: RMSNorm (plain and fused add), SiluAndMul (plain and clamped), the V4
  router's ``topk_softplus_sqrt``, ``moe_align_block_size`` and ``moe_sum`` for vLLM's Triton experts, and the
  two memory aliases model runner V2 and CUDA graphs take (``get_cuda_view_from_cpu_tensor``, ``weak_ref_tensor``).

Never part of the package's CUDA path: a served V4 on MUSA gets these from the platform's vLLM."""
MUSA_VLLM_HARNESS = True

import os

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else Sampler.__init__ imports flashinfer (absent)
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")  # keep mHC on TileLang even if a deep_gemm package is on the path

import torch
_lib = torch.library.Library("_C", "FRAGMENT")
def _q(name):  # capability queries: answer "not supported"
    _lib.define(f"{name}(int cuda_device_capability) -> bool")
    _lib.impl(name, lambda cap: False, "CompositeExplicitAutograd")
for n in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported",
          "cutlass_scaled_mm_supports_fp4"):
    _q(n)

import importlib.abc, importlib.machinery, importlib.util, os, sys


class _FaPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """vllm.vllm_flash_attn without its ImportError: the package raises when neither _vllm_fa2_C nor _vllm_fa3_C
    loads; its flash_attn_interface imports fine and reports FA2/FA3 unavailable."""

    def find_spec(self, name, path, target=None):
        if name != "vllm.vllm_flash_attn":
            return None
        sys.meta_path.remove(self)
        try:
            real = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
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
    flat = topk_ids.flatten().long()
    n = flat.numel()
    if expert_map is not None:
        flat = torch.where(flat >= 0, expert_map.long()[flat.clamp(min=0)], -1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    cstarts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)[: int(valid.sum())]
    e = key[order]
    rank = torch.arange(order.numel(), device=flat.device) - cstarts[e]
    sorted_ids.fill_(n)
    sorted_ids[starts[e] + rank] = order.to(sorted_ids.dtype)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_size)
    expert_ids.fill_(-1)
    expert_ids[: blocks.numel()] = blocks.to(expert_ids.dtype)
    ntpp.fill_(0)
    ntpp += padded.sum().to(ntpp.dtype)
    if scatter_idx is not None:
        scatter_idx.copy_(torch.where(valid, torch.arange(n, device=flat.device), -1).view_as(scatter_idx))


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
