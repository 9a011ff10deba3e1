"""DeepGEMM's own test cases for its grouped FP8 GEMMs, run on our ``moe.grouped_gemm_fp8`` (contiguous) and
``moe.grouped_gemm_fp8_masked``, graded by DeepGEMM's rule, and, where ``deep_gemm`` imports (on the device:
``prepare.sh --peers``), DeepGEMM's kernel on the same FP8 operands in the same process.

    python scripts/deepgemm_suite.py [--device cuda] [--out FILE.json] [--kinds contiguous,masked]
    python scripts/deepgemm_suite.py --device cpu --shrink 16     # the harness on a CPU (our float32 reference)

The cases are those of DeepGEMM's test generators (``tests/generators.py``, 2.x) for the 1 x 128 / 128 x 128 FP8
recipe (SM90's):

- contiguous: (groups, expected m) in (4, 8192) and (8, 4096); each group's m drawn uniformly in 0.7-1.3x the
  expected m and its rows padded to DeepGEMM's contiguous alignment (128) with layout ``-1``;
- masked: ``max_m`` 4096 and (groups, expected m) in (32, 192), (6, 1024), (32, 20), (6, 20); each group's
  ``masked_m`` drawn in 0.7-1.3x the expected m; DeepGEMM's kernel gets its ``expected_m`` hint as its tests pass it;
- (N, K) in (6144, 7168), (7168, 3072), (4096, 4096), (4096, 2048), each with every group case.

Operands are bf16 ``randn``; the activations are cast per token (1 x 128 groups), the weights per 128 x 128 block,
each scale ``amax / 448``. The reference is the bf16 product ``a @ b[g]^T`` in float32 over the real rows, and a
case passes when DeepGEMM's ``calc_diff`` of ours against it is below 1e-3 (its FP8 bound); ``vs_deepgemm`` is
``calc_diff`` of ours against DeepGEMM's output (0 when bit-identical). ``--shrink F`` divides m, N and K by F
(N and K kept multiples of 128), for a CPU run of the harness.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from musa_attn_backend.kernels import moe  # noqa: E402
from musa_attn_backend.testing.numeric import FP8_GEMM_CALC_DIFF, calc_diff  # noqa: E402

NK = [(6144, 7168), (7168, 3072), (4096, 4096), (4096, 2048)]
CONTIGUOUS = [(4, 8192), (8, 4096)]
MASKED = [(32, 192), (6, 1024), (32, 20), (6, 20)]
MASKED_MAX_M = 4096
ALIGN = 128  # DeepGEMM's get_mk_alignment_for_contiguous_layout() on SM90


def _shrunk(v: int, shrink: int, multiple: int = 1) -> int:
    return max(multiple, v // shrink // multiple * multiple)


def cases(kinds, shrink: int = 1):
    """``(kind, groups, expected_m, N, K, max_m)`` in DeepGEMM's order, sizes divided by ``shrink`` (``max_m``: the
    masked layout's rows a group, 0 for the contiguous one)."""
    out = []
    for N, K in NK:
        n, k = _shrunk(N, shrink, 128), _shrunk(K, shrink, 128)
        if "contiguous" in kinds:
            out += [("contiguous", g, _shrunk(m, shrink), n, k, 0) for g, m in CONTIGUOUS]
        if "masked" in kinds:
            out += [("masked", g, _shrunk(m, shrink), n, k, _shrunk(MASKED_MAX_M, shrink)) for g, m in MASKED]
    return out


