"""The bf16 workspace :mod:`.paired_ws_kernel` reads: each distinct key row a batch's index lists select,
dequantised once, and the lists rebased into it.

A prefill's tokens share most of their rows (each of 4,096 tokens reads its window's 128 rows and 512 of the
compressed ones, some 2.6 million reads of 8-20 thousand rows), so dequantising each row once and copying bf16 rows
in the attention program costs less than dequantising per read; FlashMLA's sparse prefill reads such a workspace,
which the engines build for it. Here it is built from the caches (no copy of a cache): the selected slots are
flagged in a per-cache vector by torch operations, their running count gives each its workspace row, and the
flagged rows are read by ``read_rows`` (the launcher passes :mod:`.workspace_kernel`'s gather; the reference
reader by default; both exact: the rows are bf16 values).

The rebased list of a token is its main list's ``K1`` entries then its extra list's ``K2`` (the extra rows after
the main cache's in the workspace); an entry that selects nothing (negative, at or past its cache's slots, at or
past its list's length) is ``-1``. The length is ``K1 + min(extra length, K2)`` with an extra set, else the main
list's length (the entries of a main list shorter than ``K1`` before the extra ones are ``-1``: masked, not
moved). The row count is known only after the flags are counted: one host synchronisation a build.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .. import layout as L
from ..writers.reference import read_kv_v4_reference


class Workspace(NamedTuple):
    rows: torch.Tensor  # [R, 512] bf16: the distinct selected rows, the main cache's first
    indices: torch.Tensor  # [T, K1 + K2] int32: each token's entries as workspace rows, -1 where none
    lengths: torch.Tensor  # [T] int32


def _selected(cache: torch.Tensor, name: str, indices: torch.Tensor, lengths: Optional[torch.Tensor], op: str):
    """``(slots, rebased, valid)``: the distinct slots ``indices`` select in ``cache`` (ascending), each entry's
    place among them (-1 where it selects nothing) and which entries select."""
    slots = L.kv_pages(cache, name, op=op).num_slots
    T, K = indices.shape
    valid = (indices >= 0) & (indices < slots)
    if lengths is not None:
        valid &= torch.arange(K, device=indices.device)[None, :] < lengths.to(indices.device)[:, None]
    named = torch.where(valid, indices, slots).long()  # slot `slots`: where the unselecting entries point
    flags = torch.zeros(slots + 1, dtype=torch.int32, device=indices.device)
    flags.index_fill_(0, named.reshape(-1), 1)
    flags[slots] = 0
    place = torch.cumsum(flags, 0, dtype=torch.int32) - 1
    rebased = torch.where(valid, place[named], -1)
    return torch.nonzero(flags[:slots]).squeeze(1), rebased, valid


def build_workspace(cache: torch.Tensor, indices: torch.Tensor, lengths: Optional[torch.Tensor] = None, *,
                    extra_cache: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
                    extra_lengths: Optional[torch.Tensor] = None, op: str = "build_workspace",
                    read_rows: Optional[Callable] = None) -> Workspace:
    """The workspace of one call of :func:`musa_attn_backend.kernels.dsv4.sparse_mqa` (its arguments, checked
    there): the selected rows of ``cache`` (and ``extra_cache``), the tokens' rebased lists and their lengths.
    ``read_rows(cache, slots, name)``: the bf16 rows ``[len(slots), 512]`` at ``slots`` (default: the reference
    reader)."""
    read_rows = read_rows or (lambda c, slots, name: read_kv_v4_reference(c, slots))
    T, K1 = indices.shape
    dev = indices.device
    slots1, rebased1, _ = _selected(cache, "cache", indices, lengths, op)
    parts, lists = [read_rows(cache, slots1, "cache")], [rebased1]
    if lengths is None:
        n = torch.full((T,), K1, dtype=torch.int32, device=dev)
    else:
        n = lengths.to(dev, torch.int32).clamp(0, K1)
    if extra_indices is not None and extra_indices.shape[1] > 0:
        K2 = extra_indices.shape[1]
        slots2, rebased2, _ = _selected(extra_cache, "extra_cache", extra_indices, extra_lengths, op)
        parts.append(read_rows(extra_cache, slots2, "extra_cache"))
        lists.append(torch.where(rebased2 >= 0, rebased2 + slots1.shape[0], -1))
        n2 = (torch.full((T,), K2, dtype=torch.int32, device=dev) if extra_lengths is None
              else extra_lengths.to(dev, torch.int32).clamp(0, K2))
        n = torch.where(n2 > 0, K1 + n2, n)
    return Workspace(torch.cat(parts).contiguous(), torch.cat(lists, dim=1).to(torch.int32).contiguous(),
                     n.to(torch.int32).contiguous())
