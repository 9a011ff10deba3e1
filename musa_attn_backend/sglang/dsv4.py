"""SGLang 0.5.23's DeepSeek-V4 attention under ``tilelang_musa``: a subclass of SGLang's ``DeepseekV4AttnBackend``
that keeps its metadata, index translation and CUDA-graph logic and runs this package's kernels.

- Sparse attention, decode and prefill: ``self._flash_mla_with_kvcache`` is
  :func:`..kernels.dsv4.flash_mla_with_kvcache`
  (FlashMLA's signature over :func:`..kernels.dsv4.sparse_mqa`: TileLang on a GPU, the reference on a CPU). Prefill
  takes the same call (SGLang's sparse-prefill route, a bf16 workspace through FlashMLA's prefill kernel and three
  Triton kernels, is off), so both read the FP8 caches directly.
- Metadata: SGLang's builders run unchanged except for the steps that call FlashMLA's planner (its object is our
  :class:`..kernels.dsv4.FlashMLASchedMeta`, which keeps the scheduled program's plan per batch and kind of
  layer), Triton index kernels (torch ports in
  :mod:`..metadata.sglang_dsv4`, graph-safe) and the JIT compressor planner (our compressors read SGLang's state
  rings through a table instead). These are module functions of SGLang's backend with no method seam; they are
  rebound once per process to dispatchers that serve SGLang's original unless this backend was built in the
  process.
- The indexer metadata is built without DeepGEMM's schedule (our paged logits split their own work).

- The compressors (``forward_core_compressor`` and ``forward_indexer_compressor``, both: SGLang's mixin defines
  them as aliases of one method) run :func:`..kernels.dsv4.compress` on SGLang's own state rings, addressed
  through a table (:func:`..metadata.sglang_dsv4.compress_call`), keeping the positions SGLang keeps.
- The C4 indexer (``forward_c4_indexer``) runs ``indexer_q``, the indexer compressor, ``paged_indexer_logits`` and
  ``indexer_topk`` into SGLang's ``c4_sparse_page_indices``.
- The SWA rows the model writes through the pool (``set_swa_key_buffer_radix_fused_norm_rope``, JIT CUDA in
  SGLang) go through :func:`..kernels.dsv4.norm_rope_write_kv_v4`, set on this backend's pool only.
- Settings the kernels do not serve are refused at construction (:func:`refuse_unsupported`).
- Batches with no token (SGLang's unpadded IDLE batches on data-parallel attention ranks) get empty results
  without metadata; padded IDLE rows are no request's: the compressors and the indexer skip them.

Elsewhere: the model-side kernels around attention (q norm + RoPE, inverse RoPE, mHC, the clamped SwiGLU) are
installed by :mod:`.model_hooks`, and SGLang's MTP draft factories build this backend through :mod:`.drafts`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types

import torch
import sglang.srt.layers.attention.deepseek_v4_backend as v4
from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata

from ..kernels import dsv4
from ..kernels.dsv4 import layout as dsv4_layout
from ..metadata import sglang_dsv4
from ..warmup_dsv4 import refuse_context_parallel
from . import model_hooks

logger = logging.getLogger(__name__)

_state = {"active": False, "installed": False}


def _ours_or_theirs(name: str, ours):
    """Rebind ``v4.<name>`` to call ``ours`` once this backend exists in the process, SGLang's original before."""
    theirs = getattr(v4, name)

    @functools.wraps(theirs)
    def dispatch(*args, **kwargs):
        return (ours if _state["active"] else theirs)(*args, **kwargs)

    setattr(v4, name, dispatch)


def install_seams() -> None:
    """Rebind SGLang's module-level metadata steps (idempotent)."""
    if _state["installed"]:
        return
    # our FlashMLA scheduler metadata: SGLang makes one per batch and kind of layer, and fresh ones before a CUDA
    # graph capture, so the scheduled program plans once per batch (inside the graph) and every layer reuses it
    _ours_or_theirs("_create_flashmla_metadata", lambda: dsv4.get_mla_metadata()[0])
    _ours_or_theirs("_init_compression_metadata_triton", sglang_dsv4.init_compression_metadata)
    _ours_or_theirs("fill_all_compressed_indices", sglang_dsv4.fill_all_compressed_indices)
    _ours_or_theirs("create_paged_compressor_data", lambda *a, **k: None)
    _state["installed"] = True


class _IndexerMetadata(PagedIndexerMetadata):
    """SGLang's indexer metadata with no DeepGEMM schedule and no JIT top-k plan: our kernels need neither."""

    def __post_init__(self):
        self.deep_gemm_metadata = None
        self.topk_metadata = torch.empty((0,))
        if self.page_size % self.compress_ratio:
            raise ValueError(f"tilelang_musa: compress ratio {self.compress_ratio} must divide the page size "
                             f"{self.page_size}")


