"""DeepSeek-V4's model-side kernels (``kernels/dsv4/model*.py``) against DeepSeek's TileKernels (``tile_kernels``,
TileLang too; staged on the device by ``../shared/device/prepare.sh`` in ``.device/tl``) in one run, at V4-Flash's
and V4-Pro's widths, with the copy rate measured in the same run as the ceiling (all of them move bytes).

    python benchmarks/bench_dsv4_model.py [--quick] [--out benchmarks/results]

Rows (T tokens; bytes = what the op must read and write):
- ``swiglu_clamp``: ``[T, 2I]`` bf16 to ``[T, I]`` bf16, limit 10 (``silu_and_mul_clamp`` / TileKernels'
  ``quant.swiglu_forward(x, 'bf16', clamp_value=10)``), I = 2048 (Flash's experts), 3072 (Pro's).
- ``rope_inverse``: the attention output's last 64 dims of ``[T, heads, 512]`` bf16 rotated back in place at each
  token's position (``rope_(..., inverse=True)`` / ``transform.apply_rotary(..., interleaved=True,
  conjugate=True)``), heads 64 / 128.
- ``mhc_pre``: the program after the mixes GEMM: the split into pre / post / comb, 20 Sinkhorn steps, the
  ``pre``-weighted sum of the 4 streams ``[T, 4, hidden]`` bf16 (``mhc_pre_rows`` / ``mhc.mhc_pre_big_fuse_fwd``
  over one split-K partial); hidden 4096 / 7168.
- ``mhc_post``: the streams after a sublayer ``[T, 4, hidden]`` (``mhc_post`` / ``mhc.mhc_post_fwd``).

Every row also records the largest difference between our output and the peer's (the outputs are bf16 or float32
values of the same math; a large one means the row compares different work).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_attention import bench_ms, measure_ceilings, write_run  # noqa: E402
from bench_dsv4_attention import run_document  # noqa: E402

from musa_attn_backend.kernels.dsv4 import model as M  # noqa: E402
from musa_attn_backend.kernels.dsv4.model.tilelang_impl import mhc_pre_rows  # noqa: E402

LIMIT = 10.0
N_HC, ITERS, PRE_EPS, SK_EPS, POST_MULT, RMS_EPS = 4, 20, 1e-6, 1e-6, 2.0, 1e-6


def _diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def row(op, shape, ours_ms, peers, diffs, ceilings, bytes_):
    tbps = bytes_ / ours_ms / 1e9
    best = min((v for v in peers.values() if v), default=None)
    r = {"op": op, "shape": shape, "ours_ms": ours_ms, "peers": peers, "max_abs_diff_vs_peer": diffs,
         "tbps": tbps, "roofline_frac": tbps / ceilings["copy_tbps"],
         "ratio_vs_best_peer": best / ours_ms if best else None}
    print(f"{op:13s} {shape}  ours {ours_ms:.4f} ms  {tbps:5.2f} TB/s  roof {r['roofline_frac']:.2f}  "
          + "  ".join(f"{k} {v:.4f}" for k, v in peers.items() if v) + f"  diff {diffs}", flush=True)
    return r


def peer(name, fn, errors):
    """``fn()``'s time, or None with the failure recorded under ``name``."""
    try:
        fn()
        return bench_ms(fn)
    except Exception as e:  # noqa: BLE001 - a peer that fails is recorded, not fatal
        errors.setdefault(name, f"{type(e).__name__}: {str(e)[:300]}")
        return None


def swiglu_rows(rows, ceilings, errors, tk, tokens, g):
    for inter in (2048, 3072):
        for T in tokens:
            x = (torch.randn(T, 2 * inter, device="cuda", generator=g) * 8).to(torch.bfloat16)
            ours = lambda: M.silu_and_mul_clamp(x, LIMIT)  # noqa: E731
            peers, diffs = {}, {}
            if tk is not None:
                fn = lambda: tk.quant.swiglu_forward(x, "bf16", clamp_value=LIMIT)  # noqa: E731
                peers["tile_kernels"] = peer("tile_kernels swiglu", fn, errors)
                if peers["tile_kernels"]:
                    diffs["tile_kernels"] = _diff(ours(), fn())
            rows.append(row("swiglu_clamp", {"T": T, "I": inter}, bench_ms(ours), peers, diffs, ceilings,
                            T * 3 * inter * 2))


