"""SGLang 0.5.23 attention backend ``tilelang_musa``: SGLang's batch -> PagedKVMeta -> our kernels.

No math here: the backend turns ``ForwardBatch`` into the shared paged-KV metadata once per batch
(``init_forward_metadata``), writes new K/V through the pool's own API and calls
:func:`musa_attn_backend.kernels.paged_attention` once per layer (TileLang on a GPU, the PyTorch reference on
a CPU). Decode and speculative verify (chain drafts) support CUDA-graph capture/replay: the metadata lives in
fixed-capacity buffers that ``init_forward_metadata_out_graph`` rewrites in place, and nothing in the captured
region syncs the host.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..kernels import paged_attention
from ..metadata import PagedKVMeta

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _make_class():
    """The backend class (``TileLangMusaAttnBackend``), made on first use so that importing this module
    does not import SGLang."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class _Backend(AttentionBackend):
        def __init__(self, model_runner):
            super().__init__()
            self.device = torch.device(model_runner.device)
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
            self.page_size = int(model_runner.page_size)
            self.forward_metadata: Optional[PagedKVMeta] = None
            self._graph_meta: Optional[PagedKVMeta] = None
            self.data_type = getattr(model_runner, "dtype", None)
            self.kv_cache_dtype = getattr(self.token_to_kv_pool, "dtype", None)
            _check_model(model_runner, self.token_to_kv_pool)

        # ------------------------------------------------------------- metadata
        def _build(self, fb, out: Optional[PagedKVMeta] = None) -> PagedKVMeta:
            mode = fb.forward_mode
            if mode.is_draft_extend_v2() or mode.is_dllm_extend():
                # These batches carry their query layout in spec_info / block structure, not in
                # extend_seq_lens: refuse rather than attend with the wrong lengths.
                raise NotImplementedError(f"tilelang_musa: forward mode {mode.name} is not supported; the draft "
                                          "model of speculative decoding runs on SGLang's draft backend")
            common = dict(req_to_token=self.req_to_token_pool.req_to_token, req_pool_indices=fb.req_pool_indices,
                          seq_lens=fb.seq_lens, out_cache_loc=fb.out_cache_loc, page_size=self.page_size, out=out)
            # Host-side bounds SGLang already has (no device sync). Under a CUDA graph (out=) the key bound
            # stays the buffers' capacity, so the split count recorded at capture stays valid at replay.
            seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
            if out is None and seq_lens_cpu is not None and seq_lens_cpu.numel():
                common["max_seqlen_k"] = int(seq_lens_cpu.max())
            if mode.is_target_verify():
                # seq_lens count the accepted tokens; each request verifies n draft tokens after them, whose
                # K/V go to out_cache_loc. A chain of drafts attends causally (the verify mask is lower
                # triangular), which is our causal extend with prefix = seq_lens.
                n = _chain_draft_tokens(fb.spec_info)
                prefix = fb.seq_lens
                common["seq_lens"] = prefix + n
                if "max_seqlen_k" in common:
                    common["max_seqlen_k"] += n
                return PagedKVMeta.from_sglang(**common, extend_prefix_lens=prefix,
                                               extend_seq_lens=torch.full_like(prefix, n), max_seqlen_q=n)
            if mode.is_decode_or_idle():
                return PagedKVMeta.from_sglang(**common)
            lens_cpu = getattr(fb, "extend_seq_lens_cpu", None)
            meta = PagedKVMeta.from_sglang(**common, extend_prefix_lens=fb.extend_prefix_lens,
                                           extend_seq_lens=fb.extend_seq_lens,
                                           max_seqlen_q=int(max(lens_cpu)) if lens_cpu is not None and len(lens_cpu)
                                           else None)
            # no cached prefix anywhere (host list): each request's keys are its new tokens
            prefix_cpu = getattr(fb, "extend_prefix_lens_cpu", None)
            if out is None and prefix_cpu is not None and len(prefix_cpu) and not any(prefix_cpu):
                meta = dataclasses.replace(meta, new_kv_only=True)
            return meta

        def init_forward_metadata(self, forward_batch):
            self.forward_metadata = self._build(forward_batch)

        # ------------------------------------------------------------- CUDA graphs (decode)
        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
            width = self.req_to_token_pool.req_to_token.shape[1]
            self._graph_meta = PagedKVMeta.allocate(max_batch=max_bs, max_tokens=max(max_num_tokens, max_bs),
                                                    max_pages=-(-width // self.page_size),
                                                    page_size=self.page_size, device=self.device)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            # Runs before capture and before each replay: rewrite the persistent buffers in place.
            if self._graph_meta is None:
                self.forward_metadata = self._build(forward_batch)
            else:
                self.forward_metadata = self._build(forward_batch, out=self._graph_meta)

        def init_forward_metadata_in_graph(self, forward_batch):
            pass  # everything the kernels read is already in the persistent buffers

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        # ------------------------------------------------------------- forward
        def _attend(self, q, k, v, layer, fb, save_kv_cache, kwargs, causal):
            if layer.is_cross_attention:
                raise NotImplementedError("tilelang_musa: cross-attention layers are not supported")
            new_kv = None
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(fb), k, v,
                                                    getattr(layer, "k_scale", None), getattr(layer, "v_scale", None))
                new_kv = (k, v)  # as written (same dtype: copied as is); a prefill without prefixes may read them
            hq = layer.tp_q_head_num
            d, dv = layer.qk_head_dim, layer.v_head_dim
            k_cache = _paged(self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.page_size)
            v_cache = _paged(self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.page_size)
            fp8 = k_cache.dtype == torch.float8_e4m3fn
            window = getattr(layer, "sliding_window_size", None)
            cap = getattr(layer, "logit_cap", None)
            sinks = kwargs.get("sinks", kwargs.get("attn_sink"))
            out = paged_attention(
                q.reshape(-1, hq, d), k_cache, v_cache, self.forward_metadata, causal=causal,
                sm_scale=float(layer.scaling),
                sliding_window=int(window) if window is not None and window >= 0 else None,
                logit_softcap=float(cap) if cap else None,
                sinks=sinks.float() if sinks is not None else None,
                k_scale=getattr(layer, "k_scale", None) if fp8 else None,
                v_scale=getattr(layer, "v_scale", None) if fp8 else None,
                new_kv=None if fp8 else new_kv,
            )
            return out.reshape(-1, hq * dv)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            causal = getattr(layer, "attn_type", None) != AttentionType.ENCODER_ONLY
            return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs, causal)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs, True)

    _Backend.__name__ = _Backend.__qualname__ = "TileLangMusaAttnBackend"
    return _Backend


