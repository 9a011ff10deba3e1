"""The work plan of the scheduled sparse MQA program (:mod:`.sched_kernel`): which key tiles each of a
fixed number of blocks ("parts") visits, made once per batch and reused by every layer whose index lists have the
same lengths (FlashMLA's ``get_mla_metadata`` pattern: plan once, run per layer).

Token ``t`` attends to ``n_t = max(ceil(l1 / 64) + ceil(l2 / 64), 1)`` key tiles of 64 index entries (``l1``, ``l2``:
its main and extra lengths clipped to ``[0, topk]``; a token with no valid entry still gets one tile, whose entries
are all invalid, so that its output and LSE are written). Laid end to end, token ``t`` occupies
``OVERHEAD_TILES + n_t`` places of a line: the overhead stands for a piece's fixed cost (loading the query block,
the epilogue), then come its tiles. The line is cut into ``parts`` equal spans of ``P = ceil(total / parts)``
places; part ``p`` visits every tile whose place is in ``[p P, (p + 1) P)``. Each tile is visited by exactly one
part; a token's tiles visited by one part form a piece. A token whose tiles lie in one part is "unsplit": that
part writes its output and LSE. Otherwise each piece writes a partial (its output normalised by its own sum and
its LSE in log2 units) to its own row of the partial buffers, and the combine merges them. At most ``parts - 1``
tokens are split (one a cut), so the partial rows are at most ``2 (parts - 1)`` whatever the batch.

Everything is computed on the device by tensor operations of fixed shapes, from the lengths on the device: no
host read, so planning can be captured in a CUDA graph with the layers that use it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..._common import check

BLOCK_N = 64  # index entries a key tile
OVERHEAD_TILES = 5  # a piece's fixed cost in key tiles (FlashMLA's planner uses the same value)
# places added to each part's span beyond an even cut (FlashMLA's planner gives each part ceil(total / parts) +
# its overhead, so a batch uses fewer parts, each longer, and splits fewer tokens); 0: the even cut, the faster
# measured at every decode size (docs/dsv4.md, "three variants")
PLAN_SLACK = 0
META_FIELDS = 4  # part_meta columns: first token, its first tile, last token, the tile after its last


@dataclasses.dataclass(frozen=True)
class SparseMQAPlan:
    """The plan of one batch (see the module docstring). Tensors on the batch's device, int32.

    ``part_meta [parts, 4]``: part ``p`` visits tiles ``[j0, n_t0)`` of token ``t0``, every tile of the tokens
    between, and tiles ``[0, j1)`` of token ``t1`` (``[j0, j1)`` when ``t0 == t1``); a part with nothing to do
    has ``t0 > t1``. ``tiles [T]``: ``n_t``. ``first_part [T]``: the part that visits token ``t``'s first tile.
    ``split_row [T]``: for a split token, the partial row of its first piece (piece ``p - first_part[t]`` at row
    ``split_row[t] + p - first_part[t]``); -1 for an unsplit token. ``combine [parts, 2]``: (token, pieces) of each
    split token in order, token -1 past the last. ``num_split [1]``: how many tokens are split (the combine list's
    length: the merge walks that many entries, not all ``parts``).

    ``tokens``, ``topk``, ``extra_topk`` (0: no extra set) and ``parts`` are the shapes it was made for;
    :meth:`check_matches` refuses a call of other shapes."""

    tokens: int
    topk: int
    extra_topk: int
    parts: int
    part_meta: torch.Tensor
    tiles: torch.Tensor
    first_part: torch.Tensor
    split_row: torch.Tensor
    combine: torch.Tensor
    num_split: torch.Tensor
    # per-token lengths of calls that pass none (every entry counts), made once for the batch's layers by the
    # launcher (tilelang_impl._plan_lengths), outside graph capture
    full_lengths: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_partials(self) -> int:
        """Rows the partial buffers need: at most ``2 (parts - 1)`` pieces belong to split tokens."""
        return max(2 * (self.parts - 1), 1)

    def check_matches(self, op: str, tokens: int, topk: int, extra_topk: int, device) -> None:
        check((self.tokens, self.topk, self.extra_topk) == (tokens, topk, extra_topk),
              lambda: f"{op}: the plan was made for {self.tokens} tokens and index lists of {self.topk} + "
                      f"{self.extra_topk} entries, the call has {tokens} tokens and {topk} + {extra_topk}; make a "
                      f"plan per batch (and per kind of layer) with plan_sparse_mqa")
        check(self.part_meta.device == torch.device(device),
              lambda: f"{op}: the plan is on {self.part_meta.device}, the call's tensors on {device}")


def default_parts(heads: int, sm_count: int) -> int:
    """Blocks a head block of a scheduled launch: one wave over the GPU (``sm_count`` / head blocks)."""
    head_blocks = -(-heads // 64)
    return max(sm_count // head_blocks, 1)


def _lengths(lengths: Optional[torch.Tensor], T: int, K: int, device) -> torch.Tensor:
    if lengths is None:
        return torch.full((T,), K, dtype=torch.int64, device=device)
    return lengths.to(torch.int64)


def plan_sparse_mqa(tokens: int, topk: int, lengths: Optional[torch.Tensor] = None, extra_topk: int = 0,
                    extra_lengths: Optional[torch.Tensor] = None, *, parts: int, device=None,
                    overhead: int = OVERHEAD_TILES) -> SparseMQAPlan:
    """The plan (module docstring) of ``tokens`` query tokens with index lists of ``topk`` entries (and
    ``extra_topk`` of the extra set; 0: none), ``lengths`` / ``extra_lengths [tokens]`` the counted entries of
    each (None: all), over ``parts`` blocks a head block."""
    op = "plan_sparse_mqa"
    check(isinstance(tokens, int) and tokens >= 0, lambda: f"{op}: tokens must be an int >= 0, got {tokens!r}")
    check(isinstance(parts, int) and parts >= 1, lambda: f"{op}: parts must be a positive int, got {parts!r}")
    check(isinstance(topk, int) and topk >= 0 and isinstance(extra_topk, int) and extra_topk >= 0,
          lambda: f"{op}: topk and extra_topk must be ints >= 0, got {topk!r}, {extra_topk!r}")
    for name, lens in (("lengths", lengths), ("extra_lengths", extra_lengths)):
        check(lens is None or (isinstance(lens, torch.Tensor) and lens.dim() == 1 and lens.numel() == tokens
                               and not lens.is_floating_point() and lens.dtype != torch.bool),
              lambda: f"{op}: {name} must be an integer tensor of {tokens} entries")
    check(extra_lengths is None or extra_topk > 0, f"{op}: extra_lengths without an extra set (extra_topk 0)")
    if device is None:
        device = lengths.device if lengths is not None else (
            extra_lengths.device if extra_lengths is not None else torch.device("cpu"))
    if tokens == 0:  # nothing to visit: every part idle, no split token
        i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
        meta = i32(parts, META_FIELDS)
        meta[:, 0] = 1
        combine = torch.full((parts, 2), -1, dtype=torch.int32, device=device)
        combine[:, 1] = 0
        return SparseMQAPlan(0, topk, extra_topk, parts, meta, i32(0), i32(0), i32(0), combine, i32(1))
    l1 = _lengths(lengths, tokens, topk, device).clamp(0, topk)
    n = (l1 + BLOCK_N - 1) // BLOCK_N
    if extra_topk:
        l2 = _lengths(extra_lengths, tokens, extra_topk, device).clamp(0, extra_topk)
        n = n + (l2 + BLOCK_N - 1) // BLOCK_N
    n = n.clamp_min(1)
    end = torch.cumsum(n + overhead, 0)  # each token's last place + 1 (strictly increasing)
    start = end - n  # its first tile's place
    per = (end[-1:] + parts - 1) // parts + PLAN_SLACK  # P, on the device: [1]
    lo = torch.arange(parts, device=device, dtype=torch.int64) * per
    hi = lo + per
    t0 = torch.searchsorted(end, lo, right=True)  # the first token with a tile at or past lo
    t1 = torch.searchsorted(start, hi, right=False) - 1  # the last token with a tile before hi
    t0c, t1c = t0.clamp_max(tokens - 1), t1.clamp_min(0)
    j0 = (lo - start[t0c]).clamp_min(0)
    j1 = torch.minimum(n[t1c], hi - start[t1c])
    empty = t0 > t1
    meta = torch.stack([torch.where(empty, 1, t0), torch.where(empty, 0, j0), torch.where(empty, 0, t1),
                        torch.where(empty, 0, j1)], dim=1)
    first = start // per
    pieces = (end - 1) // per - first + 1
    split = pieces > 1
    rows = torch.where(split, pieces, 0)
    split_row = torch.where(split, torch.cumsum(rows, 0) - rows, -1)
    # the split tokens listed in order: a scatter into parts + 1 places (the last one takes the unsplit tokens)
    order = torch.where(split, torch.cumsum(split.to(torch.int64), 0) - 1, parts)
    combine = torch.full((parts + 1, 2), -1, dtype=torch.int64, device=device)
    combine[:, 1] = 0
    ids = torch.arange(tokens, device=device, dtype=torch.int64)
    combine.index_copy_(0, order, torch.stack([ids, pieces], dim=1))  # places past the list: overwritten by the last
    combine = combine[:parts]
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return SparseMQAPlan(tokens, topk, extra_topk, parts, i32(meta), i32(n), i32(first), i32(split_row), i32(combine),
                         i32(split.sum(dtype=torch.int64).view(1)))


def visits(plan: SparseMQAPlan) -> list:
    """For tests and the reference walk: per part, the list of ``(token, first tile, end tile)`` pieces it visits
    (reads the plan on the host)."""
    meta, tiles = plan.part_meta.cpu().tolist(), plan.tiles.cpu().tolist()
    out = []
    for t0, j0, t1, j1 in meta:
        pieces = []
        for t in range(t0, t1 + 1):
            pieces.append((t, j0 if t == t0 else 0, j1 if t == t1 else tiles[t]))
        out.append(pieces)
    return out
