"""How close a result must be to its reference: the one tolerance table of tests, benchmarks, tuning and the demo.

A check passes when ``|out - ref| <= tol + tol * |ref|`` elementwise (``torch.testing.assert_close`` with
``atol = rtol = tol``), ``ref`` being the float32 reference and ``out`` the result in its own dtype. Outputs
are averages of values of order 1, so one number serves as both absolute and relative bound.

* ``KERNEL``: a kernel (or an engine path through one) against the float32 reference. The kernels keep P in
  the query dtype for the ``P V`` product and accumulate in float32, so the error is a few units in the last
  place of the output dtype: bf16 has 8 mantissa bits (2^-8 = 3.9e-3, bounds of 2e-2 leave room for long
  rows), fp16 11 bits. float32 queries never reach a TileLang kernel; their bound is for the reference taken
  through an engine adapter.
* ``REFERENCE``: two float32 computations of the same attention (the reference against SDPA on unpaged
  tensors), cast to the output dtype: only the final rounding differs.
* An FP8 e4m3 cache (3 mantissa bits) multiplies the bound by ``FP8_FACTOR``: both sides read the same FP8 values,
  but the kernels convert them to the query dtype before the products.
* LSEs (natural log, float32 in both) get ``LSE_KERNEL`` / ``LSE_REFERENCE``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

KERNEL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
REFERENCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 2e-5}
FP8_FACTOR = 4
LSE_KERNEL = 1e-3
LSE_REFERENCE = 1e-4


def tolerance(dtype: torch.dtype, *, fp8_kv: bool = False, reference: bool = False) -> float:
    """The bound for outputs of ``dtype`` (``reference``: two float32 computations, else a kernel)."""
    table = REFERENCE if reference else KERNEL
    if dtype not in table:
        raise ValueError(f"no tolerance for {dtype}; the table has {list(table)}")
    return table[dtype] * (FP8_FACTOR if fp8_kv else 1)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
                 fp8_kv: bool = False, reference: bool = False, lse: bool = False,
                 msg: Optional[Callable[[str], str]] = None) -> None:
    """Assert ``out`` matches ``ref`` within the table's bound (``dtype``: of the output, default ``out``'s;
    ``lse``: the tensors are LSEs)."""
    if lse:
        tol = LSE_REFERENCE if reference else LSE_KERNEL
    else:
        tol = tolerance(dtype or out.dtype, fp8_kv=fp8_kv, reference=reference)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=msg)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``|out - ref| / (1 + |ref|)``: the ``tol`` that :func:`assert_close` would need (NaN where
    either side is NaN)."""
    diff = (out.float() - ref.float()).abs() / (1 + ref.float().abs())
    return float(diff.max()) if diff.numel() else 0.0


# DeepGEMM's pass rule for FP8 GEMMs (its tests' ``QuantConfig.max_diff``), used where its cases are our suite
FP8_GEMM_CALC_DIFF = 1e-3


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity of two results: ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in float64 (0 when identical
    or both zero; small when close in direction and norm). Non-finite entries make it NaN, so they fail any bound."""
    x, y = x.double(), y.double()
    denom = float((x * x + y * y).sum())
    return 0.0 if denom == 0.0 else 1.0 - 2.0 * float((x * y).sum()) / denom
