"""The paired V4 program's register split, timed (H100/H200): each ``math/producer`` split of the 3 x 168
registers a 384-thread block holds (``MATH_REGS`` for each math group, ``PRODUCER_REGS`` for the producer; a third
field, ``PRODUCER_ROWS_AT_ONCE``: 2 by default, 1 for the producer holding one row of bytes at a time), built
as the launcher builds it, run on the attention bench's Flash and Pro inputs beside the scheduled program, outputs
compared. 200/104 is the default, the fastest split measured (docs/dsv4.md): ptxas serialises the WGMMAs below 208,
but at 88 the producer spills in its inner loop, which costs more.

    python3 scripts/tune_paired_regs.py --splits 208/88,208/88/1,216/72/1,200/104 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
sys.path.insert(0, str(HERE.parent))


def _build(split: tuple, H: int):
    """The paired program of ``split`` for ``H`` heads (extra set and sink), compiled for this GPU."""
    from musa_attn_backend._tilelang import compile_cached
    from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    pk.MATH_REGS, pk.PRODUCER_REGS = split[:2]
    return compile_cached(("tune_paired", H, split), lambda: pk.build_sparse_mqa_paired.__wrapped__(
        H, True, True, "bfloat16", split[2] if len(split) > 2 else 2), pass_configs=ti._ws_pass_configs())


def _compile(job) -> str:
    _build(*job)
    return "ok"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="208/88,208/88/1,216/72/1,200/104")
    ap.add_argument("--cases", default="flash:4096,flash:64,pro:4096")
    ap.add_argument("--out", default="/tmp/out")
    args = ap.parse_args(argv)
    from bench_attention import bench_ms, git_commit
    from bench_dsv4_attention import CONFIGS, caches, inputs

    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    splits = [tuple(int(x) for x in s.split("/")) for s in args.splits.split(",")]
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    heads = sorted({CONFIGS[c][0] for c, _ in cases})
    jobs = [(s, H) for s in splits for H in heads]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(8, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, fut in [(j, pool.submit(_compile, j)) for j in jobs]:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - a split that does not build is reported, the rest run
                print(f"compile {job}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(65536)
    rows = []
    for cfg, T in cases:
        H, K = CONFIGS[cfg]
        q, i1, i2, sink = inputs(T, H, K, swa, c4, g)
        out = torch.empty_like(q)
        kw = dict(extra_cache=c4, extra_indices=i2, sink=sink, out=out)
        plan = ti.sparse_mqa_plan(q, i1, None, i2, None)
        sched_ms = bench_ms(lambda: ti.sparse_mqa_tilelang(q, swa, i1, program="scheduled", plan=plan, **kw))
        ref = out.clone()
        row = {"op": "paired_regs", "shape": {"config": cfg, "tokens": T, "heads": H, "topk": K},
               "scheduled_ms": sched_ms, "splits": {}}
        saved = ti.paired_kernel
        for split in splits:
            try:
                kern = _build(split, H)
                ti.paired_kernel = lambda *a, k=kern, **kw_: k
                ms = bench_ms(lambda: ti.sparse_mqa_tilelang(q, swa, i1, program="paired", **kw))
                diff = (out.float() - ref.float()).abs().max().item()
                row["splits"]["/".join(map(str, split))] = {"ms": ms, "max_abs_diff_vs_scheduled": diff}
                print(f"{cfg:>5} T={T:>5} {split}: {ms:.4f} ms (scheduled {sched_ms:.4f}), diff {diff:.4f}", flush=True)
            except Exception as e:  # noqa: BLE001
                row["splits"]["/".join(map(str, split))] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            finally:
                ti.paired_kernel = saved
        rows.append(row)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
           "versions": {"torch": torch.__version__}, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"tune-paired-{stamp}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
