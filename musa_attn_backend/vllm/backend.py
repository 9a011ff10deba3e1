"""vLLM 0.33 v1 attention backend ``TILELANG_MUSA``: ``CommonAttentionMetadata`` -> PagedKVMeta -> our kernels.

No math here. The builder turns vLLM's batch into the shared paged-KV metadata once per batch; the impl writes
K/V with our KV-write op (``do_kv_cache_update``) and runs :func:`musa_attn_backend.kernels.paged_attention`
(TileLang on a GPU, the PyTorch reference on a CPU) on vLLM's NHD cache ``[blocks, block_size, H, 2D]`` seen as
K and V views, in place.

CUDA graphs: the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE`` and, when vLLM runs full CUDA graphs, builds
pure-decode batches into persistent fixed-capacity buffers (so a captured graph reads each replay's metadata) with
the key bound at ``max_model_len`` (the block-table width; so the split count fixed at capture holds at replay);
padded requests (no keys, slot -1) write nothing and read nothing. Other batches (prefill, mixed, speculative)
run outside the full graphs (vLLM's piecewise graphs split at the attention op). ``MUSA_ATTN_VLLM_CUDA_GRAPHS=0``
declares ``NEVER`` instead.
"""

from __future__ import annotations

import dataclasses
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

NAME = "TILELANG_MUSA"
FP8_KV = ("fp8", "fp8_e4m3")


def _leading_decodes(query_start_loc_cpu: torch.Tensor) -> int:
    """How many requests at the front of the batch have one query token (host tensor: no device sync)."""
    longer = ((query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]) != 1).nonzero()
    return int(longer[0, 0]) if longer.numel() else int(query_start_loc_cpu.numel() - 1)


def _new_kv_only(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: Optional[torch.Tensor], first: int) -> bool:
    """Whether requests ``first``.. have no cached prefix (their keys are their new tokens): from host tensors
    (no device sync). ``seq_lens_cpu``: vLLM's ``seq_lens_cpu_upper_bound``, exact for prefill rows and never
    below a row's length, so equality with the query length is exact; None = not known."""
    if seq_lens_cpu is None:
        return False
    q_lens = query_start_loc_cpu[first + 1:] - query_start_loc_cpu[first:-1]
    return bool(q_lens.numel()) and bool((seq_lens_cpu[first:] == q_lens).all())


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

    def _persistent(self, cm: CommonAttentionMetadata) -> PagedKVMeta:
        """Fixed-capacity metadata buffers for decode batches under full CUDA graphs (made once): up to
        ``max_num_seqs`` requests, the runner's block-table width (blocks per request at ``max_model_len``)."""
        if self._graph_meta is None:
            max_bs = max(int(self.vllm_config.scheduler_config.max_num_seqs), cm.num_reqs)
            self._graph_meta = PagedKVMeta.allocate(max_batch=max_bs, max_tokens=max_bs,
                                                    max_pages=max(1, cm.block_table_tensor.shape[1]),
                                                    page_size=self.block_size, device=self.device)
        return self._graph_meta

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TileLangMusaMetadata:
        cm = common_attn_metadata
        n, bs = cm.num_actual_tokens, cm.num_reqs
        slots = cm.slot_mapping[:n]
        out = None
        if self.full_graphs and cm.max_query_len == 1 and n == bs:
            graph_meta = self._persistent(cm)
            if bs <= graph_meta.batch_size and cm.block_table_tensor.shape[1] <= graph_meta.max_pages:
                out = graph_meta
        meta = PagedKVMeta.from_vllm(block_table=cm.block_table_tensor[:bs], query_start_loc=cm.query_start_loc[:bs + 1],
                                     seq_lens=cm.seq_lens[:bs], slot_mapping=slots, page_size=self.block_size,
                                     max_seqlen_q=int(cm.max_query_len),
                                     max_seqlen_k=None if out is not None else int(cm.max_seq_len), out=out)
        if out is None and cm.max_query_len > 1:
            qsl = cm.query_start_loc_cpu[:bs + 1]
            nd = _leading_decodes(qsl) if self.split_mixed else 0
            bound = getattr(cm, "seq_lens_cpu_upper_bound", None)
            meta = dataclasses.replace(meta, num_decodes=nd, new_kv_only=_new_kv_only(
                qsl, bound[:bs] if bound is not None else None, nd))
        return TileLangMusaMetadata(meta=meta, num_actual_tokens=n, slot_mapping=meta.slot_mapping,
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
        # logical [blocks, H, block_size, 2D] -> K and V views [blocks, block_size, H, D]
        k, v = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if self.fp8:
            k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
        return k, v

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
        out = paged_attention(query[:n], k_cache, v_cache, attn_metadata.meta, causal=attn_metadata.causal,
                              sm_scale=self.scale, sliding_window=self.window, logit_softcap=self.logits_soft_cap,
                              sinks=self.sinks, k_scale=k_scale, v_scale=v_scale, new_kv=new_kv)
        output[:n].copy_(out.view(output[:n].shape))
        return output
