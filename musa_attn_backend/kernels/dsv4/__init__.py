"""DeepSeek-V4 attention ops: the FP8 "MODEL1" KV cache (584-byte rows) and indexer-key cache (132-byte rows),
their writers and reader, sparse MQA over a sliding-window and a compressed cache with a per-head sink, and the
indexer of the C4 layers (its FP8 queries, the logits for prefill and paged decode, their top-k: :mod:`.indexer`)
and the compressors that fill the compressed caches (:mod:`.compressor`).

Byte formats: :mod:`.layout`. Writers and readers: :mod:`.writers`; sparse MQA: :mod:`.sparse`. Math:
:mod:`.reference` (also the path on a CPU). Every op checks its arguments before anything runs and names the
argument it refuses. Each takes ``impl="auto" | "tilelang" | "reference"``
(``auto``: TileLang on a GPU, the reference on a CPU).
"""

from __future__ import annotations

from . import layout
from .layout import (D, D_NOPE, D_ROPE, INDEX_D, INDEX_ROW_BYTES, ROW_BYTES, index_page_bytes, new_kv_cache, page_bytes,
                     paged_view)
from .flash_mla import FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from .schedule import SparseMQAPlan
from .compressor import compress
from .slots import attention_slots
from .indexer import INDEX_HEADS, indexer_logits, indexer_q, indexer_topk, paged_indexer_logits
from .writers import norm_rope_write_kv_v4, read_index_k, read_kv_v4, write_index_k, write_kv_v4
from .sparse import MAX_HEADS, check_sparse_mqa_args, sparse_mqa, sparse_mqa_plan

__all__ = ["write_kv_v4", "write_index_k", "read_kv_v4", "read_index_k", "sparse_mqa", "layout", "paged_view",
           "new_kv_cache", "page_bytes", "index_page_bytes", "D", "D_NOPE", "D_ROPE", "ROW_BYTES", "INDEX_ROW_BYTES",
           "MAX_HEADS", "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata", "FlashMLASchedMeta",
           "indexer_logits", "paged_indexer_logits", "indexer_topk", "indexer_q", "compress", "INDEX_HEADS",
           "norm_rope_write_kv_v4", "attention_slots", "sparse_mqa_plan", "SparseMQAPlan"]
