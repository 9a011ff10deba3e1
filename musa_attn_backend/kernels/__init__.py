"""Public kernel API. Each op takes ``impl="auto" | "tilelang" | "reference"``."""

from . import _tir  # noqa: F401  (registers the TIR rule check compile_cached runs)
from .attention import check_paged_attention_args, paged_attention, paged_attention_reference
from .kv_cache import check_write_kv_args, quantize_fp8, write_kv, write_kv_reference

__all__ = [
    "paged_attention",
    "paged_attention_reference",
    "check_paged_attention_args",
    "write_kv",
    "write_kv_reference",
    "check_write_kv_args",
    "quantize_fp8",
]
