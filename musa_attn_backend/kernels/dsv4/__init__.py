"""DeepSeek-V4 attention ops: the FP8 "MODEL1" KV cache (584-byte rows) and indexer-key cache (132-byte rows),
their writers and reader, sparse MQA over a sliding-window and a compressed cache with a per-head sink, the indexer
of the C4 layers, the compressors that fill the compressed caches, and the model-side kernels.

One sub-package a family, each in the four roles (``__init__``: the checked, torch-facing ops; ``reference``: float32
PyTorch, also the CPU path; ``*_kernel``: the TileLang programs, one a file; ``tilelang_impl``: the launch glue):
:mod:`.sparse` (sparse MQA, FlashMLA's interface, the scheduled program's plan), :mod:`.writers` (cache writers and
readers), :mod:`.indexer` (FP8 queries, logits, top-k), :mod:`.compressor`, :mod:`.model` (norm + RoPE, clamped
SwiGLU, mHC, the attention slots). The byte layout they share: :mod:`.layout`; the launchers' shared views and
checks: :mod:`._glue`. Every op checks its arguments before anything runs and names the argument it refuses. Each
takes ``impl="auto" | "tilelang" | "reference"`` (``auto``: TileLang on a GPU, the reference on a CPU).
"""

from __future__ import annotations

from . import layout
from .layout import (D, D_NOPE, D_ROPE, INDEX_D, INDEX_ROW_BYTES, ROW_BYTES, index_page_bytes, new_kv_cache, page_bytes,
                     paged_view)
from .sparse.flash_mla import FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from .sparse.schedule import SparseMQAPlan
from .compressor import compress
from .model.slots import attention_slots
from .indexer import INDEX_HEADS, indexer_logits, indexer_q, indexer_topk, paged_indexer_logits
from .writers import norm_rope_write_kv_v4, read_index_k, read_kv_v4, write_index_k, write_kv_v4
from .sparse import MAX_HEADS, check_sparse_mqa_args, sparse_mqa, sparse_mqa_plan

__all__ = ["write_kv_v4", "write_index_k", "read_kv_v4", "read_index_k", "sparse_mqa", "layout", "paged_view",
           "new_kv_cache", "page_bytes", "index_page_bytes", "D", "D_NOPE", "D_ROPE", "ROW_BYTES", "INDEX_ROW_BYTES",
           "MAX_HEADS", "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata", "FlashMLASchedMeta",
           "indexer_logits", "paged_indexer_logits", "indexer_topk", "indexer_q", "compress", "INDEX_HEADS",
           "norm_rope_write_kv_v4", "attention_slots", "sparse_mqa_plan", "SparseMQAPlan"]
