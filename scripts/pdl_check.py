"""The scheduled V4 program's combine as a programmatic dependent launch (``SCHED_PDL``, off by default until this
passes on a GPU): the scheduled program's GPU tests with it on, then Flash decode at 1, 2, 32 and 64 tokens and
prefill at 4096 timed with it off and on (CUDA-graph replays), outputs compared.

    python3 scripts/pdl_check.py [--out DIR]      (on the lent GPU, after source .device/env.sh)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
sys.path.insert(0, str(HERE.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--no-tests", action="store_true")
    args = ap.parse_args(argv)
    import pytest
    import torch

    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    def use(pdl: bool) -> None:
        ti.SCHED_PDL = pdl
        ti._SCHED_KERNELS.clear()  # the launch's kernel handles, looked up once per shape

    rc = 0
    if not args.no_tests:
        use(True)
        rc = pytest.main(["-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=240",
                          str(HERE.parent / "tests/dsv4/test_gpu_dsv4.py"), "-k", "scheduled or plan"])
        print(f"scheduled program's GPU tests with PDL: pytest rc {int(rc)}", flush=True)
    from bench_attention import bench_ms, git_commit
    from bench_dsv4_attention import CONFIGS, caches, inputs

    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(65536)
    rows = []
    for T in (1, 2, 32, 64, 4096):
        H, K = CONFIGS["flash"]
        q, i1, i2, sink = inputs(T, H, K, swa, c4, g)
        plan = ti.sparse_mqa_plan(q, i1, None, i2, None)
        row = {"op": "decode" if T < 4096 else "prefill", "shape": {"config": "flash", "tokens": T}}
        outs = {}
        for pdl in (False, True):
            use(pdl)
            out = torch.empty_like(q)
            fn = lambda: ti.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink,  # noqa
                                                out=out, program="scheduled", plan=plan)
            row["pdl_ms" if pdl else "ours_ms"] = bench_ms(fn)
            outs[pdl] = out.clone()
        row["max_abs_diff"] = (outs[True].float() - outs[False].float()).abs().max().item()
        print(row, flush=True)
        rows.append(row)
    use(False)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "tests_rc": int(rc), "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"pdl-check-{stamp}.json").write_text(json.dumps(doc, indent=1))
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
