"""tilelang-musa's GEMM lowering for MUSA MP31 (SQMMA), modelled in Python for the portability checks of
:mod:`._tir`: how a block's warps split a tile GEMM, which SQMMA instruction shape it takes, how its float32
accumulator is laid out over the threads, and so how wide tilelang-musa's loop vectoriser makes a parallel loop
over that accumulator.

From the fork's sources (tile-ai/tilelang-musa 0.1.12 and MooreThreads/tilelang_musa v0.1.8+musa1;
``docs/musa.md`` has the derivation): ``ComputeWarpGroupPartition`` and ``SelectSQMMAInstShape`` (the partition
and the instruction), ``MakePHSqmmaFragmentC`` (the accumulator: one element a thread in each 16 x 8 tile, a
thread's consecutive elements 8 columns apart, so a row stays the same for ``R`` of them), and
``VectorizePlanner`` (v0.1.8's: a loop touching shared or global memory is vectorised as wide as its accesses
allow, an access by row alone as wide as ``R``, a constant one as wide as the loop, none capped at 128 bits).
"""

from __future__ import annotations

from math import gcd
from typing import NamedTuple, Optional

POLICIES = {0: "Square", 1: "FullRow", 2: "FullCol", 3: "Free"}  # TileLang's GemmWarpPolicyType
WARP = 32
K_M, K_N = 4, 8  # the partition's granules: rows a warp, columns a warp


class SqmmaShape(NamedTuple):
    """The warps along M and N of a block's GEMM and its instruction (``inst_m x inst_n x inst_k``)."""

    m_warp: int
    n_warp: int
    inst_m: int
    inst_n: int
    inst_k: int


def warp_partition(policy: str, M: int, N: int, warps: int) -> Optional[tuple[int, int]]:
    """``(m_warp, n_warp)`` of ``warps`` warps (a multiple of 4: warp groups) over an ``M x N`` tile, or None where
    the shape does not divide (tilelang-musa stops on an ICHECK there)."""
    if warps % 4 or M % K_M or N % K_N:
        return None
    m_warp, n_warp = 4, warps // 4
    if policy == "FullRow":
        for cand in range(warps, 3, -4):
            if M % (cand * K_M) == 0:
                m_warp, n_warp = cand, warps // cand
                break
    elif policy == "FullCol":
        if N % (n_warp * K_N):
            for n in range(min(n_warp, N // K_N), 0, -1):
                if warps % n == 0 and (warps // n) % 4 == 0:
                    n_warp, m_warp = n, warps // n
                    break
    elif policy == "Square":
        best, ideal = float("inf"), M / N
        m = 4
        while m <= warps and m <= M // K_M:
            n = warps // m
            if warps % m == 0 and n <= N // K_N:
                score = abs((M / (m * K_M)) / (N / (n * K_N)) - ideal)
                if score < best:
                    best, m_warp, n_warp = score, m, n
            m += 4
    return m_warp, n_warp


def sqmma_shape(M: int, N: int, K: int, threads: int, policy: str, a_dtype: str) -> Optional[SqmmaShape]:
    """The partition and instruction tilelang-musa gives a GEMM of shared A and B (``a_dtype``: ``fp8``, ``16bit``
    or ``tf32``) in a block of ``threads``, or None where it takes no SQMMA instruction (another GEMM path)."""
    if threads <= 0 or threads % (4 * WARP):
        return None
    part = warp_partition(policy, M, N, threads // WARP)
    if part is None:
        return None
    m_warp, n_warp = part
    if m_warp % 4 or M % (m_warp * K_M) or N % (n_warp * K_N):
        return None
    atom_m, atom_n = M // (m_warp // 4), N // n_warp
    tf32 = a_dtype == "tf32"
    if tf32:
        ns = {128: (128, 64), 64: (64, 32, 16), 32: (64, 32), 16: (64,)}
        ks = (32, 16, 8)
    else:
        ns = {128: (128, 64, 32), 64: (128, 64, 32, 16), 32: (128, 64, 32), 16: (64,)}
        ks = (64, 32, 16) if a_dtype == "16bit" else (128, 64, 32)
    for im in (128, 64, 32, 16):
        if atom_m % im:
            continue
        for inn in ns[im]:
            if atom_n % inn:
                continue
            for ik in ks:
                if K % ik == 0:
                    return SqmmaShape(m_warp, n_warp, im, inn, ik)
    return None


def row_run(M: int, N: int, shape: SqmmaShape) -> int:
    """How many consecutive accumulator elements of a thread share one row (the SQMMA layout steps 8 columns from
    one to the next within an instruction tile; with 16-row instructions and one of them down a warp group's rows,
    across the whole warp group's columns)."""
    atom_m, atom_n = M // (shape.m_warp // 4), N // shape.n_warp
    if shape.inst_m > 16 or atom_m // shape.inst_m > 1:
        return shape.inst_n // 8
    return atom_n // 8


def _pow2_part(n: int) -> int:
    return n & -n


def loop_lanes(M: int, N: int, threads: int, shape: SqmmaShape, accesses: list[str], statements: int = 1,
               cast_bits: tuple = ()) -> int:
    """The vector lanes v0.1.8's planner gives a parallel loop over an ``M x N`` accumulator of ``shape`` (in a
    block of ``threads``) whose shared / global ``accesses`` index by ``"none"`` (a constant), ``"row"`` or
    ``"col"`` (the column, with or without the row), with ``statements`` statements and casts to ``cast_bits``-wide
    types in its body; 1 where the loop touches no shared or global memory (it is not vectorised)."""
    if not accesses:
        return 1
    per_thread = M * N // threads
    lanes = gcd(128, per_thread)
    run = _pow2_part(row_run(M, N, shape))
    for a in accesses:
        lanes = gcd(lanes, lanes if a == "none" else gcd(lanes, run) if a == "row" else 1)
    for bits in cast_bits:
        lanes = gcd(lanes, min(128 // bits, 8))
    if statements > 1:
        lanes = gcd(lanes, 4)
    return lanes