def rope_rows(rows, ceilings, errors, tk, tokens, g):
    max_pos = 65536
    angles = torch.rand(max_pos, 32, device="cuda", generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    cos_sin = torch.cat([cos, sin], 1).contiguous()  # TileKernels' table: cos then sin, [max_pos, 64]
    for heads in (64, 128):
        for T in tokens:
            o = torch.randn(T, heads, 512, device="cuda", generator=g).to(torch.bfloat16)
            pos = torch.randint(0, max_pos, (T,), device="cuda", generator=g)
            a, b = o.clone(), o.clone()
            ours = lambda: M.rope_(a[..., -64:], cos, sin, pos, inverse=True)  # noqa: E731
            peers, diffs = {}, {}
            if tk is not None:
                fn = lambda: tk.transform.apply_rotary(b[..., -64:], cos_sin, positions=pos, interleaved=True,  # noqa: E731
                                                       conjugate=True)
                peers["tile_kernels"] = peer("tile_kernels apply_rotary", fn, errors)
                if peers["tile_kernels"]:
                    a.copy_(o), b.copy_(o), ours(), fn()
                    diffs["tile_kernels"] = _diff(a, b)
            rows.append(row("rope_inverse", {"T": T, "heads": heads}, bench_ms(ours), peers, diffs, ceilings,
                            T * heads * 64 * 2 * 2))


def mhc_rows(rows, ceilings, errors, tk, tokens, g):
    n3 = N_HC * (N_HC + 2)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn(n3, device="cuda", generator=g) * 0.5
    for hidden in (4096, 7168):
        for T in tokens:
            res = torch.randn(T, N_HC, hidden, device="cuda", generator=g).to(torch.bfloat16)
            mul = torch.randn(1, T, n3, device="cuda", generator=g) * 30  # the GEMM's partial: x . fn
            sqr = torch.rand(1, T, device="cuda", generator=g) * hidden * N_HC + 1.0  # its sum of squares
            mixes = mul[0] * torch.rsqrt(sqr[0] / (hidden * N_HC) + RMS_EPS).unsqueeze(-1)
            ours = lambda: mhc_pre_rows(mixes, scale, base, res, iters=ITERS, head=False, pre_eps=PRE_EPS,  # noqa: E731
                                        sk_eps=SK_EPS, post_mult=POST_MULT)
            peers, diffs = {}, {}
            if tk is not None:
                post = torch.empty(T, N_HC, device="cuda")
                comb = torch.empty(T, N_HC * N_HC, device="cuda")
                y = torch.empty(T, hidden, device="cuda", dtype=torch.bfloat16)
                fn = lambda: tk.mhc.mhc_pre_big_fuse_fwd(mul, sqr, scale, base, res, post, comb, y, RMS_EPS,  # noqa: E731
                                                         PRE_EPS, SK_EPS, POST_MULT, ITERS, n_splits=1)
                peers["tile_kernels"] = peer("tile_kernels mhc_pre_big_fuse_fwd", fn, errors)
                if peers["tile_kernels"]:
                    p, c, yy = ours()
                    fn()
                    diffs["tile_kernels"] = max(_diff(p, post), _diff(c.flatten(1), comb), _diff(yy, y))
            rows.append(row("mhc_pre", {"T": T, "hidden": hidden}, bench_ms(ours), peers, diffs, ceilings,
                            T * (N_HC * hidden * 2 + hidden * 2 + n3 * 4 + (N_HC + N_HC * N_HC) * 4)))
            x = torch.randn(T, hidden, device="cuda", generator=g).to(torch.bfloat16)
            post4 = torch.rand(T, N_HC, 1, device="cuda", generator=g) * 2
            comb4 = torch.rand(T, N_HC, N_HC, device="cuda", generator=g)
            ours_post = lambda: M.mhc_post(x, res, post4, comb4)  # noqa: E731
            peers, diffs = {}, {}
            if tk is not None:
                fn = lambda: tk.mhc.mhc_post_fwd(x[None], res[None], post4[None], comb4[None])  # noqa: E731
                peers["tile_kernels"] = peer("tile_kernels mhc_post_fwd", fn, errors)
                if peers["tile_kernels"]:
                    diffs["tile_kernels"] = _diff(ours_post(), fn()[0])
            rows.append(row("mhc_post", {"T": T, "hidden": hidden}, bench_ms(ours_post), peers, diffs, ceilings,
                            T * (2 * N_HC * hidden * 2 + hidden * 2)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ops", default="swiglu,rope,mhc", help="comma-separated: swiglu, rope, mhc")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    errors: dict = {}
    try:
        import tile_kernels as tk
    except Exception as e:  # noqa: BLE001 - the rows are still worth having; the reason goes in the JSON
        tk = None
        errors["tile_kernels"] = f"{type(e).__name__}: {str(e)[:300]}"
    ceilings = measure_ceilings()
    print("ceilings", ceilings, "tile_kernels", getattr(tk, "__version__", None), flush=True)
    tokens = (1, 4096) if args.quick else (1, 64, 512, 4096, 16384)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list = []
    for name, fn in (("swiglu", swiglu_rows), ("rope", rope_rows), ("mhc", mhc_rows)):
        if name in args.ops.split(","):
            try:
                fn(rows, ceilings, errors, tk, tokens, g)
            except Exception as e:  # noqa: BLE001 - keep the rows measured so far
                errors[f"ours_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
    doc = run_document(ceilings, errors, rows)
    doc["versions"]["tile_kernels"] = getattr(tk, "__version__", None)
    write_run(args.out, "dsv4-model", doc)


if __name__ == "__main__":
    main()
