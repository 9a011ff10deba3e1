"""What the DeepSeek-V4 families' launchers share: the flat views of a paged cache's bytes that the programs
address (16-byte units, words, or typed views), the FP8 capability check, and the pass config that turns off
TileLang's race check for stores it cannot prove disjoint."""

from __future__ import annotations

import torch

from ..._tilelang import tl
from ...platform import features_of, get_platform
from .._common import check
from . import layout as L

_EMPTY: dict = {}


def _fp8_convert(target) -> bool:
    """Whether the programs for ``target`` (None: this platform's) convert e4m3 with the target's FP8
    conversion (``platform.fp8``), rather than decoding the bytes by integer arithmetic (MP22)."""
    return features_of(target)["fp8"]


def _unit_views(flat: torch.Tensor):
    """The programs' views of a cache's bytes: ``[n16, 16]`` e4m3 (uint8 where the target has no FP8
    conversion) and ``[n16, 8]`` bf16 (16-byte units), ``[n8, 8]`` uint8 (8-byte units)."""
    n16, n8 = flat.numel() // 16, flat.numel() // 8
    nope = flat[:n16 * 16] if not _fp8_convert(None) else flat[:n16 * 16].view(torch.float8_e4m3fn)
    return nope.view(n16, 16), flat[:n16 * 16].view(torch.bfloat16).view(n16, 8), flat[:n8 * 8].view(n8, 8)


def _word_views(flat: torch.Tensor):
    """The scheduled program's views of a cache's bytes: ``[n16, 4]`` and ``[n8, 2]`` int32 words (its 16-byte
    and 8-byte units)."""
    n16, n8 = flat.numel() // 16, flat.numel() // 8
    return flat[:n16 * 16].view(torch.int32).view(n16, 4), flat[:n8 * 8].view(torch.int32).view(n8, 2)


def _flat_views(pages: L.Pages, device, op: str, name: str, dtypes=(torch.float8_e4m3fn, torch.bfloat16, None),
                units: bool = False, words: bool = False):
    """Views of ``dtypes`` (None: the uint8 bytes; ``units``: :func:`_unit_views`; ``words``: :func:`_word_views`)
    from the cache's first byte to its last page's end, and (rows, page stride in 16-byte units, slots)."""
    if words:
        units = False
        dtypes = "words"
    if pages.num_pages == 0:
        buf = _EMPTY.get(device)
        if buf is None:
            buf = _EMPTY[device] = torch.zeros(16, dtype=torch.uint8, device=device)
        views = _unit_views(buf) if units else (_word_views(buf) if dtypes == "words"
                                                else tuple(buf if d is None else buf.view(d) for d in dtypes))
        return views, (max(pages.rows, 1), 1, 0)
    p = pages.pages
    stride = p.stride(0) if pages.num_pages > 1 else L.page_bytes(pages.rows)
    check(p.data_ptr() % 16 == 0 and stride % 16 == 0,
          lambda: f"{op}: {name} must start on a 16-byte boundary with a page stride that is a multiple of 16 "
                  f"(pointer {p.data_ptr() % 16} bytes past one, stride {stride})")
    nbytes = (pages.num_pages - 1) * stride + p.shape[1]  # even: rows of 584 bytes, pages 16-byte aligned
    flat = p.as_strided((nbytes,), (1,))  # the programs address it with 64-bit offsets: any size
    views = _unit_views(flat) if units else (_word_views(flat) if dtypes == "words"
                                             else tuple(flat if d is None else flat.view(d) for d in dtypes))
    return views, (pages.rows, stride // 16, pages.num_slots)


def _no_race_check() -> dict:
    """The pass config that turns off TileLang's data-race check (where this TileLang has it), for stores whose
    disjointness it cannot prove: the writers' rows (their slots come from memory: distinct slots write disjoint
    rows; duplicate slots in one call are the caller's, and which row lands is then unspecified, as in the
    engines' writers) and the sparse MQA program's XOR-swizzled score exchange."""
    key = getattr(tl.PassConfigKey, "TL_DISABLE_DATA_RACE_CHECK", None)
    return {key: True} if key is not None else {}


def check_fp8(op: str, needs: str, then: str = "") -> None:
    """Refuse, naming ``op``, a platform without an FP8 conversion (MP22): ``"{op}: {needs}, which <arch>
    lacks{then}"``."""
    plat = get_platform()
    check(plat.fp8, lambda: f"{op}: {needs}, which {plat.arch} lacks{then}")
