"""Paged-attention benchmark: ours (TileLang) vs PyTorch SDPA (flash, cuDNN), FlexAttention and FlashInfer.

    python benchmarks/bench_attention.py [--quick] [--out benchmarks/results] [--ops prefill,decode]
    musa-attn bench ...            (the same, from a checkout)

Each run writes one JSON file (device, commit, date, versions, rows) and a PNG plot, and prints a table.
Peers run on contiguous K/V (their best case); ours reads a paged cache with shuffled pages, plus a
"contiguous" variant of the same kernel (one request's pages in order) for the paged-vs-contiguous ratio.
Rooflines: prefill against a measured bf16 matmul rate, decode against measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from musa_attn_backend import config  # noqa: E402
from musa_attn_backend.kernels import paged_attention  # noqa: E402
from musa_attn_backend.metadata import PagedKVMeta  # noqa: E402


def capture_graph(fn):
    """``fn`` captured once in a CUDA graph, after a warm-up call on the capture stream (raises where it
    cannot be captured)."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                fn()
    finally:
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
    return g


_gpu_warm = False


def _warm_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy for about ``seconds`` before the first measurement of a run, so its clocks have ramped
    up: without it the first rows of a run (ours and the peers alike) time slower than later identical
    launches."""
    global _gpu_warm
    if _gpu_warm:
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    _gpu_warm = True


def bench_ms(fn, warmup=5, rep=30, graph=True) -> float:
    """Median time of ``fn`` in ms with CUDA events after warm-up.

    With ``graph`` the call is captured once in a CUDA graph and the replays are timed (as an engine runs
    decode), so host-side launch overhead stays out of the number for ours and the peers alike; a callable
    that cannot be captured is timed eagerly. The first call of a process first warms the GPU up.
    """
    _warm_gpu()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            run = capture_graph(fn).replay
        except Exception as e:  # not capturable: time it eagerly
            print(f"  (eager timing: {type(e).__name__}: {str(e)[:80]})")
            torch.cuda.synchronize()
    for _ in range(3):
        run()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def eager_ms(fn, warmup=5, rep=30, cuda=True) -> float:
    """Median eager time of ``fn`` in ms: CUDA events on a GPU, ``perf_counter`` otherwise (CPU smoke runs)."""
    if cuda:
        return bench_ms(fn, warmup=warmup, rep=rep, graph=False)
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def measure_ceilings() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm = bench_ms(lambda: a @ b, graph=False)
    x = torch.randn(512 * 1024 * 1024 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    cp = bench_ms(lambda: y.copy_(x), graph=False)
    moved = 2 * x.numel() * x.element_size()  # read + write
    del a, b, x, y
    return {"bf16_matmul_tflops": 2 * n**3 / mm / 1e9, "copy_tbps": moved / cp / 1e9}


def paged_cache(batch, seqlen, hkv, d, page_size, dtype, contiguous=False, seed=0):
    """K/V of ``batch`` requests of ``seqlen`` keys in a paged pool (shuffled pages unless contiguous)."""
    pages_per = math.ceil(seqlen / page_size)
    num_pages = batch * pages_per
    order = list(range(num_pages))
    if not contiguous:
        random.Random(seed).shuffle(order)
    table = torch.tensor(order, dtype=torch.int32, device="cuda").view(batch, pages_per)
    k = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=dtype)
    return k, v, table


def flex_paged_prefill(q, k_cache, v_cache, table, causal, compiled=True):
    """FlexAttention reading the same paged pool (shuffled pages) through a block mask: a callable for one
    request whose pages are ``table[0]``. Flex attends over the physical slots; the mask maps each slot back to
    its logical position (slots of other requests' pages, or past the diagonal, are masked) and the block mask
    skips pages the request does not own. The pool is laid out ``[1, H, slots, D]`` once, outside the timing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    slots = num_pages * page_size
    inv = torch.full((num_pages,), -1, dtype=torch.long, device=q.device)
    inv[table[0].long()] = torch.arange(table.shape[1], device=q.device)
    slot = torch.arange(slots, device=q.device)
    logical = torch.where(inv[slot // page_size] >= 0, inv[slot // page_size] * page_size + slot % page_size,
                          torch.full_like(slot, -1))
    logical = torch.where(logical < s, logical, torch.full_like(logical, -1))

    def mask_mod(b, h, qi, ki):
        pos = logical[ki]
        ok = pos >= 0
        return (ok & (pos <= qi)) if causal else ok

    block = create_block_mask(mask_mod, 1, 1, s, slots, device=q.device, BLOCK_SIZE=128)
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k_cache.reshape(slots, hkv, d).transpose(0, 1).unsqueeze(0).contiguous()
    vt = v_cache.reshape(slots, hkv, -1).transpose(0, 1).unsqueeze(0).contiguous()
    fn = torch.compile(flex_attention) if compiled else flex_attention
    return lambda: fn(qt, kt, vt, block_mask=block, enable_gqa=True)


def sdpa_ms(q, k, v, **kwargs) -> dict:
    """``{peer: ms}`` of torch's ``scaled_dot_product_attention(q, k, v, **kwargs)`` on its flash and cuDNN
    backends; a backend unavailable for the shape is reported and left out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for pname, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
                fn()
                out[pname] = bench_ms(fn)
        except Exception as e:  # backend unavailable for this shape
            print(f"  {pname} skipped: {type(e).__name__}: {e}"[:200])
    return out


def prefill_rows(seqlens, causal_opts, hq=32, hkv=8, d=128, dtype=torch.bfloat16, page_sizes=(1, 128), peers=True):
    """One row per (causal, length, page size). ``ours_contiguous_ms``: the same kernel and page size with the
    request's pages in order (the paged-vs-contiguous ratio). ``ours_new_kv_ms``: the same prefill with its keys
    read from the new K/V, how a fresh prefill (no cached prefix) runs in the engines by default; ``ours_ms``
    reads the paged cache, as an extend with a cached prefix does."""
    rows = []
    for causal in causal_opts:
        for s in seqlens:
            batch = 1
            q = torch.randn(s, hq, d, device="cuda", dtype=dtype)
            res = {}
            for ps in page_sizes:
                for name, contig in (("ours", False), ("ours_contiguous", True)):
                    k, v, table = paged_cache(batch, s, hkv, d, ps, dtype, contiguous=contig)
                    meta = PagedKVMeta.from_vllm(block_table=table, query_start_loc=torch.tensor(
                        [0, s], dtype=torch.int32, device="cuda"), seq_lens=torch.tensor([s], dtype=torch.int32,
                        device="cuda"), slot_mapping=torch.arange(s, device="cuda"), page_size=ps, max_seqlen_q=s,
                        max_seqlen_k=s)
                    res[name, ps] = bench_ms(lambda: paged_attention(q, k, v, meta, causal=causal, impl="tilelang"))
                    if not contig:
                        # a fresh prefill as the engines run it (the default, forced on here): keys from the
                        # new K/V the layer is handed (here the request's K/V in order), not from the pages
                        nk, nv = (x.view(-1, hkv, d)[table[0].repeat_interleave(ps).long() * ps
                                                     + torch.arange(table.shape[1] * ps, device="cuda") % ps][:s]
                                  for x in (k, v))
                        fresh = dataclasses.replace(meta, new_kv_only=True)
                        try:
                            with config.override(new_kv_prefill=True):
                                res["ours_new_kv", ps] = bench_ms(lambda: paged_attention(
                                    q, k, v, fresh, causal=causal, new_kv=(nk, nv), impl="tilelang"))
                        except Exception as e:  # report, keep the run
                            print(f"  ours_new_kv skipped: {type(e).__name__}: {e}"[:300])
                    if peers and not contig:
                        try:
                            fn = flex_paged_prefill(q, k, v, table, causal)
                            fn()
                            res["flex_paged", ps] = bench_ms(fn)
                        except Exception as e:
                            print(f"  flex_paged skipped: {type(e).__name__}: {e}"[:200])
            peer_ms = {}
            if peers:
                qt = q.view(1, s, hq, d).transpose(1, 2)
                kt = torch.randn(1, hkv, s, d, device="cuda", dtype=dtype)
                vt = torch.randn(1, hkv, s, d, device="cuda", dtype=dtype)
                kr, vr = kt.repeat_interleave(hq // hkv, 1), vt.repeat_interleave(hq // hkv, 1)
                peer_ms.update(sdpa_ms(qt, kr, vr, is_causal=causal))
                try:
                    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

                    flex = torch.compile(flex_attention)
                    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, s, s) if causal else None
                    fn = lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True)  # noqa: E731
                    fn()
                    peer_ms["flex"] = bench_ms(fn)
                except Exception as e:
                    print(f"  flex skipped: {type(e).__name__}: {e}"[:200])
            flops = 4 * batch * hq * s * s * d * (0.5 if causal else 1.0)
            for ps in page_sizes:
                rows.append({
                    "op": "prefill",
                    "shape": dict(batch=batch, seqlen_q=s, seqlen_k=s, heads_q=hq, heads_kv=hkv, head_dim=d,
                                  page_size=ps, causal=causal, dtype=str(dtype).replace("torch.", "")),
                    "ours_ms": res["ours", ps], "ours_contiguous_ms": res["ours_contiguous", ps],
                    "ours_new_kv_ms": res.get(("ours_new_kv", ps)),
                    "tflops": flops / res["ours", ps] / 1e9, "gbps": None,
                    "peers": {**peer_ms, **({"flex_paged": res["flex_paged", ps]} if ("flex_paged", ps) in res
                                            else {})},
                })
    return rows


def decode_rows(batches, ctxs, page_sizes, hq=32, hkv=8, d=128, dtype=torch.bfloat16, peers=True):
    rows = []
    for ps in page_sizes:
        for b in batches:
            for ctx in ctxs:
                if b * ctx * hkv * d * 2 * 2 > 40e9:
                    continue
                k, v, table = paged_cache(b, ctx, hkv, d, ps, dtype)
                q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
                meta = PagedKVMeta.from_vllm(block_table=table, query_start_loc=torch.arange(
                    b + 1, dtype=torch.int32, device="cuda"), seq_lens=torch.full((b,), ctx, dtype=torch.int32,
                    device="cuda"), slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"), page_size=ps,
                    max_seqlen_q=1, max_seqlen_k=ctx)
                ours = bench_ms(lambda: paged_attention(q, k, v, meta, impl="tilelang"))
                del k, v
                peer_ms = {}
                if peers:
                    qt = q.view(b, hq, 1, d)
                    kt = torch.randn(b, hkv, ctx, d, device="cuda", dtype=dtype)
                    vt = torch.randn(b, hkv, ctx, d, device="cuda", dtype=dtype)
                    peer_ms.update(sdpa_ms(qt, kt, vt, enable_gqa=True))
                    del kt, vt
                kv_bytes = b * ctx * hkv * d * 2 * dtype.itemsize
                rows.append({
                    "op": "decode",
                    "shape": dict(batch=b, seqlen_q=1, seqlen_k=ctx, heads_q=hq, heads_kv=hkv, head_dim=d,
                                  page_size=ps, causal=True, dtype=str(dtype).replace("torch.", "")),
                    "ours_ms": ours, "tflops": 4 * b * hq * ctx * d / ours / 1e9, "gbps": kv_bytes / ours / 1e6,
                    "peers": peer_ms,
                })
                torch.cuda.empty_cache()
    return rows


def finish(rows, ceilings):
    for r in rows:
        if r["op"] == "prefill":
            r["roofline_frac"] = r["tflops"] / ceilings["bf16_matmul_tflops"]
        else:
            r["roofline_frac"] = r["gbps"] / 1e3 / ceilings["copy_tbps"]
        best = min(r["peers"].values()) if r["peers"] else None
        r["ratio_vs_best_peer"] = best / r["ours_ms"] if best else None  # > 1: ours faster
        r["ratio_vs_peers"] = {k: v / r["ours_ms"] for k, v in r["peers"].items()}
    return rows


def print_table(rows):
    print(f"{'op':8s} {'B':>4s} {'sq':>6s} {'sk':>6s} {'pg':>4s} {'c':>2s} {'ours ms':>9s} {'TFLOP/s':>8s} "
          f"{'GB/s':>7s} {'roof':>5s} {'best peer':>16s} {'ratio':>6s}")
    for r in rows:
        s = r["shape"]
        best = min(r["peers"].items(), key=lambda kv: kv[1]) if r["peers"] else ("-", float("nan"))
        print(f"{r['op']:8s} {s['batch']:4d} {s['seqlen_q']:6d} {s['seqlen_k']:6d} {s['page_size']:4d} "
              f"{int(s['causal']):2d} {r['ours_ms']:9.4f} {r['tflops']:8.1f} {(r['gbps'] or 0):7.0f} "
              f"{r['roofline_frac']:5.2f} {best[0]:>10s} {best[1]:5.3f} {r['ratio_vs_best_peer'] or 0:6.2f}")


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, op in zip(axes, ("prefill", "decode")):
        sel = [r for r in rows if r["op"] == op]
        labels = [f"{r['shape']['batch']}x{r['shape']['seqlen_k']}" + ("c" if r["shape"]["causal"] else "")
                  + f"/p{r['shape']['page_size']}" for r in sel]
        x = range(len(sel))
        ax.plot(x, [r["ratio_vs_best_peer"] or 0 for r in sel], "o-", label="ours / best peer (speed-up)")
        ax.plot(x, [r["roofline_frac"] for r in sel], "s--", label="fraction of roofline")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        ax.set_title(op)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_run(out, tag: str, doc: dict) -> Path:
    """Write one run's JSON as ``<out>/<tag>-<UTC stamp>.json``; returns the path."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"{tag}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    print("wrote", path)
    return path


def package_versions(*packages: str) -> dict:
    """torch's version and each package's installed version (``unknown`` where it is not installed)."""
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = "unknown"
    return out


def bench_parser(doc: str, results) -> argparse.ArgumentParser:
    """The options every engine-level bench takes: ``--out`` (default ``results``), ``--quick``, ``--smoke`` (CPU,
    tiny shapes: the harness only) and ``--rep``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(results))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (the harness only)")
    ap.add_argument("--rep", type=int, default=20)
    return ap


def run_rows(kind: str, op: str, configs, measure, keys: tuple, describe, out_dir, smoke: bool, meta) -> int:
    """Measure each of ``configs`` (``measure(cfg)`` -> a row; a config that raises is recorded as a row with
    ``errors``, the shape from ``keys`` and the config), print a line a row (``describe(row)``), and write every row
    so far to ``out_dir/<kind>[-smoke]-<UTC stamp>.json`` after each one (a cut-off run keeps its rows), with
    ``meta()`` (device, commit, versions, ...) at the top. Returns 0 when no row has errors."""
    import traceback

    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{kind}-{'smoke-' if smoke else ''}{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
    rows = []
    for cfg in configs:
        try:
            rows.append(measure(cfg))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc()
            rows.append({"op": f"{op}_{cfg[0]}", "shape": dict(zip(keys, cfg)),
                         "errors": f"{type(e).__name__}: {e}"[:500]})
        r = rows[-1]
        print(f"{r['op']:<20} {json.dumps(r['shape'])}: " + (r.get("errors") or describe(r)), flush=True)
        doc = {**meta(), "date": stamp.isoformat(), "rows": rows}
        path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results in {path}")
    return 0 if all("errors" not in r for r in rows) else 1


def git_commit() -> str:
    """The commit the run measures: the ``.commit`` file the caller leaves in the tree (the lent GPU machine
    gets a copy whose git metadata can be stale), else MUSA_ATTN_COMMIT, else HEAD of the checkout."""
    stamp = HERE.parent / ".commit"
    if stamp.exists() and stamp.read_text().strip():
        return stamp.read_text().strip()
    if config.settings().commit:
        return config.settings().commit
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--ops", default="prefill,decode")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tag", default="attention")
    ap.add_argument("--prefill-pages", default="1,64,128",
                    help="page sizes of the prefill rows (1: gathering producer, 64: page-chunk TMA tiles, 128: "
                         "whole-tile TMA)")
    ap.add_argument("--decode-pages", default="1,64")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    import tilelang

    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings}")
    ops = args.ops.split(",")
    rows = []
    if "prefill" in ops:
        seqs = [2048, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384]
        rows += prefill_rows(seqs, [True] if args.quick else [True, False], peers=not args.no_peers,
                             page_sizes=[int(p) for p in args.prefill_pages.split(",")])
    if "decode" in ops:
        batches = [1, 32, 128] if args.quick else [1, 8, 32, 64, 128, 256]
        ctxs = [4096, 16384] if args.quick else [1024, 4096, 16384, 32768]
        rows += decode_rows(batches, ctxs, [int(p) for p in args.decode_pages.split(",")], peers=not args.no_peers)
    finish(rows, ceilings)
    print_table(rows)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(), "tilelang": tilelang.__version__,
           "torch": torch.__version__, "ceilings": ceilings, "rows": rows}
    path = out / f"{args.tag}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    png = path.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {path}" + (f" and {png}" if png.exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
