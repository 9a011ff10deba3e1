"""A first GPU look at the paired_ws program (one short device call): Flash / Pro prefill of ``--tokens`` query
tokens on the bench's caches (``benchmarks/bench_dsv4_attention.py``), its output against the scheduled
program's, and the times of the scheduled program, the paired_ws call, its workspace build and its kernel alone,
in its default build and with every build switch off (``plain_*``: ``scripts/ws_variants.py``'s ``base``), and the
portable program over the workspace in the CUDA and MUSA forms (``portable_ws_*``, ``musa_portable_ws_*``) and the
staged one (``staged_ws_*``, one form: MUSA's rules on every target).

    python3 scripts/ws_smoke.py [--configs flash] [--tokens 4096] [--out DIR]   (on the GPU, after env.sh)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "benchmarks"), str(HERE.parent), str(HERE)]

from ws_variants import SWITCHES, select, write_doc  # noqa: E402 - the paired_ws build switches by variant name


def _compile(job):
    """One kernel, in a worker process (it lands in the kernel cache on disk)."""
    from musa_attn_backend import config
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    kind, H = job
    if kind in ("ws", "ws_plain"):
        if kind == "ws_plain":
            select("base")
        ti.paired_ws_kernel(H, True, "bfloat16")
        ti.workspace_rows_kernel()
    elif kind.startswith("portable_ws"):  # portable_ws[_musa][_prefetch]
        from musa_attn_backend.kernels.dsv4.sparse import portable_ws_kernel as pws

        pws.PREFETCH = kind.endswith("_prefetch")
        with config.override(musa_forms="_musa" in kind):
            ti.portable_ws_kernel(H, True, "bfloat16")
    elif kind == "staged_ws":
        ti.staged_ws_kernel(H, True, "bfloat16")
    elif kind == "sched":
        ti.sparse_mqa_kernel(H, True, True, False, "bfloat16", program="scheduled")
    else:
        ti.sched_combine_kernel(H, True, "bfloat16")
    return job


# the (heads, sink) pairs of tests/dsv4/test_gpu_dsv4.py's cases and FlashMLA-entry cases
TEST_HEADS = [(h, True) for h in (8, 16, 24, 32, 64, 96, 128)] + [(8, False)]


def _compile_test(job):
    from musa_attn_backend import config
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    form, H, sink = job
    if form == "rows":
        ti.workspace_rows_kernel()
    elif form.startswith("paired"):  # paired (the default build), or paired_ and a ws_variants.py variant
        if form != "paired":
            select(form[len("paired_"):])
        ti.paired_ws_kernel(H, sink, "bfloat16")
    elif form.startswith("staged"):  # staged, staged_overlap
        from musa_attn_backend.kernels.dsv4.sparse import staged_ws_kernel as sws

        sws.OVERLAP = form.endswith("_overlap")
        ti.staged_ws_kernel(H, sink, "bfloat16")
    else:  # portable, portable_musa, and either with _prefetch
        from musa_attn_backend.kernels.dsv4.sparse import portable_ws_kernel as pws

        pws.PREFETCH = form.endswith("_prefetch")
        with config.override(musa_forms=form.startswith("portable_musa")):
            ti.portable_ws_kernel(H, sink, "bfloat16")
    return job


def precompile_tests(forms=None) -> int:
    """Every workspace program the GPU tests launch (``forms``: only those of these forms, e.g. ``staged``), into
    the kernel cache, 14 at a time."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    jobs = [("rows", 0, False)] + [(f, H, sink) for f in ("paired", "paired_base", "portable", "portable_musa",
                                                       "portable_prefetch", "portable_musa_prefetch", "staged",
                                                       "staged_overlap")
                                   for H, sink in TEST_HEADS]
    jobs += [(f"paired_{v}", H, True) for H in (16, 64, 128)  # test_gpu_dsv4.py's variant cases
             for v in ("pipelined", "hint", "smem_out", "hint+smem_out", "hint+smem_out+qasync",
                       "hint+smem_out+qasync+rowcopy", "pipelined+hint+smem_out+qasync+rowcopy",
                       "hint+smem_out+qasync+rowcopy+groupcopy", "pipelined+hint+smem_out+qasync+rowcopy+groupcopy",
                       "pipelined+hint+smem_out+qasync+rowcopy+groupcopy+adjacent")]
    if forms:
        jobs = [j for j in jobs if j[0] in forms]
    t0, failed = time.time(), 0
    with ProcessPoolExecutor(max_workers=14, mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, f in [(j, pool.submit(_compile_test, j)) for j in jobs]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - the tests report what cannot launch
                failed += 1
                print(f"precompile {job}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"precompiled {len(jobs) - failed}/{len(jobs)} workspace programs in {time.time() - t0:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="flash")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--precompile-tests", action="store_true",
                    help="only compile, in parallel, every workspace program the GPU tests launch, then exit")
    ap.add_argument("--forms", default="", help="with --precompile-tests: only these forms (comma-separated)")
    args = ap.parse_args(argv)
    if args.precompile_tests:
        return precompile_tests([f for f in args.forms.split(",") if f])
    import torch

    from bench_attention import bench_ms
    from bench_dsv4_attention import CONFIGS, caches, inputs, ws_times
    from musa_attn_backend import config
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw
    from musa_attn_backend.kernels.dsv4.sparse import portable_ws_kernel as pws
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    defaults = {attr: getattr(pw, attr) for attr in SWITCHES.values()}
    prefetch_default = pws.PREFETCH
    heads = [CONFIGS[c][0] for c in args.configs.split(",")]
    with ProcessPoolExecutor(max_workers=6, mp_context=multiprocessing.get_context("spawn")) as pool:
        kinds = ("ws", "ws_plain", "portable_ws", "portable_ws_musa", "portable_ws_prefetch",
                 "portable_ws_musa_prefetch", "staged_ws", "sched", "combine")
        for f in [pool.submit(_compile, (k, H)) for H in heads for k in kinds]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - the timing reports what cannot launch
                print(f"precompile: {type(e).__name__}: {str(e)[:300]}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(65536)
    rows = []
    for cfg in args.configs.split(","):
        H, K = CONFIGS[cfg]
        q, i1, i2, sink = inputs(args.tokens, H, K, swa, c4, g)
        ref = torch.empty_like(q)
        plan = ti.sparse_mqa_plan(q, i1, None, i2, None)
        sched = lambda: ti.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink,  # noqa
                                               out=ref, program="scheduled", plan=plan)
        row = {"op": "prefill", "shape": {"config": cfg, "tokens": args.tokens, "heads": H, "topk": K + 128},
               "scheduled_ms": bench_ms(sched)}
        sched()
        # the paired program in its default build and with every switch off, the portable one in the CUDA and
        # MUSA forms
        for tag, program, plain, musa in (("", "paired_ws", False, False), ("plain_", "paired_ws", True, False),
                                          ("", "portable_ws", False, False), ("musa_", "portable_ws", False, True),
                                          ("prefetch_", "portable_ws", False, False),
                                          ("musa_prefetch_", "portable_ws", False, True),
                                          ("", "staged_ws", False, False)):
            if plain:
                select("base")
            pws.PREFETCH = "prefetch" in tag
            out = torch.full_like(q, float("nan"))
            try:
                with config.override(musa_forms=musa):
                    row.update({tag + k: v for k, v in ws_times(q, swa, i1, c4, i2, sink, out, program).items()})
                torch.cuda.synchronize()
                row[f"{tag}{program}_max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
                row[f"{tag}{program}_finite"] = bool(torch.isfinite(out).all())
            except Exception as e:  # noqa: BLE001 - recorded
                row[f"{tag}{program}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            for attr, value in defaults.items():  # the default build's switches back
                setattr(pw, attr, value)
            pws.PREFETCH = prefetch_default
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_doc(args.out, "ws-smoke", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
