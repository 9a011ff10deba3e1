"""Host (Python) cost of one launch of the TileLang paged-attention launcher, on a CPU.

    python benchmarks/bench_host_overhead.py [--calls 4000] [--out benchmarks/results] [--baseline FILE]

The compile step is replaced by a stand-in (``tilelang.compile`` returns a no-op callable), so every launch
runs the launcher's real host work (argument checks, cache views, the tiling plan, the compile-cache lookup,
output allocation) and then "launches" a kernel that does nothing. Three batches, each a cached shape class
(the same shapes every call): a fresh prefill (vLLM pages of 16, new K/V read by the ragged kernel), a split-KV
decode and a mixed batch (leading decodes split off). The compile target is ``sm_90a`` (the Hopper plan:
ping-pong candidates, dependent launch), whatever the machine.

Each row gives the median over batches of calls of the time per call (``launcher_us``; ``launcher_min_us``:
the fastest batch, the least disturbed by other work on the machine), the median less the
time of calling the no-op with the launch's arguments (``above_launch_us``), and the cost of the tiling
choice alone (``plan_us``). Modes: ``cached`` (what serving sees after the first call of a shape class) and,
where the launcher has plan caches, ``cold`` (the plan caches cleared before every call: the work the
launcher did on every call before they existed). ``--baseline`` merges the rows of a run of this script at
another commit (e.g. the commit before the plan caches) into the result file as mode ``baseline``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform as _pyplatform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# Set before the package is imported (its settings are read once): a Hopper compile target on any machine, and
# a scratch kernel cache for the stand-in compiles' markers.
os.environ["MUSA_ATTN_TARGET"] = "sm_90a"
os.environ["MUSA_ATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="musa-attn-host-overhead-")

import torch  # noqa: E402

from musa_attn_backend import _tilelang  # noqa: E402
from musa_attn_backend.kernels.attention import tilelang_impl as impl  # noqa: E402
from musa_attn_backend.metadata import PagedKVMeta  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
LAUNCHES: list[tuple] = []  # the arguments of each stand-in launch, while RECORD is set
RECORD = False


def _noop(*args):
    if RECORD:
        LAUNCHES.append(args)


def _stand_in_compile(func, **kwargs):
    return _noop


def _meta(q_lens: list[int], k_lens: list[int], num_decodes: int = 0) -> PagedKVMeta:
    """A batch over a small cache: page tables point at page 0 (the stand-in kernels read nothing)."""
    bs = len(q_lens)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    sk = torch.tensor(k_lens, dtype=torch.int32)
    pages = max(-(-k // PAGE) for k in k_lens)
    nt = sum(q_lens)
    return PagedKVMeta(cu_seqlens_q=cu, seqlens_k=sk, prefix_lens=sk - torch.tensor(q_lens, dtype=torch.int32),
                       page_table=torch.zeros(bs, pages, dtype=torch.int32),
                       slot_mapping=torch.full((nt,), -1, dtype=torch.int64), page_size=PAGE,
                       max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), num_decodes=num_decodes,
                       new_kv_only=all(q == k for q, k in zip(q_lens[num_decodes:], k_lens[num_decodes:])))


def _cases():
    kv = torch.zeros(8, PAGE, HKV, 2 * D, dtype=torch.bfloat16)  # vLLM's NHD buffer; K and V are views
    k_cache, v_cache = kv.split(D, dim=-1)
    out = {}
    # a fresh prefill: 4 requests of 512 new tokens, their new K/V handed over (the ragged kernel)
    meta = _meta([512] * 4, [512] * 4)
    nt = meta.num_tokens
    new_kv = (torch.zeros(nt, HKV, D, dtype=torch.bfloat16), torch.zeros(nt, HKV, D, dtype=torch.bfloat16))
    out["prefill"] = (torch.zeros(nt, HQ, D, dtype=torch.bfloat16), k_cache, v_cache, meta, new_kv)
    # a decode step: 32 requests at 4k keys (split-KV: decode + combine)
    meta = _meta([1] * 32, [4096] * 32)
    out["decode"] = (torch.zeros(32, HQ, D, dtype=torch.bfloat16), k_cache, v_cache, meta, None)
    # a mixed batch: 16 decodes at 4k keys, then 2 prefills of 512 tokens after a 1k prefix
    meta = _meta([1] * 16 + [512] * 2, [4096] * 16 + [1536] * 2, num_decodes=16)
    nt = meta.num_tokens
    out["mixed"] = (torch.zeros(nt, HQ, D, dtype=torch.bfloat16), k_cache, v_cache, meta,
                    (torch.zeros(nt, HKV, D, dtype=torch.bfloat16), torch.zeros(nt, HKV, D, dtype=torch.bfloat16)))
    return out


def _clear_plan_caches():
    """The function that empties the launcher's plan caches (None where this version of the launcher has
    none)."""
    return getattr(impl, "clear_plan_caches", None)


def _times_us(fn, calls: int, per_batch: int = 50) -> list[float]:
    """Time per call of each batch of ``per_batch`` calls (after up to 200 warm-up calls)."""
    for _ in range(min(200, calls)):
        fn()
    times = []
    for _ in range(max(1, calls // per_batch)):
        t0 = time.perf_counter_ns()
        for _ in range(per_batch):
            fn()
        times.append((time.perf_counter_ns() - t0) / per_batch / 1000)
    return times


def _median_us(fn, calls: int) -> float:
    return statistics.median(_times_us(fn, calls))


def _plan(name: str):
    """The tiling choice a launch of case ``name`` makes, as one call."""
    if name == "decode":
        return lambda: impl.decode_config(1, HQ // HKV, False, D)
    if name == "prefill":
        return lambda: impl.new_kv_prefill_config(D, D, False)
    return lambda: (impl.decode_config(1, HQ // HKV, False, D), impl.prefill_config(D, D, False, PAGE, False))


def measure(calls: int) -> list[dict]:
    global RECORD
    _tilelang.tl.compile = _stand_in_compile
    rows = []
    clear = _clear_plan_caches()
    for name, (q, k, v, meta, new_kv) in _cases().items():
        def launch():
            impl.paged_attention_tilelang(q, k, v, meta, causal=True, new_kv=new_kv)

        launch()  # the first call of the shape class: builds the stand-in "kernels"
        LAUNCHES.clear()
        RECORD = True
        launch()
        RECORD = False
        recorded = list(LAUNCHES)
        launch_only = _median_us(lambda: [_noop(*a) for a in recorded], calls)
        modes = [("cached", launch, _plan(name))]
        if clear is not None:
            def cold_launch():
                clear()
                launch()

            def cold_plan(plan=_plan(name)):
                clear()
                plan()

            modes.append(("cold", cold_launch, cold_plan))
        for mode, fn, plan in modes:
            times = _times_us(fn, calls)
            total = statistics.median(times)
            rows.append({"case": name, "mode": mode, "kernel_launches": len(recorded),
                         "launcher_us": round(total, 2), "launcher_min_us": round(min(times), 2),
                         "above_launch_us": round(total - launch_only, 2),
                         "plan_us": round(_median_us(plan, calls), 2)})
            print(f"{name:8s} {mode:8s} launches={len(recorded)} launcher={total:7.2f} us  "
                  f"above launch={total - launch_only:7.2f} us  plan={rows[-1]['plan_us']:6.2f} us", flush=True)
    return rows


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4000, help="timed calls per row (after 200 warm-up calls)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder of the result JSON ('' = do not write)")
    ap.add_argument("--baseline", help="a result JSON of this script at another commit, merged in as 'baseline'")
    ap.add_argument("--note", default="", help="free text stored in the result")
    args = ap.parse_args(argv)
    if args.calls < 50:
        ap.error(f"--calls must be at least 50 (one timed batch), got {args.calls}")
    rows = measure(args.calls)
    doc = {"device": "cpu", "commit": git_commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
           "python": sys.version.split()[0], "torch": torch.__version__, "machine": _pyplatform.machine(),
           "cpu_count": os.cpu_count(), "target": "sm_90a (stand-in kernels)",
           "timing": {"statistic": "median over batches of 50 calls", "calls": args.calls, "unit": "us per launch",
                      "shapes": {"heads_q": HQ, "heads_kv": HKV, "head_dim": D, "page_size": PAGE,
                                 "prefill": "4 x 512 new tokens, new K/V", "decode": "32 x 1 token at 4096 keys",
                                 "mixed": "16 decodes at 4096 keys + 2 x 512 tokens after 1024"}},
           "note": args.note, "rows": rows}
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        doc["baseline"] = {"commit": base.get("commit"), "date": base.get("date")}
        doc["rows"] += [dict(r, mode="baseline") for r in base.get("rows", []) if r.get("mode") == "cached"]
    if args.out:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"host-overhead-{stamp}.json"
        path.write_text(json.dumps(doc, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
