"""The paired_ws program's build variants beside FlashMLA's sparse prefill, kernel against kernel on FlashMLA's own
inputs (its bf16 workspace of every cache row and its rebased lists, ``benchmarks/bench_dsv4_attention.py``'s
``flashmla_prefill``), in one process on the GPU.

A variant is ``base`` or ``+``-joined switches of :mod:`musa_attn_backend.kernels.dsv4.sparse.paired_ws_kernel`:
``pipelined`` (``PIPELINED``: FlashMLA's order of the math groups), ``hint`` (``COPY_HINT``: the producer's copies
with an L2 evict-last policy and a 256-byte prefetch), ``smem_out`` (``SMEM_EPILOGUE``: the output staged in
shared memory, stored in 16-byte pieces), ``rowcopy`` (``ROW_COPY``, with ``hint``: the producer's copies
addressed from each entry's row), ``qasync`` (``Q_ASYNC``: the query's copies complete their barrier
themselves, the key tiles' copies start at once). Each row: FlashMLA's time, each variant's time on those inputs
(``<variant>_ms``) and through our own workspace (``<variant>_own_ws_ms``: the kernel alone, CUDA graph), its
largest difference from FlashMLA's output and whether it equals the base build's output bit for bit (the switches
change no arithmetic, only how bytes move). ``flashmla_graph_ms`` and ``<variant>_kernel_ms``: FlashMLA's call
and our kernel alone (no entry, no allocations) on the same inputs, each replayed from a CUDA graph.
``--programs``: other programs over the workspace timed the same way, kernel alone from a graph on FlashMLA's
inputs (``<program>_kernel_ms``, ``<program>_max_abs_diff`` from FlashMLA's output): ``staged_ws``, ``portable_ws``
and ``portable_ws:musa`` (MUSA's form, ``MUSA_ATTN_MUSA_FORMS``; key ``portable_ws_musa_*``), ``staged_ws:overlap``
(its ``OVERLAP`` build).

    python3 scripts/ws_variants.py [--variants base,hint,...] [--programs staged_ws,portable_ws:musa]
                                   [--configs flash,pro] [--tokens 4096] [--out DIR]
    ncu ... python3 scripts/ws_variants.py --ncu --variants base,hint+smem_out --configs flash
        one call of FlashMLA's kernel and of each variant between cudaProfilerStart/Stop
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "benchmarks"), str(HERE.parent)]

from musa_attn_backend.kernels.dsv4.sparse.paired_ws_kernel import SWITCHES  # noqa: E402 - after sys.path


def select(variant: str) -> None:
    """Set the paired_ws program's switches to ``variant`` (the launcher's kernel key holds them)."""
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw

    on = set() if variant == "base" else set(variant.split("+"))
    unknown = on - set(SWITCHES)
    if unknown:
        raise SystemExit(f"ws_variants: unknown switch(es) {sorted(unknown)}; known: {sorted(SWITCHES)}")
    for name, attr in SWITCHES.items():
        setattr(pw, attr, name in on)


def program_kernel(program: str, H: int, sink: bool = True):
    """The compiled kernel of a workspace ``program`` (``name`` or ``name:musa``, MUSA's form)."""
    from musa_attn_backend import config
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    name, _, form = program.partition(":")
    if name == "staged_ws":  # staged_ws:overlap, its OVERLAP build
        from musa_attn_backend.kernels.dsv4.sparse import staged_ws_kernel as sws

        sws.OVERLAP = form == "overlap"
    with config.override(musa_forms=form == "musa"):
        return ti._WS_KERNELS[name](H, sink, "bfloat16")


def _compile(job):
    """One variant's kernel (or, ``program:`` first, another workspace program's) for ``H`` heads (with a sink or
    not), in a worker process (it lands in the kernel cache on disk)."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    variant, H, sink = job
    if variant.startswith("program:"):
        program_kernel(variant[len("program:"):], H, sink)
        return job
    select(variant)
    ti.paired_ws_kernel(H, sink, "bfloat16")
    ti.workspace_rows_kernel()
    return job


def precompile(variants, heads, sinks=(True,)) -> None:
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(max_workers=12, mp_context=multiprocessing.get_context("spawn")) as pool:
        for f in [pool.submit(_compile, (v, H, sink)) for H in heads for v in variants for sink in sinks]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - the timing reports what cannot launch
                print(f"precompile: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"precompiled {len(variants) * len(heads) * len(sinks)} kernels in {time.time() - t0:.0f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="base,hint,smem_out,hint+smem_out,hint+smem_out+qasync,"
                                          "pipelined+hint+smem_out,pipelined+hint+smem_out+qasync")
    ap.add_argument("--programs", default="", help="other workspace programs to time (module docstring)")
    ap.add_argument("--configs", default="flash,pro")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--precompile-only", action="store_true",
                    help="compile the variants for the configs' heads, with and without a sink, then exit")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        select(v)  # unknown switches fail here, before any compile
    programs = [p for p in args.programs.split(",") if p]
    jobs = variants + [f"program:{p}" for p in programs]
    if args.precompile_only:
        from bench_dsv4_attention import CONFIGS

        precompile(jobs, sorted({CONFIGS[c][0] for c in args.configs.split(",")}), (True, False))
        return 0
    import torch

    from bench_attention import bench_ms
    from bench_dsv4_attention import CONFIGS, caches, flashmla_peer, flashmla_prefill, inputs, ws_times
    from musa_attn_backend.kernels import dsv4
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    configs = args.configs.split(",")
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw

    default_variant = "+".join(n for n, attr in SWITCHES.items() if getattr(pw, attr)) or "base"
    precompile(jobs, sorted({CONFIGS[c][0] for c in configs}))
    errors: dict = {}
    fm = flashmla_peer(errors)
    if fm is None:
        raise SystemExit(f"ws_variants: FlashMLA is not importable here: {errors}")
    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(65536)
    rows = []
    scale = 512 ** -0.5
    for cfg in configs:
        H, K = CONFIGS[cfg]
        q, i1, i2, sink = inputs(args.tokens, H, K, swa, c4, g)
        fn, kv, idx = flashmla_prefill(fm, q, swa, i1, c4, i2, sink)
        ours = lambda: dsv4.flash_mla_sparse_fwd(q, kv, idx, scale, attn_sink=sink)  # noqa: E731 - the variant selected
        for v in variants:
            select(v)
            ours()  # each kernel loaded before any timing or profiling
        torch.cuda.synchronize()
        if args.ncu:
            from profile_dsv4_attention import ncu_once

            ncu_once({f"{cfg}/flashmla": fn, **{f"{cfg}/{v}": lambda v=v: (select(v), ours()) for v in variants}})
            continue
        ref = fn()[0].clone()
        for _ in range(30):  # the GPU at its clocks before the first timing (a process's first row read slow)
            fn()
        row = {"op": "prefill", "shape": {"config": cfg, "tokens": args.tokens, "heads": H, "topk": K + 128},
               "flashmla_ms": bench_ms(fn, graph=False, rep=20), "flashmla_graph_ms": bench_ms(fn, rep=20)}
        kv2, idx2 = kv.view(kv.shape[0], -1), idx[:, 0]
        full = torch.full((q.shape[0],), idx2.shape[1], dtype=torch.int32, device=q.device)
        o, lse, maxl = torch.empty_like(q), *(torch.empty(q.shape[:2], device=q.device) for _ in range(2))
        base_out = None
        for v in variants:
            select(v)
            try:
                row[f"{v}_ms"] = bench_ms(ours, graph=False, rep=20)
                kernel = ti._ws_kernel("paired_ws", H, True)  # the kernel alone on FlashMLA's inputs, as a graph
                row[f"{v}_kernel_ms"] = bench_ms(lambda: kernel(q, kv2, idx2, full, sink, scale, float("inf"), o, lse,
                                                                maxl), rep=20)
                out = ours()[0]
                row[f"{v}_max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
                if base_out is None:
                    base_out = out.clone()
                    row["first_variant"] = v
                else:
                    row[f"{v}_equals_first"] = bool(torch.equal(out, base_out))
                own = torch.empty_like(q)
                row[f"{v}_own_ws_ms"] = ws_times(q, swa, i1, c4, i2, sink, own, "paired_ws")["paired_ws_ms"]
            except Exception as e:  # noqa: BLE001 - recorded
                row[f"{v}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        for p in programs:  # the other workspace programs, kernel alone from a graph on the same inputs
            tag = p.replace(":", "_")
            try:
                kernel = program_kernel(p, H)
                run = lambda k=kernel: k(q, kv2, idx2, full, sink, scale, float("inf"), o, lse, maxl)  # noqa: E731
                row[f"{tag}_kernel_ms"] = bench_ms(run, rep=20)
                o.fill_(float("nan"))
                run()
                row[f"{tag}_max_abs_diff"] = (o.float() - ref.float()).abs().max().item()
                row[f"{tag}_finite"] = bool(torch.isfinite(o).all())
            except Exception as e:  # noqa: BLE001 - recorded
                row[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["default_variant"] = default_variant
        row["ours_ms"] = row.get(f"{variants[0]}_ms")  # the first variant's, the entry on FlashMLA's inputs
        row["peers"] = {"flashmla": row["flashmla_ms"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del fn, kv, idx
    if args.ncu:
        return 0
    select("base")
    write_doc(args.out, "ws-variants", rows)
    return 0


def write_doc(out: str, prefix: str, rows: list) -> Path:
    """``rows`` as ``<out>/<prefix>-<UTC stamp>.json``, with the device, the commit, the date and the versions."""
    import torch

    from bench_attention import git_commit

    now = _dt.datetime.now(_dt.timezone.utc)
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "date": now.isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__}, "rows": rows}
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"{prefix}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
