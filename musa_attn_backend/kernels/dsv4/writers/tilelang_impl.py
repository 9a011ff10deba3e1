"""Launch the TileLang cache writers (:mod:`.kernel`) on the flat byte views of a cache."""

from __future__ import annotations

from typing import Optional

import torch

from ...._tilelang import compile_cached, tl_dtype
from .. import layout as L
from .._glue import _flat_views, _no_race_check, check_fp8
from .kernel import build_write_index_k, build_write_kv_v4


# the writers' tiling (tokens per block, threads), picked by the bench's --writer-tilings sweep
# (benchmarks/results/dsv4-attention-*.json): fewer, larger blocks keep more row stores in flight per SM
WRITE_KV_TILING = (32, 256)
WRITE_INDEX_K_TILING = (32, 256)


def write_kv_v4_kernel(in_dtype: str, target=None, tiling: Optional[tuple] = None):
    tiling = tuple(tiling or WRITE_KV_TILING)
    return compile_cached(("dsv4_write_kv", in_dtype) + tiling, lambda: build_write_kv_v4(in_dtype, *tiling),
                          target=target, pass_configs=_no_race_check())


def write_index_k_kernel(in_dtype: str, target=None, tiling: Optional[tuple] = None, scale_rule: str = "pow2"):
    tiling = tuple(tiling or WRITE_INDEX_K_TILING)
    exact = scale_rule == "exact"
    key = ("dsv4_write_index_k", in_dtype) + tiling + (("exact",) if exact else ())
    return compile_cached(key, lambda: build_write_index_k(in_dtype, *tiling, exact=exact), target=target,
                          pass_configs=_no_race_check())


def _check_fp8_writes(op: str) -> None:
    check_fp8(op, "the TileLang writers need an FP8 conversion",
              " (MP22 reads these caches, but writing them there is not supported yet)")


def write_kv_v4_tilelang(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.write_kv_v4` (arguments checked there)."""
    op = "write_kv_v4(impl='tilelang')"
    _check_fp8_writes(op)
    views, (rows, stride16, num_slots) = _flat_views(L.kv_pages(cache, op=op), kv.device, op, "cache", units=True)
    write_kv_v4_kernel(tl_dtype(kv.dtype))(kv.contiguous(), slots.to(torch.int64).contiguous(), *views, rows,
                                           stride16, num_slots)


def write_index_k_tilelang(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale_rule: str = "pow2") -> None:
    """The TileLang path of :func:`musa_attn_backend.kernels.dsv4.write_index_k` (arguments checked there)."""
    op = "write_index_k(impl='tilelang')"
    _check_fp8_writes(op)
    views, (rows, stride16, num_slots) = _flat_views(L.index_pages(cache, op=op), k.device, op, "cache",
                                                     (torch.float8_e4m3fn, torch.float32))
    views = (views[0][:views[0].numel() // 16 * 16].view(-1, 16), views[1])  # data in 16-byte units
    write_index_k_kernel(tl_dtype(k.dtype), scale_rule=scale_rule)(k.contiguous(), slots.to(torch.int64).contiguous(), *views, rows,
                                            stride16, num_slots)
