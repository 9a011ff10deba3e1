"""Prefill tile/schedule search on the GPU: every candidate configuration is checked against SDPA and timed.

    python benchmarks/tune_prefill.py [--seqlens 4096,8192] [--pages 1,64,128] [--kinds gather,tma,pingpong]
                                      [--out DIR]

Candidates are compiled in parallel worker processes first (into the kernel cache), then each is run on a
ragged extend batch against PyTorch SDPA in float32 (wrong results are reported, never timed) and timed under
a CUDA graph on one long causal and non-causal sequence, next to cuDNN SDPA in the same run. The JSON result
(one row per candidate and shape) goes to ``--out``; ``prefill_config`` in ``tilelang_impl`` records the
winners.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
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


# pingpong: TMA tiles, no fast math; pingpong_fm: the same with TileLang's fast-math flag (the launcher's build);
# pingpong_gather: the gathering producer (any page size), built by the launcher's rules too; the *3 kinds: the
# same with 3 stages (Q + 3 x (K + V) tiles + rows: 231 KB of the 227 KiB a block may have, so it may not launch);
# pingpong_gather_ns: the gathering producer without TileLang's bounds checks (TL_DISABLE_SAFE_MEMORY_ACCESS: its
# rows are clamped into the sequence and its stores guarded by hand, so the checks are redundant), fewer producer
# instructions per row copy; *_ns on a TMA kind: the same without TileLang's bounds checks (the producer's
# page-table reads are in bounds, TMA clips rows past the tensor in hardware, the output stores are guarded by hand)
# pingpong_fm_r<N>: TMA tiles copied in N-row chunks of a page, each through the page table (pages that are a
# multiple of N tokens but hold no whole key tile, e.g. vLLM's 16)
KINDS = ("gather", "tma", "pingpong", "pingpong_fm", "pingpong_gather", "pingpong_fm3", "pingpong_gather3",
         "pingpong_gather_ns", "pingpong_fm_ns", "pingpong_fm3_ns", "pingpong_gather3_ns", "pingpong_fm_r16",
         "pingpong_fm3_r16", "pingpong_fm_r32", "pingpong_fm_r64", "pingpong_fm3_r32", "pingpong_fm3_r64")
GATHERING = ("gather", "pingpong_gather", "pingpong_gather3", "pingpong_gather_ns", "pingpong_gather3_ns")


def candidates(page_sizes, kinds=KINDS):
    grid = [("gather", 128), ("gather", 64), ("tma", 128), ("tma", 64), ("pingpong", 128), ("pingpong", 64),
            ("pingpong_fm", 128), ("pingpong_fm", 64), ("pingpong_gather", 128), ("pingpong_fm3", 128), ("pingpong_gather3", 128),
            ("pingpong_gather_ns", 128), ("pingpong_fm_ns", 128), ("pingpong_fm3_ns", 128),
            ("pingpong_gather3_ns", 128),
            ("pingpong_fm_r16", 128), ("pingpong_fm3_r16", 128), ("pingpong_fm_r32", 128), ("pingpong_fm_r64", 128),
            ("pingpong_fm3_r32", 128), ("pingpong_fm3_r64", 128)]
    out = []
    for kind, bn in grid:
        if kind not in kinds:
            continue
        gathers = kind in GATHERING
        rows = int(kind.rsplit("_r", 1)[1]) if "_r" in kind else 0
        pages = [p for p in page_sizes if gathers or p % (rows or bn) == 0]
        if pages:
            c = dict(tma=not gathers, pingpong=kind.startswith("pingpong"), block_N=bn,
                     num_stages=3 if kind.split("_")[1:2] in (["fm3"], ["gather3"]) else 2,
                     fast_math=kind.startswith(("pingpong_fm", "pingpong_gather")), pages=pages)
            if kind.endswith("_ns"):
                c["nosafe"] = True
            if rows:
                c["tma_rows"] = rows
            out.append(c)
    return out


def build(cand, causal):
    from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill
    from musa_attn_backend.kernels.attention.prefill_pingpong_kernel import build_prefill_pingpong
    lay = (HKV * D, HKV * D, D)
    if cand["pingpong"]:
        return build_prefill_pingpong.__wrapped__(HQ, HKV, D, D, "bfloat16", causal, False, False, lay, lay,
                                                  cand["block_N"], cand["num_stages"], gather=not cand["tma"],
                                                  tma_rows=cand.get("tma_rows", 0))
    return build_prefill.__wrapped__(HQ, HKV, D, D, "bfloat16", "bfloat16", causal, False, False, False, False,
                                     lay, lay, 128, cand["block_N"], cand["num_stages"], 256, cand["tma"])


def key(cand, causal):
    return ("tune_prefill", tuple(sorted((k, v) for k, v in cand.items() if k != "pages")), causal)


def pass_configs(cand):
    from musa_attn_backend._tilelang import tl
    pc = {}
    if cand.get("fast_math"):
        pc[tl.PassConfigKey.TL_ENABLE_FAST_MATH] = True
    if cand["pingpong"] and not cand["tma"]:
        pc[tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC] = True  # as the launcher builds it
    if cand.get("nosafe"):
        pc[tl.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS] = True
    return pc or None


def _compile(args):
    cand, causal = args
    from musa_attn_backend._tilelang import compile_cached
    t = time.time()
    try:
        compile_cached(key(cand, causal), lambda: build(cand, causal), pass_configs=pass_configs(cand))
        return cand, causal, time.time() - t, None
    except Exception as e:  # report and go on
        return cand, causal, time.time() - t, f"{type(e).__name__}: {str(e)[-600:]}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--pages", default="1,64,128")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--kinds", default=",".join(KINDS), help="subset of " + ",".join(KINDS))
    args = ap.parse_args(argv)
    pages = [int(x) for x in args.pages.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    cands = candidates(pages, args.kinds.split(","))
    jobs = [(c, causal) for c in cands for causal in (True, False)]
    failed = {}
    t0 = time.time()
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for cand, causal, dt, err in ex.map(_compile, jobs):
            print(f"compiled {cand} causal={causal} in {dt:.0f}s {'FAILED ' + err if err else ''}", flush=True)
            if err:
                failed[key(cand, causal)] = err
    print(f"compile: {time.time() - t0:.0f}s", flush=True)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from bench_attention import bench_ms, paged_cache, git_commit, write_run
    from musa_attn_backend._tilelang import compile_cached, tilelang_version
    from musa_attn_backend.testing.numeric import max_error, tolerance

    def meta_for(qlens, klens, table, ps):
        cu = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device="cuda")
        return cu, torch.tensor(klens, dtype=torch.int32, device="cuda"), table

    def run(kernel, q, k, v, cu, sk, table, ps, maxq):
        lay_rows = lambda c: c.view(-1, HKV * D)
        nt = q.shape[0]
        out = torch.full((nt, HQ, D), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((nt, HQ), float("nan"), dtype=torch.float32, device="cuda")
        z = torch.zeros(HQ, device="cuda")
        one = torch.ones(HKV, device="cuda")
        kernel(q, lay_rows(k), lay_rows(v), cu, sk, table, z, one, one, D ** -0.5, 0.0, 0, ps, maxq, out, lse)
        return out

    rows = []
    for cand in cands:
        for causal in (True, False):
            if key(cand, causal) in failed:
                rows.append(dict(config=cand, causal=causal, error=failed[key(cand, causal)]))
                continue
            kern = compile_cached(key(cand, causal), lambda: build(cand, causal), pass_configs=pass_configs(cand))
            for ps in cand["pages"]:
                # correctness: ragged extend batch with prefixes, shuffled pages
                torch.manual_seed(0)
                qlens, klens = [1, 130, 257, 700], [5, 300, 257, 1500]
                k, v, table = paged_cache(len(qlens), max(klens), HKV, D, ps, torch.bfloat16)
                q = torch.randn(sum(qlens), HQ, D, device="cuda", dtype=torch.bfloat16)
                cu, sk, table = meta_for(qlens, klens, table, ps)
                out = run(kern, q, k, v, cu, sk, table, ps, max(qlens)).float()
                err = 0.0
                for i, (ql, kl) in enumerate(zip(qlens, klens)):
                    rows_k = table[i].repeat_interleave(ps) * ps + torch.arange(table.shape[1] * ps, device="cuda") % ps
                    kk = k.view(-1, HKV, D)[rows_k[:kl].long()].float().repeat_interleave(HQ // HKV, 1)
                    vv = v.view(-1, HKV, D)[rows_k[:kl].long()].float().repeat_interleave(HQ // HKV, 1)
                    qq = q[cu[i]:cu[i] + ql].float()
                    s = torch.einsum("qhd,khd->hqk", qq, kk) * D ** -0.5
                    if causal:
                        qpos = torch.arange(kl - ql, kl, device="cuda")[:, None]
                        s = s.masked_fill(torch.arange(kl, device="cuda")[None] > qpos, float("-inf"))
                    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
                    o = out[cu[i]:cu[i] + ql]
                    # the tests' criterion (musa_attn_backend.testing.numeric): max |o - ref| / (1 + |ref|)
                    err = max(err, max_error(o, ref)) if o.isfinite().all() else float("nan")
                ok = err <= tolerance(torch.bfloat16)
                for s_len in seqlens:
                    k, v, table = paged_cache(1, s_len, HKV, D, ps, torch.bfloat16)
                    q = torch.randn(s_len, HQ, D, device="cuda", dtype=torch.bfloat16)
                    cu, sk, table = meta_for([s_len], [s_len], table, ps)
                    ms = bench_ms(lambda: run(kern, q, k, v, cu, sk, table, ps, s_len)) if ok else None
                    flops = 4 * s_len * s_len * HQ * D * (0.5 if causal else 1.0)
                    row = dict(config={x: y for x, y in cand.items() if x != "pages"}, causal=causal, page_size=ps,
                               seqlen=s_len, max_error=err, ours_ms=ms,
                               tflops=flops / ms / 1e9 if ms else None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    # peers once per shape
    peers = {}
    for s_len in seqlens:
        for causal in (True, False):
            q = torch.randn(1, HQ, s_len, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, HKV, s_len, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        ms = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
                    peers[f"{name}/{s_len}/{causal}"] = ms
                    flops = 4 * s_len * s_len * HQ * D * (0.5 if causal else 1.0)
                    print(f"{name} s={s_len} causal={causal}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                except Exception as e:
                    print(name, "failed", e)
    res = dict(device=torch.cuda.get_device_name(), commit=git_commit(),
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(), tilelang=tilelang_version(),
               torch=torch.__version__, heads_q=HQ, heads_kv=HKV, head_dim=D, rows=rows, peers=peers)
    write_run(args.out, "tune-prefill", res)


if __name__ == "__main__":
    main()
