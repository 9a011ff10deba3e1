"""Kernel metadata: what a batch looks like to the kernels, and the one place each engine is translated.

The pattern, which every kernel family follows (dense paged attention today; DeepSeek-V4 sparse attention,
its indexer and MoE next):

* ``metadata/<family>.py`` holds engine-neutral dataclasses: the tensors and host ints the kernels of that
  family read, capacity buffers for CUDA graphs (``allocate`` + ``out=``), views and helpers the launch
  code needs (``decode_split``, ``tensors``, ``validate``), and one engine-neutral constructor
  (``from_lengths`` for :class:`PagedKVMeta`). It knows no engine.
* ``metadata/<engine>.py`` (:mod:`.sglang`, :mod:`.vllm`) is everything that reads that engine's batch
  structures (SGLang's ``ForwardBatch`` and pools, vLLM's ``CommonAttentionMetadata`` and cache) and turns
  them into those dataclasses; each family adds its functions there. It never imports the engine (objects
  are read by attribute), so it runs and is tested without one.
* The adapters (:mod:`musa_attn_backend.sglang`, :mod:`musa_attn_backend.vllm`) do no math: they hold engine
  state (pools, graph buffers), call ``metadata.<engine>`` once per batch and the kernels once per layer.

``PagedKVMeta.from_sglang`` / ``PagedKVMeta.from_vllm`` are the public entry points from engine tensors.
"""

from . import sglang, vllm  # noqa: F401  (each registers its translation for PagedKVMeta.from_<engine>)
from .paged import PagedKVMeta

__all__ = ["PagedKVMeta"]
