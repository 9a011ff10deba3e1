"""A stand-in for FlashMLA's Python package: the three functions FlashMLA's own tests call, served by this package,
so that those tests grade our kernels (``scripts/flashmla_suite.py`` puts this folder first on the path). Nothing
of FlashMLA's is here; the names and signatures are its public API, which our entry points keep."""

from musa_attn_backend.kernels.dsv4 import (FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache,
                                            get_mla_metadata)

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]
