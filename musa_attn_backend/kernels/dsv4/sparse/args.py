"""The argument types the sparse MQA programs share: their dynamic sizes and, per key set (the main cache's and
the extra one's), the annotations of the set's four or five arguments, so that a program's signature names a set
in one line and the views' shapes are written once (the launch glue makes the views: ``_glue._flat_views``).

No ``from __future__ import annotations`` here or in the programs: TileLang evaluates the prim_func annotations.
"""

from typing import Any, NamedTuple

from ...._tilelang import tl_lang as T


class SparseSizes(NamedTuple):
    """The dynamic sizes of a sparse MQA program's arguments."""

    NT: Any  # query tokens
    K1: Any  # entries of a token's main index list
    K2: Any  # and of its extra one
    NU1: Any  # the main cache's 16-byte units
    NS1: Any  # its 8-byte scale units
    NU2: Any  # the extra cache's
    NS2: Any


def sparse_sizes() -> SparseSizes:
    return SparseSizes(T.dynamic("num_tokens"), T.dynamic("topk"), T.dynamic("extra_topk"),
                       T.dynamic("cache_units16", "int64"), T.dynamic("cache_units8", "int64"),
                       T.dynamic("extra_units16", "int64"), T.dynamic("extra_units8", "int64"))


class WordSet(NamedTuple):
    """A key set as the Hopper programs take it: the cache as int32 words (four a 16-byte unit, two an 8-byte
    scale unit), the tokens' index lists and their lengths."""

    words: Any
    scales: Any
    indices: Any
    lengths: Any


class UnitSet(NamedTuple):
    """A key set as the portable program takes it: the cache's 16-byte units as e4m3 bytes (``uint8`` where the
    target has no FP8 conversion) and as bf16 values, its 8-byte scale units, the index lists and lengths."""

    nope: Any
    rope: Any
    scales: Any
    indices: Any
    lengths: Any


def word_sets(s: SparseSizes) -> tuple:
    """``(main, extra)``: the :class:`WordSet` annotations of both key sets."""
    return tuple(WordSet(T.Tensor((nu, 4), "int32"), T.Tensor((ns, 2), "int32"), T.Tensor((s.NT, k), "int32"),
                         T.Tensor((s.NT,), "int32"))
                 for nu, ns, k in ((s.NU1, s.NS1, s.K1), (s.NU2, s.NS2, s.K2)))


def unit_sets(s: SparseSizes, nope_dtype: str) -> tuple:
    """``(main, extra)``: the :class:`UnitSet` annotations of both key sets."""
    return tuple(UnitSet(T.Tensor((nu, 16), nope_dtype), T.Tensor((nu, 8), "bfloat16"), T.Tensor((ns, 8), "uint8"),
                         T.Tensor((s.NT, k), "int32"), T.Tensor((s.NT,), "int32"))
                 for nu, ns, k in ((s.NU1, s.NS1, s.K1), (s.NU2, s.NS2, s.K2)))
