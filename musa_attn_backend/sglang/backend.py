"""SGLang 0.5.23 attention backend ``tilelang_musa``: SGLang's batch -> PagedKVMeta -> our kernels.

No math here: the backend hands ``ForwardBatch`` to :mod:`musa_attn_backend.metadata.sglang` once per batch
(``init_forward_metadata``), writes new K/V through the pool's own API and calls
:func:`musa_attn_backend.kernels.paged_attention` once per layer (TileLang on a GPU, the PyTorch reference on
a CPU). Decode and speculative verify (chain drafts) support CUDA-graph capture/replay: the metadata lives in
fixed-capacity buffers that ``init_forward_metadata_out_graph`` rewrites in place, and nothing in the captured
region syncs the host.

Like the vLLM adapter's, this module imports the engine at the top: only :func:`musa_attn_backend.sglang.register`
imports it, after SGLang itself imported.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ..kernels import paged_attention
from ..metadata import PagedKVMeta
from ..metadata import sglang as sglang_meta

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TileLangMusaAttnBackend(AttentionBackend):
    """SGLang's ``AttentionBackend`` for ``--attention-backend tilelang_musa`` (made by :func:`create_backend`)."""

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
    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = sglang_meta.forward_batch_meta(forward_batch, self.req_to_token_pool.req_to_token,
                                                               self.page_size)

    # ------------------------------------------------------------- CUDA graphs (decode, verify)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self._graph_meta = sglang_meta.graph_buffers(self.req_to_token_pool.req_to_token, max_bs, max_num_tokens,
                                                     self.page_size, self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        # Runs before capture and before each replay: rewrite the persistent buffers in place.
        self.forward_metadata = sglang_meta.forward_batch_meta(forward_batch, self.req_to_token_pool.req_to_token,
                                                               self.page_size, out=self._graph_meta)

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
        k_cache = sglang_meta.paged_cache(self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.page_size)
        v_cache = sglang_meta.paged_cache(self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.page_size)
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        window = getattr(layer, "sliding_window_size", None)
        cap = getattr(layer, "logit_cap", None)
        sinks = kwargs.get("sinks", kwargs.get("attn_sink"))
        q = q.reshape(-1, hq, d)
        out = paged_attention(
            q, k_cache, v_cache, self.forward_metadata, causal=causal,
            sm_scale=float(layer.scaling),
            sliding_window=int(window) if window is not None and window >= 0 else None,
            logit_softcap=float(cap) if cap else None,
            sinks=sinks.float() if sinks is not None else None,
            k_scale=getattr(layer, "k_scale", None) if fp8 else None,
            v_scale=getattr(layer, "v_scale", None) if fp8 else None,
            new_kv=None if fp8 else new_kv,
            # SGLang's own output buffer where it set one (then returned as is: SGLang skips its copy)
            out=sglang_meta.attn_output_buffer(fb, q.shape[0], hq, dv, q.dtype),
        )
        return out.reshape(-1, hq * dv)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        causal = getattr(layer, "attn_type", None) != AttentionType.ENCODER_ONLY
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs, causal)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs, True)


def create_backend(model_runner):
    """SGLang's factory for ``--attention-backend tilelang_musa``: checks the device, then builds the DeepSeek-V4
    backend for a V4 model (its pool says so) and the dense backend otherwise."""
    from .dsv4_selection import is_deepseek_v4_runner

    _check_environment(torch.device(model_runner.device))
    if is_deepseek_v4_runner(model_runner):
        from .dsv4 import TileLangMusaDSV4Backend

        return TileLangMusaDSV4Backend(model_runner)
    return TileLangMusaAttnBackend(model_runner)


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