def cast_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [G, N, K], float32 [G, N/128, K/128])``: each 128 x 128 block of ``w`` scaled by its ``amax / 448``
    (``amax`` at least 1e-4), DeepGEMM's per-block cast."""
    G, N, K = w.shape
    blocks = w.float().view(G, N // 128, 128, K // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4)
    q = (blocks / (amax / 448.0)).to(torch.float8_e4m3fn).view(G, N, K)
    return q, (amax / 448.0).view(G, N // 128, K // 128)


def _expert_ms(groups: int, expected_m: int, rng: random.Random) -> list[int]:
    return [int(expected_m * rng.uniform(0.7, 1.3)) for _ in range(groups)]


def run_case(kind, groups, expected_m, N, K, max_m, device, rng, gen, deep_gemm=None) -> dict:
    b16 = torch.randn(groups, N, K, device=device, generator=gen).to(torch.bfloat16)
    b, sb = cast_blocks(b16)
    ms = _expert_ms(groups, expected_m, rng)
    res = {"kind": kind, "groups": groups, "expected_m": expected_m, "N": N, "K": K, "ms": ms}
    if kind == "contiguous":
        aligned = [(m + ALIGN - 1) // ALIGN * ALIGN for m in ms]
        M = sum(aligned)
        layout = torch.full((M,), -1, dtype=torch.int32)
        start, real = 0, torch.zeros(M, dtype=torch.bool)
        for g, (m, am) in enumerate(zip(ms, aligned)):
            layout[start:start + m] = g
            real[start:start + m] = True
            start += am
        layout, real = layout.to(device), real.to(device)
        a16 = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16) * real[:, None]
        a, sa = moe.quantize_groups(a16)
        ref = torch.zeros(M, N, device=device)
        for g in range(groups):
            rows = layout == g
            ref[rows] = a16[rows].float() @ b16[g].float().T
        ours = moe.grouped_gemm_fp8(a, sa, b, sb, layout)
        theirs = None
        if deep_gemm is not None:
            theirs = torch.empty_like(ours)
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), theirs, layout)
        sel = real
    else:
        masked_m = torch.tensor(ms, dtype=torch.int32, device=device)
        assert max(ms) <= max_m, f"masked_m {max(ms)} past max_m {max_m}"  # as DeepGEMM's generator asserts
        res["max_m"] = max_m
        a16 = torch.randn(groups, max_m, K, device=device, generator=gen).to(torch.bfloat16)
        a, sa = moe.quantize_groups(a16)
        ref = torch.einsum("gmk,gnk->gmn", a16.float(), b16.float())
        ours = moe.grouped_gemm_fp8_masked(a, sa, b, sb, masked_m)
        theirs = None
        if deep_gemm is not None:
            theirs = torch.empty_like(ours)
            deep_gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), theirs, masked_m, int(expected_m * 1.2))
        sel = torch.arange(max_m, device=device)[None, :] < masked_m[:, None]
    if device == "cuda":
        torch.cuda.synchronize()
    res["calc_diff"] = calc_diff(ours[sel].float(), ref[sel])
    res["passed"] = bool(res["calc_diff"] < FP8_GEMM_CALC_DIFF)
    if theirs is not None:
        res["deepgemm_calc_diff"] = calc_diff(theirs[sel].float(), ref[sel])
        res["vs_deepgemm"] = calc_diff(ours[sel].float(), theirs[sel].float())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--kinds", default="contiguous,masked")
    ap.add_argument("--shrink", type=int, default=1, help="divide m, N and K by this (a CPU run of the harness)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    kinds = set(args.kinds.split(","))
    try:
        import deep_gemm
    except ImportError:
        deep_gemm = None
    rng = random.Random(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    results, t0 = [], time.time()
    all_cases = list(cases(kinds, args.shrink))

    def summary() -> dict:
        passed = sum(r["passed"] for r in results)
        return {"suite": "deepgemm-grouped-fp8", "device": torch.cuda.get_device_name() if args.device == "cuda"
                else "cpu", "deep_gemm": getattr(deep_gemm, "__version__", "present") if deep_gemm else None,
                "shrink": args.shrink, "seed": args.seed, "cases_total": len(all_cases), "ran": len(results),
                "passed": passed, "seconds": round(time.time() - t0, 1), "bound": FP8_GEMM_CALC_DIFF,
                "cases": results}

    for case in all_cases:
        try:
            r = run_case(*case, args.device, rng, gen, deep_gemm)
        except Exception as e:  # noqa: BLE001 - a case that raises is a failure, recorded; the suite goes on
            r = dict(zip(("kind", "groups", "expected_m", "N", "K", "max_m"), case), passed=False,
                     error=f"{type(e).__name__}: {e}"[:300])
        results.append(r)
        print(f"{r['kind']:10s} groups {r['groups']:2d} m~{r['expected_m']:5d} N {r['N']:5d} K {r['K']:5d}  "
              f"{'PASS' if r['passed'] else 'FAIL'}  calc_diff {r.get('calc_diff', float('nan')):.2e}"
              + (f"  vs DeepGEMM {r['vs_deepgemm']:.2e}" if "vs_deepgemm" in r else "")
              + (f"  {r['error']}" if "error" in r else ""), flush=True)
        if args.out:  # after every case: a run cut by its time limit keeps what it ran
            Path(args.out).write_text(json.dumps(summary(), indent=1))
    doc = summary()
    print(f"deepgemm suite: {doc['passed']}/{doc['ran']} passed of {doc['cases_total']}, {doc['seconds']} s")
    return 0 if doc["passed"] == doc["ran"] == doc["cases_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
