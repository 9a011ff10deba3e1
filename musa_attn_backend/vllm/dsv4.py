"""vLLM 0.33.0's DeepSeek-V4 attention under ``--attention-backend tilelang_musa``: a ``DeepseekV4Attention``
subclass whose attention, SWA insert, compressors and indexer run this package's kernels
(:mod:`musa_attn_backend.kernels.dsv4`: TileLang on a GPU, the float32 references on a CPU), and metadata builders
that need neither FlashMLA nor Triton.

vLLM's V4 model picks its layer class itself; :mod:`.dsv4_selection` makes that choice return
:class:`MusaDeepseekV4Attention` for ``tilelang_musa`` (and by default on a MUSA platform).

What the layer overrides, and with what:

- ``_run_parallel_input_projections``, ``_split_qkv_and_norm``, ``_prepare_and_attn``: the same projections and
  order as vLLM's, run in sequence (no auxiliary CUDA streams, no Triton RMSNorm): the SWA insert, then the
  indexer's queries and its compressor, then the main compressor, then the indexer's scores and the attention.
- ``_fused_qnorm_rope_kv_insert``: ``q_norm_rope`` on the queries (per-head RMSNorm without weight, GPT-J RoPE),
  RoPE of the normed KV row and ``write_kv_v4`` at the SWA slot mapping.
- ``forward_mqa``: one ``sparse_mqa`` call per layer over the FP8 caches as vLLM binds them (packed blocks: every
  kernel addresses ``block * stride(0)``): the 128-token window from the SWA cache, and the compressed rows (the
  indexer's top-k on C4 layers, every row on C128 layers), with the per-head sink. Decode and prefill alike, no
  dequantised workspace.
- ``_o_proj``: inverse RoPE of the output's last 64 dims, the grouped ``wo_a`` (bf16 weights, dequantised once at
  load from an FP8 checkpoint), ``wo_b`` through its own linear layer.
- ``get_padded_num_q_heads``: no padding (our kernels take any head count up to 128).
- The compressors (``DeepseekCompressor.forward``) run ``compress`` on vLLM's paged state cache; the indexer runs
  ``indexer_q`` (vLLM's rules: no Hadamard, power-of-two scales), ``paged_indexer_logits`` and ``indexer_topk``
  into the model's shared ``topk_indices_buffer`` (request-local compressed rows, ``-1`` padded), or, while no
  request has more than top-k compressed rows, fills every candidate without scoring, as vLLM does.

The metadata of every V4 cache group (main C4/C128, SWA, indexer keys, compressor states) is one
:class:`MusaV4Metadata` built by torch (:mod:`..metadata.vllm_dsv4`) into buffers made once. The builders declare
``UNIFORM_BATCH`` CUDA-graph support (``MUSA_ATTN_VLLM_CUDA_GRAPHS``): vLLM's full decode graphs capture the layer,
whose decode step reads no device value on the host and whose shapes follow the batch's padded size and
``max_seq_len`` (``max_model_len`` when vLLM captures: the indexer's key span, the C128 row count and the
all-candidates shortcut are then the longest a replay can need).

Settings the kernels do not serve are refused when the layer is built (:func:`refuse_unsupported`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: F401  (the type we stand for)
from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4Indexer, DeepseekV4IndexerCache
from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorStateCache, DeepseekCompressor
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

from ..config import settings
from ..kernels import dsv4
from ..kernels.dsv4 import MAX_HEADS
from ..kernels.dsv4 import model as dsv4_model
from ..kernels.dsv4.indexer import INDEX_HEADS, MAX_TOPK
from ..metadata import vllm_dsv4 as meta
from ..warmup_dsv4 import refuse_context_parallel

__all__ = ["MusaDeepseekV4Attention", "MusaV4Metadata", "MusaV4MetadataBuilder", "refuse_unsupported"]

# The block of the main (C4 / C128) and indexer-key caches, whatever --block-size says: C4 pages of 64 rows, C128
# pages of 2, indexer pages of 64 (a C128 page needs a multiple of 128 tokens, and vLLM's packed caches cannot split a
# block into smaller kernel blocks). vLLM's SWA cache keeps its own 64-token blocks and the compressor states their
# 4 / 8; --block-size (MUSA's vLLM forces 64 for V4, vLLM's default resolves to 256) then only sets the scheduler's
# granularity, and vLLM's hybrid allocator gives every group its own block size.
BLOCK_TOKENS = 256
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
ROPE = 64
# Indexer logits of one pass, at most: [tokens, compressed rows] float32; longer batches go in token chunks.
INDEXER_LOGITS_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------------- refusals
def refuse_unsupported(vllm_config) -> None:
    """Refuse, naming the setting, a V4 configuration this layer does not serve: a KV cache dtype other than FP8
    (V4's 584-byte rows), context parallelism, the MXFP4 indexer cache, DSpark drafts, the vision variant, a model
    dtype other than bf16, head or indexer shapes outside the kernels'. Any ``--block-size`` is served (see
    :data:`BLOCK_TOKENS`)."""
    cc, pc, mc = vllm_config.cache_config, vllm_config.parallel_config, vllm_config.model_config
    hf = mc.hf_config
    dtype = str(cc.cache_dtype)
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"tilelang_musa: DeepSeek-V4 runs an FP8 KV cache (V4's 584-byte rows): --kv-cache-dtype "
                         f"must be one of {', '.join(KV_CACHE_DTYPES)}; got {dtype}")
    refuse_context_parallel(pc, ("decode_context_parallel_size", "prefill_context_parallel_size"))
    if mc.dtype != torch.bfloat16:
        raise ValueError(f"tilelang_musa: DeepSeek-V4 runs in bfloat16 (--dtype bfloat16); got {mc.dtype}")
    spec = vllm_config.speculative_config
    if spec is not None and getattr(spec, "use_dspark", lambda: False)():
        raise ValueError("tilelang_musa: DSpark speculative decoding (non-causal window indices) is not supported "
                         "for DeepSeek-V4; MTP is")
    if getattr(hf, "vision_n_layers", 0):
        raise ValueError("tilelang_musa: the DeepSeek-V4 vision variant (bidirectional image spans in the window) "
                         "is not supported")
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4

    if dsa_indexer_uses_fp4(vllm_config):
        raise ValueError("tilelang_musa: the MXFP4 indexer cache is not supported for DeepSeek-V4; use the FP8 "
                         "indexer cache (the default)")
    if hf.head_dim != dsv4.D or hf.qk_rope_head_dim != ROPE:
        raise ValueError(f"tilelang_musa: DeepSeek-V4 heads of {dsv4.D} dims with {ROPE} RoPE dims are supported; "
                         f"the model has head_dim {hf.head_dim}, qk_rope_head_dim {hf.qk_rope_head_dim}")
    tp = pc.tensor_parallel_size
    if hf.num_attention_heads // tp > MAX_HEADS:
        raise ValueError(f"tilelang_musa: at most {MAX_HEADS} attention heads a rank; the model has "
                         f"{hf.num_attention_heads} over tensor parallel size {tp}")
    if hf.index_n_heads not in INDEX_HEADS or hf.index_head_dim != dsv4.layout.INDEX_D:
        raise ValueError(f"tilelang_musa: the indexer needs {INDEX_HEADS} heads of {dsv4.layout.INDEX_D} dims; the "
                         f"model has {hf.index_n_heads} of {hf.index_head_dim}")
    if not 1 <= hf.index_topk <= MAX_TOPK:
        raise ValueError(f"tilelang_musa: index_topk must be in [1, {MAX_TOPK}], got {hf.index_topk}")


# --------------------------------------------------------------------------------------------------- metadata
@dataclass
class MusaV4Metadata:
    """One V4 cache group's batch metadata. ``slot_mapping``: the group's write slots, per query token: the token's
    own slot (SWA cache, compressor states) or its compressed row's (main C4/C128 and indexer-key caches:
    ``-1`` unless the token ends a window); ``block_size``: tokens a block (its cache holds ``block_size /
    compress_ratio`` rows a block). ``token_to_req_indices`` and ``positions``: each query token's request and
    position (``-1`` for padding rows)."""

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    compress_ratio: int
    token_to_req_indices: torch.Tensor
    positions: torch.Tensor


class MusaV4MetadataBuilder(AttentionMetadataBuilder[MusaV4Metadata]):
    """Builds :class:`MusaV4Metadata` for any V4 cache group, by torch on the batch's device, into buffers made once
    (the request and position of each token, a compressed group's write slots): every batch's metadata lives at the
    same addresses, so a CUDA graph captured on one batch reads the next batch's at replay. With
    ``MUSA_ATTN_VLLM_CUDA_GRAPHS`` (default on) the builders declare ``UNIFORM_BATCH``: vLLM captures full graphs of
    decode batches whose requests all run the same number of query tokens (1, or 1 + the speculative tokens), as
    its own V4 builders do."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_BATCH if settings().vllm_cuda_graphs else AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        ratio = getattr(kv_cache_spec, "tokens_per_state", 1)
        self.compress_ratio = ratio if isinstance(ratio, int) and ratio > 1 else 1
        n = vllm_config.scheduler_config.max_num_batched_tokens
        self._req = torch.empty(n, dtype=torch.int32, device=device)
        self._pos = torch.empty(n, dtype=torch.int64, device=device)
        self._slots = torch.empty(n, dtype=torch.int64, device=device) if self.compress_ratio > 1 else None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MusaV4Metadata:
        cm = common_attn_metadata
        T = cm.num_actual_tokens
        fits = T <= self._req.numel()  # vLLM's batches never exceed max_num_batched_tokens; a test's may
        req = meta.token_to_req(cm.query_start_loc, T, out=self._req if fits else None)
        pos = meta.token_positions(cm.query_start_loc, cm.seq_lens, req, out=self._pos if fits else None)
        slots = cm.slot_mapping[:T]
        if self.compress_ratio > 1:
            slots = meta.compressed_slot_mapping(pos, req, slots, cm.block_table_tensor, self.kv_cache_spec.block_size,
                                                 self.compress_ratio, out=self._slots if fits else None)
        return MusaV4Metadata(num_reqs=cm.num_reqs, num_actual_tokens=T, max_query_len=cm.max_query_len,
                              max_seq_len=cm.max_seq_len, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
                              block_table=cm.block_table_tensor, slot_mapping=slots,
                              block_size=self.kv_cache_spec.block_size, compress_ratio=self.compress_ratio,
                              token_to_req_indices=req, positions=pos)


class _OurBuilder:
    """A vLLM V4 cache group's attention backend with our metadata builder (:class:`MusaV4MetadataBuilder`), named
    ``VLLM_NAME`` in vLLM."""

    VLLM_NAME: ClassVar[str]

    @classmethod
    def get_name(cls) -> str:
        return cls.VLLM_NAME

    @staticmethod
    def get_builder_cls():
        return MusaV4MetadataBuilder


class MusaV4SparseBackend(_OurBuilder, DeepseekV4SparseMLABackend):
    """The main (C4 / C128) caches: vLLM's spec (256-token blocks, 584-byte rows), our builder."""

    VLLM_NAME = "TILELANG_MUSA_DSV4"

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True


class MusaV4SWABackend(_OurBuilder, DeepseekSparseSWABackend):
    """The sliding-window cache (64-token blocks): our builder (vLLM's plans FlashMLA's scheduler)."""

    VLLM_NAME = "TILELANG_MUSA_DSV4_SWA"


class MusaV4IndexerBackend(_OurBuilder, DeepseekV4IndexerBackend):
    """The indexer-key cache (132-byte rows, 64 a block): vLLM's layouts and block size, our builder."""

    VLLM_NAME = "TILELANG_MUSA_DSV4_INDEXER"


class MusaV4CompressorBackend(_OurBuilder, CompressorBackend):
    """The compressors' float32 state caches: our builder."""

    VLLM_NAME = "TILELANG_MUSA_DSV4_COMPRESSOR"


# --------------------------------------------------------------------------------------------------- helpers
def _v4_blocks(spec):
    """vLLM's spec of a main or indexer-key cache with :data:`BLOCK_TOKENS`-token blocks (None stays None)."""
    if spec is None or spec.block_size == BLOCK_TOKENS:
        return spec
    return dataclasses.replace(spec, block_size=BLOCK_TOKENS)


def _batch_metadata(prefix: str) -> Optional[MusaV4Metadata]:
    """The current batch's metadata of the group holding ``prefix``; None in a profile or dummy run."""
    md = get_forward_context().attn_metadata
    if not isinstance(md, dict):
        return None
    return md[prefix]


def _rows(x: torch.Tensor, n: int, fill: int = -1) -> torch.Tensor:
    """``x``'s first ``n`` entries, padded with ``fill`` where the layer runs more rows than the batch has
    tokens (padding rows)."""
    if x.shape[0] >= n:
        return x[:n]
    return torch.cat([x, x.new_full((n - x.shape[0],) + tuple(x.shape[1:]), fill)])


def _rope_tables(rotary_emb) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each float32 ``[max_pos, 32]`` and contiguous, from vLLM's ``cos_sin_cache [max_pos, 64]``
    (cos first), kept on the module until its table changes."""
    table = rotary_emb.cos_sin_cache
    key = (table.data_ptr(), table.device, table.shape)
    cached = getattr(rotary_emb, "_musa_cos_sin", None)
    if cached is None or cached[0] != key:
        half = table.shape[-1] // 2
        cached = (key, table[:, :half].float().contiguous(), table[:, half:].float().contiguous())
        rotary_emb._musa_cos_sin = cached
    return cached[1], cached[2]


_MM_F32: dict = {}


def _mm_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with float32 output (vLLM's ``torch.mm(..., out_dtype=torch.float32)``); where the device's
    torch has no such matmul, in float32 throughout."""
    kind = x.device.type
    if _MM_F32.get(kind, True):
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (NotImplementedError, RuntimeError, TypeError):
            _MM_F32[kind] = False
    return x.float() @ weight.float().t()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    return (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _dequantised_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as float32, block or channel FP8 scales applied."""
    w = layer.weight.float()
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(layer, "weight_scale", None)
    if scale is None:
        return w
    scale = scale.float()
    if scale.numel() == 1:
        return w * scale
    block = getattr(layer, "weight_block_size", None)
    if block is None:
        return w * scale.view(-1, 1)
    bm, bk = block
    return w * scale.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:w.shape[0], :w.shape[1]]


# --------------------------------------------------------------------------------------------------- compressor
class MusaCompressorStateCache(CompressorStateCache):
    def get_attn_backend(self):
        return MusaV4CompressorBackend


class MusaDeepseekCompressor(DeepseekCompressor):
    """vLLM's compressor (weights, ape, state cache) with :func:`..kernels.dsv4.compress` as its forward: the
    partial states into vLLM's paged float32 state cache (scores with ape, as vLLM stores them), then each window's
    compressed row, normed, roped at its first position and quantised into the compressed cache at the compressed
    slot mapping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state_cache.__class__ = MusaCompressorStateCache

    @classmethod
    def adopt(cls, compressor: DeepseekCompressor) -> None:
        """Make a compressor vLLM's layer built (it has no factory hook for the main one) ours."""
        compressor.__class__ = cls
        compressor.state_cache.__class__ = MusaCompressorStateCache

    def forward(self, kv_score: torch.Tensor, positions: torch.Tensor, rotary_emb) -> None:
        state_md = _batch_metadata(self.state_cache.prefix)
        if state_md is None:
            return
        k_md = _batch_metadata(self.k_cache_prefix)
        cache = self._static_forward_context[self.k_cache_prefix].kv_cache
        n = kv_score.shape[0]
        cos, sin = _rope_tables(rotary_emb)
        dsv4.compress(kv_score.float(), self.ape, positions[:n], _rows(state_md.token_to_req_indices, n),
                      state_md.query_start_loc, state_md.seq_lens, ratio=self.compress_ratio,
                      state=self.state_cache.kv_cache, state_table=state_md.block_table,
                      state_block=state_md.block_size, state_ring=state_md.block_size, norm_weight=self.norm.weight,
                      eps=float(self.rms_norm_eps), cos=cos, sin=sin, cache=cache,
                      out_slots=_rows(k_md.slot_mapping, n), state_rows=_rows(state_md.slot_mapping, n),
                      state_has_ape=True, rotate=False, index_scale="pow2")


# --------------------------------------------------------------------------------------------------- indexer
class MusaIndexerCache(DeepseekV4IndexerCache):
    def get_attn_backend(self):
        return MusaV4IndexerBackend

    def get_kv_cache_spec(self, vllm_config):
        return _v4_blocks(super().get_kv_cache_spec(vllm_config))


class MusaIndexerOp(torch.nn.Module):
    """Stands where vLLM puts its ``SparseAttnIndexer`` (same constructor): the indexer's scores of each query
    token against its request's compressed keys (:func:`..kernels.dsv4.paged_indexer_logits`, the paged cache
    read in place) and their top-k (:func:`..kernels.dsv4.indexer_topk`) into ``topk_indices_buffer[:T]``."""

    def __init__(self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                 max_total_seq_len, topk_indices_buffer, skip_k_cache_insert=True, use_fp4_cache=False,
                 compress_ratio=4) -> None:
        super().__init__()
        if use_fp4_cache:
            raise ValueError("tilelang_musa: the MXFP4 indexer cache is not supported for DeepSeek-V4")
        self.k_cache, self.topk_tokens, self.compress_ratio = k_cache, topk_tokens, compress_ratio
        self.topk_indices_buffer = topk_indices_buffer

    def forward(self, hidden_states: torch.Tensor, q_fp8: torch.Tensor, k: Any, weights: torch.Tensor) -> None:
        md = _batch_metadata(self.k_cache.prefix)
        if md is None:
            return
        n = q_fp8.shape[0]
        req = _rows(md.token_to_req_indices, n)
        pos = _rows(md.positions, n)
        r = self.compress_ratio
        lens = torch.where(req >= 0, torch.div(pos + 1, r, rounding_mode="floor"), 0).to(torch.int32)
        table = md.block_table[req.long().clamp(min=0)]
        rows = md.block_size // r
        max_len = min(max(md.max_seq_len // r, 1), table.shape[1] * rows)
        out = self.topk_indices_buffer
        step = max(1, INDEXER_LOGITS_BYTES // (4 * max_len))
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            logits = dsv4.paged_indexer_logits(q_fp8[lo:hi].unsqueeze(1), weights[lo:hi], self.k_cache.kv_cache,
                                               lens[lo:hi], table[lo:hi], max_len)
            dsv4.indexer_topk(logits, lens[lo:hi], self.topk_tokens, out=out[lo:hi, :self.topk_tokens])


class MusaDeepseekV4Indexer(DeepseekV4Indexer):
    """vLLM's indexer (weights, key cache, compressor) on our kernels: see :class:`MusaIndexerOp`."""

    def _get_cache_cls(self):
        return MusaIndexerCache

    def _get_compressor_cls(self):
        return MusaDeepseekCompressor

    def _get_attn_cls(self):
        return MusaIndexerOp

    def forward(self, hidden_states, qr, compressed_kv_score, indexer_weights, positions, rotary_emb,
                qr_scale=None, skip_compressor=False):
        if not skip_compressor:
            self.compressor(compressed_kv_score, positions, rotary_emb)
        md = _batch_metadata(self.k_cache.prefix)
        if md is None:
            return None, None, None
        if md.max_seq_len // self.compress_ratio <= self.topk_tokens:
            # no request has more compressed rows than top-k: every candidate is chosen, nothing to score
            meta.all_candidates(positions, self.compress_ratio, self.topk_tokens, out=self.topk_indices_buffer)
            return None, None, None
        q = self._wq_b_proj(qr, qr_scale).view(-1, self.n_head, self.head_dim)
        cos, sin = _rope_tables(rotary_emb)
        q8, w = dsv4.indexer_q(q, indexer_weights, positions, cos, sin,
                               weight_scale=self.softmax_scale * self.n_head ** -0.5, rotate=False, scale="pow2",
                               bf16_rope=True)
        return q8, None, w


# --------------------------------------------------------------------------------------------------- the layer
class MusaDeepseekV4Attention(DeepseekV4Attention):
    """DeepSeek-V4's attention layer on this package's kernels (see the module docstring)."""

    backend_cls = MusaV4SparseBackend
    swa_backend_cls = MusaV4SWABackend

    def __init__(self, vllm_config, prefix: str, topk_indices_buffer=None, aux_stream_list=None) -> None:
        refuse_unsupported(vllm_config)
        # no auxiliary streams: the projections and the indexer run in sequence on the current stream
        super().__init__(vllm_config, prefix, topk_indices_buffer, None)
        if self.compressor is not None:
            MusaDeepseekCompressor.adopt(self.compressor)
        self._wo_a: Optional[torch.Tensor] = None
        self._capture_wo_a_at_load()

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return num_heads

    def _get_indexer_cls(self, vllm_config):
        return MusaDeepseekV4Indexer

    def get_kv_cache_spec(self, vllm_config):
        return _v4_blocks(super().get_kv_cache_spec(vllm_config))

    # --- weights
    def _capture_wo_a_at_load(self) -> None:
        """Keep ``wo_a`` as bf16 ``[groups, o_lora_rank, heads_per_group * head_dim]`` for the grouped projection,
        taken before its quantisation method re-lays its weight out for ordinary linear use (which ``_o_proj``
        never makes)."""
        method = self.wo_a.quant_method
        original = method.process_weights_after_loading

        def capture(layer: torch.nn.Module) -> None:
            self._set_wo_a(layer)
            original(layer)

        method.process_weights_after_loading = capture

    def _set_wo_a(self, layer: torch.nn.Module) -> None:
        w = _dequantised_weight(layer).to(torch.bfloat16)
        self._wo_a = w.view(self.n_local_groups, self.o_lora_rank, -1).contiguous()

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        _rope_tables(self.rotary_emb)
        if self._wo_a is None:
            self._set_wo_a(self.wo_a)

    # --- the projections, in sequence
    def _run_parallel_input_projections(self, hidden_states):
        qr_kv = self._fused_wqa_wkv_gemm(hidden_states)
        kv_score = indexer_weights = indexer_kv_score = None
        if self.compressor is not None:
            kv_score = _mm_f32(hidden_states, self.compressor.fused_wkv_wgate.weight)
        if self.indexer is not None:
            indexer_weights, _ = self.indexer.weights_proj(hidden_states)
            indexer_kv_score = _mm_f32(hidden_states, self.indexer.compressor.fused_wkv_wgate.weight)
        return qr_kv, kv_score, indexer_kv_score, indexer_weights

    def _split_qkv_and_norm(self, qr_kv):
        qr, kv = qr_kv.split([self.q_lora_rank, self.head_dim], dim=-1)
        return _rms_norm(qr, self.q_norm.weight, self.eps), None, _rms_norm(kv, self.kv_norm.weight, self.eps)

    def _prepare_and_attn(self, hidden_states, qr, kv, qr_scale, kv_score, indexer_kv_score, indexer_weights,
                          positions, o_padded) -> None:
        attn_metadata = get_forward_context().attn_metadata
        q = self._wq_b_proj(qr, qr_scale).view(-1, self.n_local_heads, self.head_dim)
        q = self._fused_qnorm_rope_kv_insert(q, kv, positions, attn_metadata)
        index_q = index_weights = None
        if self.indexer is not None:
            index_q, _, index_weights = self.indexer(hidden_states, qr, indexer_kv_score, indexer_weights, positions,
                                                     self.indexer_rotary_emb, qr_scale)
        if self.compressor is not None:
            self.compressor(kv_score, positions, self.rotary_emb)
        self._sparse_indexer_and_attn(hidden_states, index_q, None, index_weights, q, kv, positions, o_padded)

    def _sparse_indexer_and_attn(self, hidden_states, index_q, index_q_scale, index_weights, q, kv, positions,
                                 out) -> None:
        if self.indexer is not None and index_q is not None:
            self.indexer.indexer_op(hidden_states, index_q, None, index_weights)
        self.forward_mqa(q, kv, positions, out)

    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):
        """Queries: per-head RMSNorm (no weight) and RoPE. KV: RoPE of the normed row, then its FP8 row written at
        the SWA slot mapping (not in a profile run)."""
        cos, sin = _rope_tables(self.rotary_emb)
        q = dsv4_model.q_norm_rope(q, self.eps, cos, sin, positions)
        if not isinstance(attn_metadata, dict):
            return q
        md = attn_metadata[self.swa_cache_layer.prefix]
        k = kv.to(torch.bfloat16, copy=True)
        dsv4_model.rope_(k[:, -ROPE:], cos, sin, positions)
        dsv4.write_kv_v4(k, self.swa_cache_layer.kv_cache, _rows(md.slot_mapping, k.shape[0]))
        return q

    # --- attention
    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor) -> None:
        """``output [T, heads, 512]`` = sparse attention of ``q`` over the token's window rows and (C4: its indexer's
        top-k, C128: all) compressed rows, with the per-head sink; zeros in a profile run."""
        swa = _batch_metadata(self.swa_cache_layer.prefix)
        if swa is None:
            output.zero_()
            return
        n = q.shape[0]
        main = _batch_metadata(self.prefix) if self.compress_ratio > 1 else None
        window, compressed = meta.attention_indices(
            positions[:n], _rows(swa.token_to_req_indices, n), swa.block_table, swa.block_size, self.window_size,
            self.compress_ratio, None if main is None else main.block_table, 0 if main is None else main.block_size,
            self.topk_indices_buffer[:n] if self.compress_ratio == 4 else None, 0 if main is None else main.max_seq_len)
        extra = {} if compressed is None else dict(extra_cache=self.kv_cache, extra_indices=compressed)
        dsv4.sparse_mqa(q, self.swa_cache_layer.kv_cache, window, sink=self.attn_sink, sm_scale=self.scale,
                        out=output, **extra)

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE of the output's last 64 dims, the grouped ``wo_a``, then ``wo_b``."""
        n = o.shape[0]
        if get_forward_context().attn_metadata is None:
            return o.new_zeros(n, self.hidden_size)
        cos, sin = _rope_tables(self.rotary_emb)
        o = o.contiguous()
        dsv4_model.rope_(o[..., -ROPE:], cos, sin, positions[:n], inverse=True)
        # the group width spelled out, not -1: a batch of no tokens (T = 0) has no size to infer it from
        width = o.shape[1] * o.shape[2] // self.n_local_groups
        g = o.view(n, self.n_local_groups, width).transpose(0, 1)  # [groups, T, heads_per_group * 512]
        z = torch.bmm(g, self._wo_a.transpose(1, 2))  # [groups, T, o_lora_rank]
        return self.wo_b(z.transpose(0, 1).flatten(1))
