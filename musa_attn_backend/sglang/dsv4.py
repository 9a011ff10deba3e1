"""SGLang 0.5.23's DeepSeek-V4 attention under ``tilelang_musa``: a subclass of SGLang's ``DeepseekV4AttnBackend``
that keeps its metadata, index translation and CUDA-graph logic and runs this package's kernels.

- Sparse attention, decode and prefill: ``self._flash_mla_with_kvcache`` is :func:`..kernels.dsv4.flash_mla_with_kvcache`
  (FlashMLA's signature over :func:`..kernels.dsv4.sparse_mqa`: TileLang on a GPU, the reference on a CPU). Prefill
  takes the same call (SGLang's sparse-prefill route, a bf16 workspace through FlashMLA's prefill kernel and three
  Triton kernels, is off), so both read the FP8 caches directly.
- Metadata: SGLang's builders run unchanged except for the steps that call FlashMLA's planner (our kernels plan
  their own launches: the planner's object is ``None``), Triton index kernels (torch ports in
  :mod:`..metadata.sglang_dsv4`, graph-safe) and the JIT compressor planner (our compressors read SGLang's state
  rings through a table instead). These are module functions of SGLang's backend with no method seam; they are
  rebound once per process to dispatchers that serve SGLang's original unless this backend was built in the
  process.
- The indexer metadata is built without DeepGEMM's schedule (our paged logits split their own work).

What is not here yet: the compressors and the C4 indexer (``forward_core_compressor``,
``forward_indexer_compressor``, ``forward_c4_indexer``) and the SWA writer the model calls on the pool. They raise
a ``NotImplementedError`` that names them, rather than run SGLang's CUDA-only kernels.
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
from ..metadata import sglang_dsv4

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
    _ours_or_theirs("_create_flashmla_metadata", lambda: None)
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


def _not_yet(what: str):
    raise NotImplementedError(f"tilelang_musa: DeepSeek-V4's {what} does not run on this package's kernels yet "
                              "(SGLang's own needs CUDA-only JIT kernels)")


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


class TileLangMusaDSV4Backend(v4.DeepseekV4AttnBackend):
    """``--attention-backend tilelang_musa`` for a DeepSeek-V4 model (made by ``create_backend``)."""

    def __init__(self, model_runner, **kwargs):
        install_seams()
        _state["active"] = True
        with _flash_mla_interface_if_absent():
            super().__init__(model_runner, **kwargs)
        if self.is_dsv41:
            raise ValueError("tilelang_musa: DeepSeek-V4.1 checkpoints (compress ratios 1 and 2) are not supported; "
                             "V4's ratios 0, 4 and 128 are")
        self._flash_mla_with_kvcache = dsv4.flash_mla_with_kvcache
        self._swa_interleaved = False
        self._flashmla_split_kv_min_topk = 1 << 30  # only V4.1 consults it

    def _use_sparse_prefill(self, forward_batch, *, num_qo_tokens: int) -> bool:
        return False  # prefill through _flash_mla_with_kvcache as well: sparse_mqa on the FP8 caches

    def init_forward_metadata_indexer(self, core_attn_metadata, *, compress_ratio: int = 4,
                                      use_prefill_cuda_graph: bool = False, rows_per_request: int = 1):
        if compress_ratio != 4:
            raise ValueError(f"tilelang_musa: an indexer of compress ratio {compress_ratio} (V4.1) is not supported")
        return _IndexerMetadata(
            page_size=self.page_size, compressed_page_size=self.page_size // compress_ratio,
            page_table=core_attn_metadata.page_table, compressed_seq_lens=core_attn_metadata.c4_topk_lengths_raw,
            use_topk_v2=False, use_prefill_cuda_graph=use_prefill_cuda_graph, compress_ratio=compress_ratio,
            rows_per_request=rows_per_request)

    def forward_core_compressor(self, x, forward_batch, layer_id, compressor):
        _not_yet("attention compressor")

    def forward_indexer_compressor(self, x, forward_batch, layer_id, compressor):
        _not_yet("indexer compressor")

    def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs):
        _not_yet("C4 indexer")
