"""The scheduled V4 program's build variants timed against each other and FlashMLA, on one GPU, same run: where the
combine's programmatic dependent launch is triggered (``tilelang_impl.SCHED_PDL``: none, each block's start, or
after its last tile as FlashMLA's SM90 decode does) and the producer's cache-hinted loads
(``SCHED_LOAD_HINT``), the producer's L2 prefetch of the next tile's rows (``SCHED_PREFETCH``), and the plan's slack (``schedule.PLAN_SLACK``: each part's span longer by a piece's overhead,
as FlashMLA's planner cuts). Each variant's outputs are compared with the default build's (the same arithmetic: they
must be equal bit for bit) on the benchmark's inputs and on ragged ones (per-token lengths, invalid entries).

    python3 scripts/sched_variants.py [--out DIR] [--variants base,end,hint,hint+end] [--tests VARIANT]
        (on the lent GPU, after source .device/env.sh)

``--tests VARIANT`` first runs the scheduled program's GPU tests with that variant built
(``tests/dsv4/test_gpu_dsv4.py -k "scheduled or plan or inf"``, through ``scripts/pytest_sched_variant.py``).
A variant is ``base`` or ``+``-joined parts: ``start`` / ``end`` (the trigger), ``hint`` (the loads), ``prefetch``,
``slack`` (the plan), ``groups`` (the combine: a block a split token, ``tilelang_impl.SCHED_COMBINE_GROUPS``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "benchmarks"), str(HERE.parent), str(HERE)]

CASES = {"flash": (1, 32, 64, 128), "pro": (1, 32, 64)}


def use(variant: str) -> None:
    """Build and launch the scheduled program as ``variant`` from now on."""
    from musa_attn_backend.kernels.dsv4.sparse import schedule
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
    from musa_attn_backend.kernels.dsv4.sparse.combine_kernel import MAX_GROUPS

    parts = set(variant.split("+")) - {"base"}
    unknown = parts - {"start", "end", "hint", "slack", "prefetch", "groups"}
    if unknown:
        raise SystemExit(f"unknown variant part(s) {sorted(unknown)} in {variant!r}")
    ti.SCHED_PDL = "end" if "end" in parts else "start" if "start" in parts else ""
    ti.SCHED_LOAD_HINT = "hint" in parts
    ti.SCHED_PREFETCH = "prefetch" in parts
    schedule.PLAN_SLACK = schedule.OVERHEAD_TILES if "slack" in parts else 0
    ti.SCHED_COMBINE_GROUPS = 1 << 20 if "groups" in parts else MAX_GROUPS  # a block a split token


def _compile(job):
    """One kernel of a variant, in a worker process (it lands in the kernel cache on disk)."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    variant, H, cluster = job
    use(variant)
    ti.sched_kernel(H, True, True, "bfloat16", cluster=cluster)
    ti.sched_combine_kernel(H, True, "bfloat16")
    return job


def precompile(variants) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # the plan and the combine's grid need no build of their own
    builds = {"+".join(p for p in v.split("+") if p not in ("slack", "groups")) or "base" for v in variants}
    jobs = [(v, H, cl) for v in sorted(builds) for H, cl in ((64, False), (128, False), (128, True))]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(12, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, fut in [(j, pool.submit(_compile, j)) for j in jobs]:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - the timing reports what cannot launch
                print(f"precompile {job}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"precompiled {len(jobs)} kernel pairs in {time.time() - t0:.0f} s", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, what in (("--out", "/tmp/out", "where the JSON goes"),
                                ("--variants", "base,end,hint", "comma-separated variants to time"),
                                ("--tests", "", "run the scheduled program's GPU tests with this variant first")):
        ap.add_argument(flag, default=default, help=what)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    precompile(variants + ([args.tests] if args.tests and args.tests not in variants else []))
    rc = 0
    if args.tests:
        import subprocess

        env = dict(os.environ, MUSA_ATTN_SCHED_VARIANT=args.tests, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
        rc = subprocess.call([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-p",
                              "pytest_sched_variant", "-n", "2", "-rs", str(HERE.parent / "tests/dsv4/test_gpu_dsv4.py"),
                              "-k", "scheduled or plan or inf"], env=env, timeout=300)
        print(f"scheduled program's GPU tests as {args.tests}: pytest rc {rc}", flush=True)

    import torch

    from bench_attention import bench_ms, git_commit
    from bench_dsv4_attention import CONFIGS, caches, flashmla_decode, flashmla_peer, inputs
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(65536)
    fm = flashmla_peer({})
    rows = []
    for cfg, sizes in CASES.items():
        H, K = CONFIGS[cfg]
        for T in sizes:
            q, i1, i2, sink = inputs(T, H, K, swa, c4, g)
            # ragged: per-token lengths (some zero) and invalid entries, the same tokens
            l1 = torch.randint(0, 129, (T,), device="cuda", generator=g, dtype=torch.int32)
            l2 = torch.randint(0, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
            j1, j2 = i1.clone(), i2.clone()
            j1[:, ::7] = -1
            j2[:, ::5] = 1 << 30
            row = {"op": "decode", "shape": {"config": cfg, "tokens": T, "s_q": 1, "heads": H, "topk": K + 128}}
            outs = {}
            for v in variants:
                use(v)
                plan = ti.sparse_mqa_plan(q, i1, None, i2, None)
                rplan = ti.sparse_mqa_plan(q, j1, l1, j2, l2)
                out, rout = torch.empty_like(q), torch.empty_like(q)

                def fn():
                    ti.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink, out=out,
                                           program="scheduled", plan=plan)
                try:
                    row[f"{v}_ms"] = bench_ms(fn)
                    _, rlse = ti.sparse_mqa_tilelang(q, swa, j1, l1, extra_cache=c4, extra_indices=j2,
                                                     extra_lengths=l2, sink=sink, out=rout, program="scheduled",
                                                     plan=rplan, return_lse=True)
                    torch.cuda.synchronize()
                    outs[v] = (out.clone(), rout.clone(), rlse.clone())
                except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, the run goes on
                    row[f"{v}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if "base" in outs:
                for v, (o, ro, rl) in outs.items():
                    b = outs["base"]
                    row[f"{v}_equal"] = bool(torch.equal(o, b[0]) and torch.equal(ro, b[1])
                                             and torch.equal(rl.nan_to_num(), b[2].nan_to_num()))
                    row[f"{v}_max_diff"] = max((o.float() - b[0].float()).abs().max().item(),
                                               (ro.float() - b[1].float()).abs().max().item())
            if fm is not None:
                out4 = torch.empty(T, 1, H, 512, device="cuda", dtype=torch.bfloat16)
                row["flashmla_ms"] = bench_ms(flashmla_decode(fm, q.view(T, 1, H, 512), swa, i1.view(T, 1, 128), c4,
                                                              i2.view(T, 1, K), sink, out4))
            print(json.dumps(row), flush=True)
            rows.append(row)
    use("base")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    doc = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MUSA_ATTN_COMMIT") or git_commit(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "tests_variant": args.tests,
           "tests_rc": int(rc), "what": "scheduled program variants (SCHED_PDL, SCHED_LOAD_HINT), CUDA-graph replays",
           "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"sched-variants-{stamp}.json").write_text(json.dumps(doc, indent=1))
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