@contextlib.contextmanager
def _flash_mla_interface_if_absent():
    """SGLang's constructor imports its FlashMLA interface on CUDA, which imports FlashMLA itself; where FlashMLA
    is not installed, a stand-in serves that one import (its entry is ours; the constructor's result is replaced
    right after) and is removed again, so nothing else in the process sees it."""
    name = "sglang.kernels.ops.attention.flash_mla_interface"
    try:
        importlib.import_module(name)
        yield
        return
    except ImportError:
        pass
    parent = importlib.import_module("sglang.kernels.ops.attention")
    stand_in = types.ModuleType(name)
    stand_in.flash_mla_with_kvcache = dsv4.flash_mla_with_kvcache
    stand_in.SPLIT_KV_MIN_TOPK = 1 << 30
    sys.modules[name] = stand_in
    setattr(parent, "flash_mla_interface", stand_in)
    try:
        yield
    finally:
        sys.modules.pop(name, None)
        if getattr(parent, "flash_mla_interface", None) is stand_in:
            delattr(parent, "flash_mla_interface")


def refuse_unsupported(model_runner) -> None:
    """Refuse, naming the setting, a V4 configuration our kernels do not serve: pages other than 256 tokens, a KV
    cache dtype other than FP8 e4m3, a KV layout other than V4's 584-byte rows, context parallelism."""
    args = model_runner.server_args
    page = getattr(model_runner, "page_size", None) or getattr(args, "page_size", None)
    if page != 256:
        raise ValueError(f"tilelang_musa: DeepSeek-V4 needs --page-size 256 (its caches are laid out in 256-token "
                         f"pages); got {page}")
    dtype = str(getattr(args, "kv_cache_dtype", "auto"))
    if dtype not in ("auto", "fp8_e4m3"):
        raise ValueError(f"tilelang_musa: DeepSeek-V4 runs an FP8 e4m3 KV cache (--kv-cache-dtype fp8_e4m3 or auto); "
                         f"got --kv-cache-dtype {dtype}")
    refuse_context_parallel(args, ("attn_cp_size", "dcp_size"))
    if getattr(args, "enable_prefill_cp", False):
        raise ValueError("tilelang_musa: --enable-prefill-cp (context-parallel prefill) is not supported for "
                         "DeepSeek-V4")
    pool = model_runner.token_to_kv_pool
    layouts = {"SWA": pool.get_swa_key_layout()} if hasattr(pool, "get_swa_key_layout") else {}
    for i, ratio in enumerate(getattr(pool, "compression_ratios", []) or []):
        if ratio:
            try:
                layouts[f"layer {i} (ratio {ratio})"] = pool.get_extra_key_layout(i)
            except (KeyError, IndexError):  # a layer this rank does not hold (pipeline stages)
                continue
    for where, layout in layouts.items():
        if str(getattr(layout, "value", layout)) != "v4":
            raise ValueError(f"tilelang_musa: the {where} cache has the {getattr(layout, 'value', layout)} layout "
                             "(SGLANG_DSV4_KV_LAYOUT / SGLANG_DSV4_COMPRESSED_KV_LAYOUT); only V4's 584-byte FP8 "
                             "rows (v4) are supported")


