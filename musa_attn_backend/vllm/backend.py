"""vLLM 0.33 v1 attention backend ``TILELANG_MUSA``: ``CommonAttentionMetadata`` -> PagedKVMeta -> our kernels.

No math here. The builder hands vLLM's batch to :mod:`musa_attn_backend.metadata.vllm` once per batch; the impl
writes K/V with our KV-write op (``do_kv_cache_update``) and runs :func:`musa_attn_backend.kernels.paged_attention`
(TileLang on a GPU, the PyTorch reference on a CPU) on vLLM's NHD cache ``[blocks, block_size, H, 2D]`` seen as
K and V views, in place, writing into vLLM's preallocated output.

CUDA graphs: the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE`` and, when vLLM runs full CUDA graphs, builds
pure-decode batches into persistent fixed-capacity buffers (so a captured graph reads each replay's metadata) with
the key bound at ``max_model_len`` (the block-table width; so the split count fixed at capture holds at replay);
padded requests (no keys, slot -1) write nothing and read nothing. Other batches (prefill, mixed, speculative)
run outside the full graphs (vLLM's piecewise graphs split at the attention op). ``MUSA_ATTN_VLLM_CUDA_GRAPHS=0``
declares ``NEVER`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..config import settings
from ..kernels import paged_attention, write_kv
from ..metadata import PagedKVMeta
from ..metadata import vllm as vllm_meta

NAME = "TILELANG_MUSA"
FP8_KV = ("fp8", "fp8_e4m3")


@dataclass
class TileLangMusaMetadata:
    meta: PagedKVMeta
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    causal: bool = True


class TileLangMusaBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type["TileLangMusaImpl"]:
        return TileLangMusaImpl

    @staticmethod
    def get_builder_cls() -> type["TileLangMusaMetadataBuilder"]:
        return TileLangMusaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # one kernel for every page size

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBNHC,)  # NHD: tokens of a block contiguous, K|V per head

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 16 == 0 and 16 <= head_size <= 256

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True


class TileLangMusaMetadataBuilder(AttentionMetadataBuilder[TileLangMusaMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if settings().vllm_cuda_graphs
                else AttentionCGSupport.NEVER)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from ..warmup import check_warmup_settings

        check_warmup_settings(torch.device(device))  # warns where the kernel switches differ from warmup's
        self.block_size = kv_cache_spec.block_size
        mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
        self.full_graphs = settings().vllm_cuda_graphs and mode is not None and mode.has_full_cudagraphs()
        self._graph_meta: Optional[PagedKVMeta] = None
        self.split_mixed = settings().split_mixed
        if self.split_mixed:
            self.reorder_batch_threshold = 1  # vLLM puts single-token (decode) requests first

    def _graph_buffers(self, cm: CommonAttentionMetadata) -> Optional[PagedKVMeta]:
        """The persistent metadata buffers (made once) for a pure-decode batch under full CUDA graphs that fits
        them; None for every other batch (it gets tensors of its own)."""
        if not (self.full_graphs and vllm_meta.is_uniform_decode(cm)):
            return None
        if self._graph_meta is None:
            self._graph_meta = vllm_meta.graph_buffers(cm, self.vllm_config.scheduler_config.max_num_seqs,
                                                       self.block_size, self.device)
        return self._graph_meta if vllm_meta.graph_buffers_fit(self._graph_meta, cm) else None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TileLangMusaMetadata:
        cm = common_attn_metadata
        meta = vllm_meta.common_metadata_meta(cm, self.block_size, out=self._graph_buffers(cm),
                                              split_decodes=self.split_mixed)
        return TileLangMusaMetadata(meta=meta, num_actual_tokens=cm.num_actual_tokens, slot_mapping=meta.slot_mapping,
                                    causal=cm.causal)


class TileLangMusaImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes=None, sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, sinks: Optional[torch.Tensor] = None,
                 **kwargs) -> None:
        if alibi_slopes is not None:
            raise ValueError(f"{NAME}: ALiBi is not supported")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"{NAME}: attention type {attn_type} is not supported (decoder only)")
        if kv_cache_dtype not in TileLangMusaBackend.supported_kv_cache_dtypes:
            raise ValueError(f"{NAME}: kv_cache_dtype {kv_cache_dtype!r} is not supported; "
                             f"use one of {TileLangMusaBackend.supported_kv_cache_dtypes}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        # vLLM's window n covers n keys including the query's own: our left window is n - 1.
        self.window = sliding_window - 1 if sliding_window else None
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype in FP8_KV
        self.logits_soft_cap = logits_soft_cap or None
        self.sinks = sinks
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def _caches(self, kv_cache: torch.Tensor):
        return vllm_meta.kv_cache_views(kv_cache, self.head_size, self.fp8)

    def _scales(self, layer):
        if not self.fp8:
            return None, None
        return getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # the layer reads another layer's cache
        k_cache, v_cache = self._caches(kv_cache)
        n = slot_mapping.numel()
        k_scale, v_scale = self._scales(layer)
        write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{NAME}: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = self._caches(kv_cache)
        k_scale, v_scale = self._scales(layer)
        # the new K/V as written into the cache (this layer wrote them: not a KV-sharing layer), for a prefill
        # without cached prefixes to read instead of the cache
        new_kv = (key[:n], value[:n]) if key is not None and value is not None \
            and self.kv_sharing_target_layer_name is None and not self.fp8 else None
        # the kernels write vLLM's output rows in place (no copy): [T, H, Dv] as vLLM allocates it ([T, H * Dv]
        # split by its last dimension, not by view(n, H, -1): a batch of no tokens has no size to infer -1 from)
        out = output[:n] if output.dim() == 3 else output[:n].unflatten(-1, (self.num_heads, -1))
        paged_attention(query[:n], k_cache, v_cache, attn_metadata.meta, causal=attn_metadata.causal,
                        sm_scale=self.scale, sliding_window=self.window, logit_softcap=self.logits_soft_cap,
                        sinks=self.sinks, k_scale=k_scale, v_scale=v_scale, new_kv=new_kv, out=out)
        return output
