"""Decode tiling and split-count search on the GPU: each tiling x split count is checked against the reference
and timed through the real launch path (decode kernel, plus the combine kernel when split), next to cuDNN SDPA
on contiguous K/V in the same run.

    python benchmarks/tune_decode.py [--batches 1,8,32,64,128,256] [--ctxs 4096,16384,32768] [--out DIR]

What it answers: how many splits fill the chip for a batch (``num_splits_for``), and whether longer resolved
row runs (``slot_tiles``), deeper pipelines or other key-tile widths read K/V faster. The JSON result (one row
per tiling, split count and shape) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

HQ, HKV, D = 32, 8, 128
# (block_N, num_stages, slot_tiles); 16-row tiles, 4 warps (1 token x 4 heads per KV head). 3+ stages do not
# compile on TileLang 0.1.15 with a dynamic trip count (its pipeline wait counts)
# slot_tiles 0: rows resolved inline by the copies, one pipeline over the split's tiles (no restarts; slower,
# docs/kernel-choice.md). A 4th field 1: full runs (fixed pipeline trip count, so 3+ stages)
TILINGS = [(64, 2, 8), (64, 3, 8, 1), (64, 4, 8, 1), (64, 2, 8, 1), (32, 2, 16), (64, 2, 4)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def dcfg(t):
    from musa_attn_backend.kernels.attention.tilelang_impl import DecodeConfig
    bn, st, slot, *full = t
    return DecodeConfig(max_q=1, block_M=16, block_N=bn, num_stages=st, threads=128, slot_tiles=slot,
                        full_runs=bool(full and full[0]))


def spec():
    from musa_attn_backend.kernels.attention.tilelang_impl import AttnSpec
    lay = (HKV * D, HKV * D, D)
    return AttnSpec(HQ, HKV, D, D, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)


def _compile(job):
    t, split = job
    from musa_attn_backend.kernels.attention import tilelang_impl as I
    t0 = time.time()
    try:
        if t is None:
            I.combine_kernel(spec())
        else:
            I.decode_kernel(spec(), dcfg(t), split)
        return job, time.time() - t0, None
    except Exception as e:  # report and go on
        return job, time.time() - t0, f"{type(e).__name__}: {str(e)[-600:]}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--ctxs", default="4096,16384,32768")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--tilings", default=None, help="e.g. 64:2:8,64:3:8:1 (block_N:stages:slot_tiles[:full_runs])")
    ap.add_argument("--max-splits", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    tilings = [tuple(int(x) for x in t.split(":")) for t in args.tilings.split(",")] if args.tilings else TILINGS
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctxs.split(",")]

    failed = {}
    t0 = time.time()
    jobs = [(t, s) for t in tilings for s in (False, True)] + [(None, True)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for job, dt, err in ex.map(_compile, jobs):
            print(f"compiled {job} in {dt:.0f}s {'FAILED ' + err if err else ''}", flush=True)
            if err:
                failed[job[0]] = err
    print(f"compile: {time.time() - t0:.0f}s", flush=True)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from bench_attention import bench_ms, paged_cache, git_commit, write_run
    from musa_attn_backend._tilelang import tilelang_version
    from musa_attn_backend.config import settings
    from musa_attn_backend.kernels import paged_attention
    from musa_attn_backend.kernels.attention import tilelang_impl as I
    from musa_attn_backend.metadata import PagedKVMeta
    from musa_attn_backend.testing.numeric import max_error, tolerance

    forced = {}
    real_splits, real_cfg = I.num_splits_for, I.decode_config
    I.num_splits_for = lambda *a: forced["splits"]
    I.decode_config = lambda *a, **k: forced["cfg"]

    def meta_for(table, seqlens, ps):
        b = len(seqlens)
        return PagedKVMeta.from_vllm(
            block_table=table, query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"),
            slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"), page_size=ps, max_seqlen_q=1,
            max_seqlen_k=max(seqlens))

    ps = args.page_size
    rows = []
    # correctness of every tiling, unsplit and split, on a ragged batch (odd lengths, shuffled pages)
    lens = [1, 63, 64, 65, 700, 3001, 129]
    k, v, table = paged_cache(len(lens), max(lens), HKV, D, ps, torch.bfloat16)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    meta = meta_for(table, lens, ps)
    ref = paged_attention(q, k, v, meta, impl="reference").float()
    errs = {}
    for t in tilings:
        if t in failed:
            continue
        for s in (1, 3, 7):
            forced.update(splits=s, cfg=dcfg(t))
            out = paged_attention(q, k, v, meta, impl="tilelang").float()
            # the tests' criterion and bound (musa_attn_backend.testing.numeric): max |out - ref| / (1 + |ref|)
            errs[(t, s)] = max_error(out, ref) if out.isfinite().all() else 1e9
            print(f"check {t} splits={s}: max error {errs[(t, s)]:.2e}", flush=True)
    bad = {t for (t, s), e in errs.items() if not e <= tolerance(torch.bfloat16)}

    for b in batches:
        for ctx in ctxs:
            if b * ctx * HKV * D * 4 > 40e9:
                continue
            k, v, table = paged_cache(b, ctx, HKV, D, ps, torch.bfloat16)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            meta = meta_for(table, [ctx] * b, ps)
            kv_bytes = b * ctx * HKV * D * 4
            dflt = real_cfg(1, HQ // HKV)
            default_splits = real_splits(b, HKV, ctx, dflt.block_N, 132,
                                         I.decode_ctas_per_sm(dflt, D, D, False, 228 * 1024))
            for t in tilings:
                if t in failed or t in bad:
                    continue
                tiles = -(-ctx // t[0])
                for s in SPLITS:
                    if s > args.max_splits or (s > 1 and (s > tiles // 2 or b * HKV * s > 8 * 132 * 4)):
                        continue
                    forced.update(splits=s, cfg=dcfg(t))
                    ms = bench_ms(lambda: paged_attention(q, k, v, meta, impl="tilelang"))
                    row = dict(batch=b, ctx=ctx, page_size=ps, block_N=t[0], num_stages=t[1], slot_tiles=t[2],
                               full_runs=bool(t[3:] and t[3]), pdl=settings().pdl,
                               chunked_combine=settings().chunked_combine,
                               splits=s, ours_ms=ms, tbps=kv_bytes / ms / 1e9, default_splits=default_splits)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del k, v
            qt = q.view(b, HQ, 1, D)
            kt = torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
            vt = torch.randn_like(kt)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cud = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
            rows.append(dict(batch=b, ctx=ctx, peer="sdpa_cudnn", ours_ms=None, peer_ms=cud, tbps=kv_bytes / cud / 1e9))
            best = min((r for r in rows if r.get("batch") == b and r.get("ctx") == ctx and r.get("ours_ms")),
                       key=lambda r: r["ours_ms"])
            print(f"== b={b} ctx={ctx}: cudnn {cud:.4f} ms ({kv_bytes / cud / 1e9:.2f} TB/s); best ours "
                  f"{best['ours_ms']:.4f} ms ({cud / best['ours_ms']:.2f}x) {best}", flush=True)
            del kt, vt
            torch.cuda.empty_cache()
    res = dict(device=torch.cuda.get_device_name(), commit=git_commit(),
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(), tilelang=tilelang_version(),
               torch=torch.__version__, heads_q=HQ, heads_kv=HKV, head_dim=D,
               check_errors={f"{t}/{s}": e for (t, s), e in errs.items()}, compile_failed={str(k): v for k, v in
                                                                                          failed.items()}, rows=rows)
    write_run(args.out, "tune-decode", res)


if __name__ == "__main__":
    main()