class TileLangMusaDSV4Backend(v4.DeepseekV4AttnBackend):
    """``--attention-backend tilelang_musa`` for a DeepSeek-V4 model (made by ``create_backend``)."""

    def __init__(self, model_runner, **kwargs):
        refuse_unsupported(model_runner)
        install_seams()
        model_hooks.log_replaced()
        _state["active"] = True
        with _flash_mla_interface_if_absent():
            super().__init__(model_runner, **kwargs)
        if self.is_dsv41:
            raise ValueError("tilelang_musa: DeepSeek-V4.1 checkpoints (compress ratios 1 and 2) are not supported; "
                             "V4's ratios 0, 4 and 128 are")
        self._flash_mla_with_kvcache = dsv4.flash_mla_with_kvcache
        self._swa_interleaved = False
        self._flashmla_split_kv_min_topk = 1 << 30  # only V4.1 consults it
        # the model writes its SWA rows through this pool method (JIT CUDA in SGLang): ours, on this pool only
        self.token_to_kv_pool.set_swa_key_buffer_radix_fused_norm_rope = self._store_swa_norm_rope

    def _store_swa_norm_rope(self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions, q=None):
        """The pool's ``set_swa_key_buffer_radix_fused_norm_rope``: RMSNorm + RoPE + FP8 store of the SWA rows."""
        if q is not None:
            raise ValueError("tilelang_musa: RoPE of q fused into the K store (SGLang's ROCm path) is not supported")
        pool = self.token_to_kv_pool
        cos, sin = sglang_dsv4.rope_table(freqs_cis)
        cache = dsv4.paged_view(pool.get_swa_raw_buffer(layer_id).view(torch.uint8), pool.swa_page_size)
        # [T, 512] rows ([T, 1, 512] from some callers); the width named, not -1: T may be 0 (an IDLE rank)
        dsv4.norm_rope_write_kv_v4(kv.reshape(-1, kv.shape[-1]), kv_weight, float(eps), cos, sin, positions, cache,
                                   swa_loc)

    def _use_sparse_prefill(self, forward_batch, *, num_qo_tokens: int) -> bool:
        return False  # prefill through _flash_mla_with_kvcache as well: sparse_mqa on the FP8 caches

    # ------------------------------------------------------------- batches with no token
    # SGLang runs batches of 0 tokens on data-parallel attention ranks that have no request (ForwardMode.IDLE,
    # unpadded under DP SUM_LEN): its eager runner then builds no metadata and sets ``forward_metadata = None``
    # (model_executor/runner/eager_runner.py, _execute_idle), and the V4 attention skips the backend when its input
    # has no row, unless the input is scattered over attention TP (models/deepseek_v4.py, the attention's
    # forward). Padded IDLE batches (DP MAX_LEN, CUDA graphs) have rows and take the ordinary path. SGLang's own
    # metadata builder fails on a batch with no request (``seq_lens_cpu.max()`` of an empty tensor), and every
    # method below would read the missing metadata; with no row there is nothing to compute, so each of them
    # returns its empty result before reading any.

    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.seq_lens.shape[0] == 0 and not (self.mtp_enabled and forward_batch.forward_mode.is_idle()):
            self.forward_metadata = None  # no request: what SGLang's eager runner does for an unpadded IDLE batch
            return
        super().init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch, *args, **kwargs):
        if q.shape[0] == 0:  # no query row: the empty [0, heads, v_head_dim] output, no metadata read
            return q.new_empty((0, q.shape[1], layer.v_head_dim))
        return super().forward(q, k, v, layer, forward_batch, *args, **kwargs)

    def init_forward_metadata_indexer(self, core_attn_metadata, *, compress_ratio: int = 4,
                                      use_prefill_cuda_graph: bool = False, rows_per_request: int = 1):
        if compress_ratio != 4:
            raise ValueError(f"tilelang_musa: an indexer of compress ratio {compress_ratio} (V4.1) is not supported")
        return _IndexerMetadata(
            page_size=self.page_size, compressed_page_size=self.page_size // compress_ratio,
            page_table=core_attn_metadata.page_table, compressed_seq_lens=core_attn_metadata.c4_topk_lengths_raw,
            use_topk_v2=False, use_prefill_cuda_graph=use_prefill_cuda_graph, compress_ratio=compress_ratio,
            rows_per_request=rows_per_request)

    # ------------------------------------------------------------- compressors
    def _compress(self, x, forward_batch, layer_id, compressor) -> None:
        # IDLE (padded rows included: they are no request's tokens) or no token: nothing to compress or keep
        if forward_batch.forward_mode.is_idle() or x.shape[0] == 0:
            return
        states = compressor.get_state_pool(self)
        if states.online:
            raise ValueError("tilelang_musa: SGLANG_OPT_USE_ONLINE_COMPRESS (the online C128 state) is not supported; "
                             "unset it")
        if states.kv_score_buffer.kv_score.dtype != torch.float32:
            raise ValueError(f"tilelang_musa: a {states.kv_score_buffer.kv_score.dtype} compressor state "
                             "(SGLANG_DSV4_COMPRESS_STATE_DTYPE) is not supported; float32, SGLang's default, is")
        pool = self.token_to_kv_pool
        ratio = compressor.ratio
        kv_score = compressor.compute_kv_score(x, forward_batch)
        T = kv_score.shape[0]
        if compressor.is_in_indexer:
            cache = dsv4.paged_view(pool.get_index_k_with_scale_buffer(layer_id).view(torch.uint8),
                                    pool.get_index_k_page_size(ratio), dsv4_layout.INDEX_ROW_BYTES)
        else:
            cache = dsv4.paged_view(pool.get_extra_key_buffer(layer_id).view(torch.uint8),
                                    pool.get_extra_key_page_size(layer_id))
        fb = forward_batch
        lens = fb.extend_seq_lens if getattr(fb, "extend_seq_lens", None) is not None else torch.full(
            (fb.batch_size,), T // max(fb.batch_size, 1), dtype=torch.int32, device=kv_score.device)
        call = sglang_dsv4.compress_call(
            ratio=ratio, positions=fb.positions[:T], extend_lens=lens, req_pool_indices=fb.req_pool_indices,
            req_to_token=self.req_to_token, full_to_swa=pool.full_to_swa_index_mapping,
            swa_page_size=states.swa_page_size or self.page_size, ring=states.ring_size,
            request_scoped=states.request_scoped)
        cos, sin = sglang_dsv4.rope_table(compressor.freqs_cis)
        out_loc = getattr(self.forward_metadata.core_metadata, f"c{ratio}_out_loc")[:T]
        dsv4.compress(kv_score, sglang_dsv4.checkpoint_ape(compressor.ape, ratio, compressor.ape_converted),
                      ratio=ratio, state=states.kv_score_buffer.kv_score, norm_weight=compressor.norm.weight,
                      eps=float(compressor.norm.variance_epsilon), cos=cos, sin=sin, cache=cache, out_slots=out_loc,
                      state_has_ape=False, rotate=compressor.rotate, index_scale="exact", **call)

    def forward_core_compressor(self, x, forward_batch, layer_id, compressor):
        self._compress(x, forward_batch, layer_id, compressor)

    def forward_indexer_compressor(self, x, forward_batch, layer_id, compressor):
        self._compress(x, forward_batch, layer_id, compressor)

    # ------------------------------------------------------------- C4 indexer
    def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, alt_streams=None, enable_multi_stream=False,
                           q_lora_ready=None, skip_compressor=False, q_lora_quant=None):
        """SGLang's C4 indexer on our kernels: q (``wq_b``, then RoPE, Hadamard, FP8 and the weight scale), the
        indexer compressor, the paged logits over the indexer-key cache and the top-k written as compressed
        slots into ``c4_sparse_page_indices`` (and the positions into ``c4_sparse_raw_indices`` where the
        metadata has them)."""
        if forward_batch.forward_mode.is_idle() or x.shape[0] == 0:  # no request's token: no row to select for
            return
        if c4_indexer.use_fp4_indexer:
            raise ValueError("tilelang_musa: the FP4 indexer cache is not supported; the FP8 one is")
        md = self.forward_metadata
        im, core = md.indexer_metadata, md.core_metadata
        positions = core.positions
        n = min(x.shape[0], q_lora.shape[0], positions.shape[0])
        x, q_lora, positions = x[:n], q_lora[:n], positions[:n]
        weights = c4_indexer.compute_weights(x, skip_scale=True)
        q, _ = c4_indexer.wq_b(q_lora if q_lora_quant is None else q_lora_quant)
        cos, sin = sglang_dsv4.rope_table(c4_indexer.freqs_cis)
        q8, w = dsv4.indexer_q(q.view(n, c4_indexer.n_local_heads, c4_indexer.head_dim), weights.view(n, -1),
                               positions, cos, sin, weight_scale=c4_indexer.weight_scale)
        if not skip_compressor:
            self.forward_indexer_compressor(x, forward_batch, c4_indexer.layer_id, c4_indexer.compressor)
        out = core.c4_sparse_page_indices
        rows = out.shape[0]

        def rows_of(t, value):  # SGLang's match_num_queries: cut or pad the metadata to the query rows
            if t.shape[0] >= n:
                return t[:n]
            return torch.cat([t, t.new_full((n - t.shape[0],) + tuple(t.shape[1:]), value)])

        lens = rows_of(im.compressed_seq_lens.to(torch.int32), 1)
        table = rows_of(im.page_table, 0)
        cache = dsv4.paged_view(self.token_to_kv_pool.get_index_k_with_scale_buffer(c4_indexer.layer_id)
                                .view(torch.uint8), im.compressed_page_size, dsv4_layout.INDEX_ROW_BYTES)
        logits = dsv4.paged_indexer_logits(q8.unsqueeze(1), w, cache, lens, table, im.max_compressed_seq_len,
                                           clean=False)
        m = min(n, rows)
        k = out.shape[1]
        raw = core.c4_sparse_raw_indices
        if raw is None:
            dsv4.indexer_topk(logits[:m], lens[:m], k, page_table=table[:m], page_rows=im.compressed_page_size,
                              out=out[:m])
        else:  # the positions once, then their slots: the two agree whatever the ties
            dsv4.indexer_topk(logits[:m], lens[:m], k, out=raw[:m])
            out[:m] = sglang_dsv4.slots_of_positions(raw[:m], table[:m], im.compressed_page_size)


class TileLangMusaDSV4MultiStepBackend(v4.DeepseekV4MultiStepBackend, TileLangMusaDSV4Backend):
    """The EAGLE/MTP draft's multi-step decode backend: SGLang's, with our backend for itself and each step."""

    def _make_step_backend(self, model_runner, step_id: int):
        return TileLangMusaDSV4Backend(model_runner, speculative_step_id=step_id, topk=self.topk,
                                       speculative_num_steps=self.speculative_num_steps)