_CLASS = None


def backend_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
    return _CLASS


def create_backend(model_runner):
    """SGLang's factory for ``--attention-backend tilelang_musa``."""
    _check_environment(torch.device(model_runner.device))
    return backend_class()(model_runner)


def _chain_draft_tokens(spec_info) -> int:
    """Draft tokens per request of a speculative verify batch whose drafts form a chain (EAGLE / MTP with
    ``topk == 1``, DFlash). Tree-shaped drafts (``topk > 1``, n-gram) need their custom mask: refused."""
    n = getattr(spec_info, "draft_token_num", None)
    topk = getattr(spec_info, "topk", None)
    kind = type(spec_info).__name__
    if n is None or topk != 1 or "Ngram" in kind:
        raise NotImplementedError(
            f"tilelang_musa: speculative verify with {kind} (topk={topk}) uses a tree attention mask, which is "
            "not supported; use chain drafts (--speculative-eagle-topk 1) or another attention backend")
    return int(n)


def _paged(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang's ``[slots, H, D]`` pool as ``[pages, page_size, H, D]`` (whole pages only)."""
    slots = buf.shape[0] - buf.shape[0] % page_size
    return buf[:slots].view(slots // page_size, page_size, *buf.shape[1:])


def _check_model(model_runner, pool) -> None:
    """Refuse layer configurations the kernels cannot serve, naming the config and what is supported."""
    cfg = getattr(model_runner, "model_config", None)
    dtype = getattr(model_runner, "dtype", None) or getattr(pool, "dtype", None)
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tilelang_musa: model dtype {dtype} is not supported; use float16 or bfloat16 "
                         "(float32 on a CPU)")
    kv = getattr(pool, "dtype", None)
    if kv is not None and kv not in SUPPORTED_DTYPES + (torch.float8_e4m3fn,):
        raise ValueError(f"tilelang_musa: KV cache dtype {kv} is not supported; use the model dtype or fp8_e4m3")
    if cfg is not None and getattr(cfg, "is_encoder_decoder", False):
        raise ValueError("tilelang_musa: encoder-decoder (cross-attention) models are not supported")
    if getattr(model_runner, "use_mla_backend", False):
        raise ValueError("tilelang_musa: MLA models are served by the DeepSeek path, not the dense backend")
    if getattr(pool, "requires_physical_write_loc", False):
        raise ValueError("tilelang_musa: the unified KV pool is not supported yet; use the default pool")


def _check_environment(device: torch.device) -> None:
    """On a GPU the TileLang kernels must be usable: fail at start-up with the cause, never fall back."""
    if device.type == "cpu":
        return
    from ..platform import get_platform

    p = get_platform()
    if not p.target_kind:
        raise RuntimeError(f"tilelang_musa: {device.type} device but TileLang cannot target it "
                           f"({'; '.join(p.notes) or 'no TileLang target'}); run `musa-attn doctor`")
    try:
        from .. import _tilelang  # noqa: F401
    except Exception as e:  # a broken TileLang install
        raise RuntimeError(f"tilelang_musa: TileLang does not import ({type(e).__name__}: {e})") from e
    from ..warmup import check_warmup_settings

    check_warmup_settings(device)  # warns where the kernel switches differ from warmup's
