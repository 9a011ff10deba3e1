"""Where the V4 sparse MQA's time goes on a GPU: every kernel one call launches and its device time, for the
scheduled, paired and warp-specialised programs and FlashMLA's decode (``flashmla_peer``), on the benchmark's
inputs (``benchmarks/bench_dsv4_attention.py``).

    python scripts/profile_dsv4_attention.py --out DIR [--cases flash:1:1,flash:64:1,flash:4096:1]
        torch.profiler: per case and candidate, each kernel's mean device time over 10 calls -> DIR/profile.json
    ncu --clock-control none --profile-from-start off --section ... python scripts/profile_dsv4_attention.py --ncu
        the same calls, one each, between cudaProfilerStart/Stop (only these reach ncu)

A case is ``config:tokens:s_q`` (config flash or pro; tokens = requests x s_q; s_q 1 and tokens > 256 is a
prefill-sized batch, timed the same way).
"""

from __future__ import annotations

import os
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_dsv4_attention import CONFIGS, caches, flashmla_decode, flashmla_peer, inputs  # noqa: E402

from musa_attn_backend.kernels import dsv4  # noqa: E402
from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti  # noqa: E402


def candidates(cfg: str, T: int, s_q: int, swa, c4, g):
    """``{name: callable}`` for one case, each run once (compiled, planned) before it is returned."""
    H, K = CONFIGS[cfg]
    q, i1, i2, sink = inputs(T, H, K, swa, c4, g)
    out = torch.empty_like(q)
    plan = dsv4.sparse_mqa_plan(q, i1, None, i2, None)
    fns = {}
    for prog in os.environ.get("PROFILE_PROGRAMS", "scheduled,paired").split(","):
        fns[prog] = (lambda p=prog: ti.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink,
                                                           out=out, program=p, plan=plan))
    ops = flashmla_peer({})
    if ops is not None and T <= 512:
        B = T // s_q
        out4 = torch.empty(B, s_q, H, 512, device="cuda", dtype=torch.bfloat16)
        fns["flashmla"] = flashmla_decode(ops, q.view(B, s_q, H, 512), swa, i1.view(B, s_q, 128), c4,
                                          i2.view(B, s_q, K), sink, out4)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    return fns


def ncu_once(calls: dict) -> None:
    """Each of ``calls`` (``{name: callable}``, run in order) once between cudaProfilerStart/Stop, in an NVTX range
    of its name: what ``ncu --profile-from-start off`` profiles."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in calls.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile(fn, calls: int = 10) -> list:
    """``[(kernel name, mean device µs a call, launches a call)]`` over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = ev.cuda_time_total
        if dev_us and ev.count:
            rows.append((ev.key[:120], dev_us / calls, ev.count / calls))
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="flash:1:1,flash:2:2,flash:8:1,flash:64:1,flash:128:1,flash:4096:1,pro:1:1")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--ncu", action="store_true", help="one call of each candidate between cudaProfilerStart/Stop")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(65536)
    report = {"device": torch.cuda.get_device_name(), "cases": {}}
    for case in args.cases.split(","):
        cfg, T, s_q = case.split(":")
        fns = candidates(cfg, int(T), int(s_q), swa, c4, g)
        if args.ncu:
            ncu_once({f"{case}/{name}": fn for name, fn in fns.items()})
            continue
        report["cases"][case] = {name: profile(fn) for name, fn in fns.items()}
        for name, rows in report["cases"][case].items():
            total = sum(r[1] for r in rows)
            print(f"{case:>14} {name:>17} {total:8.1f} us  " + "; ".join(f"{k[:60]} {us:.1f}us x{n:g}"
                                                                     for k, us, n in rows), flush=True)
    if not args.ncu:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
