"""DeepSeek-V4 sparse MQA benchmark: ours (TileLang, FP8 caches read directly) against FlashMLA (the build vLLM's
wheel ships, staged as ``flashmla_peer`` by ``../shared/device/prepare.sh --peers``), SGLang's kernels and a torch
path (gather + dequantise + matmul + softmax, the reference op run on the GPU), one run, with the bf16 matmul
rate and copy bandwidth measured in the same run as the rooflines.

    python benchmarks/bench_dsv4_attention.py [--quick] [--out benchmarks/results]

Rows: decode (B requests of s_q = 1 or 2 query tokens, window 128 + compressed top-K: Flash H 64 + 512, Pro
H 128 + 1024) and prefill (T tokens, the same index sets). Peers, where they run: SGLang's Triton FP8 sparse
decode (``triton_fp8_attention_fwd``) and its TileLang V4 kernel (``dpsk_v4_fp8_attention_fwd``; what fails to
import or build is recorded under ``peer_errors``), and the torch path. ``portable_ms``: the portable program on
the same inputs; ``musa_form_ms``: the program MUSA runs, in MUSA's form (``MUSA_ATTN_MUSA_FORMS``: K and V tiles
of their own, 32 rows; docs/musa.md). FLOPs = 2 * H * K * (512 + 512) per token (valid entries), bytes = q +
out + K * 584 + indices.

FlashMLA, where ``flashmla_peer`` imports: decode (``flashmla_ms`` under a CUDA graph, ``flashmla_eager_ms``
eager, its scheduler metadata made once and reused, as the engines reuse it across layers; ours likewise with one
plan, ``plan_ms`` its cost) on the same FP8 caches and indices, with ``flashmla_max_abs_diff`` between the two
outputs; prefill through its bf16-workspace kernel (``flashmla_prefill_ms``: the kernel alone, on a workspace of
every row of both caches; ``workspace_floor_ms``: the copy-rate time of one bf16 row an entry, an upper bound of
what an engine builds before it (an engine's workspace holds each request's rows once);
``flashmla_fp8_decode_ms``: the same tokens through its FP8 decode kernel, which reads the cache as ours does;
with ``--programs paired_ws``, ``paired_ws_on_flashmla_inputs_ms``: our paired_ws program through
``flash_mla_sparse_fwd`` on FlashMLA's own workspace and lists, the kernel against kernel comparison). ``--programs`` times each named sparse MQA program on every row (``<program>_ms``,
``<program>_eager_ms``); ``ours_ms`` is the first. ``entry_eager_ms``: our ``flash_mla_with_kvcache`` called
eagerly as the engines call it (one metadata object across calls), beside ``flashmla_eager_ms``;
``entry_tilelang_eager_ms`` the same through TileLang's launches, ``entry_compiled_eager_ms`` through one call into
C++ (``_ffi_launch``: the batch's later calls replay the launches recorded there; the default where
``MUSA_ATTN_COMPILED_LAUNCH`` allows).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform as _platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_attention import bench_ms, git_commit, measure_ceilings, write_run  # noqa: E402

from musa_attn_backend.kernels import dsv4  # noqa: E402
from musa_attn_backend.kernels.dsv4 import layout as L  # noqa: E402

CONFIGS = {"flash": (64, 512), "pro": (128, 1024)}  # heads, compressed top-k (the window is 128 more)


def caches(tokens_ctx: int, device="cuda"):
    """A SWA cache (256-row pages) and a C4 cache (64-row pages) with random rows in every slot."""
    swa = L.new_kv_cache(max(1, tokens_ctx // 256 + 1), 256, device)
    c4 = L.new_kv_cache(max(1, tokens_ctx // 4 // 64 + 1), 64, device)
    for cache in (swa, c4):
        n = cache.shape[0] * cache.shape[1]
        for s0 in range(0, n, 1 << 16):
            s = torch.arange(s0, min(n, s0 + (1 << 16)), device=device)
            dsv4.write_kv_v4(torch.randn(len(s), 512, device=device).to(torch.bfloat16), cache, s, impl="reference")
    return swa, c4


def inputs(T: int, H: int, K: int, swa, c4, g):
    """Random queries, window and compressed index lists over every slot of ``swa`` / ``c4``, and sinks."""
    n_swa, n_c4 = swa.shape[0] * swa.shape[1], c4.shape[0] * c4.shape[1]
    q = torch.randn(T, H, 512, device="cuda", generator=g).to(torch.bfloat16)
    i1 = torch.randint(0, n_swa, (T, 128), device="cuda", generator=g, dtype=torch.int32)
    i2 = torch.randint(0, n_c4, (T, K), device="cuda", generator=g, dtype=torch.int32)
    return q, i1, i2, torch.randn(H, device="cuda", generator=g)


def row(op, cfg, T, H, K, ms, peers, ceilings, s_q=1, extra=None):
    flops = 2 * H * (K + 128) * 1024 * T
    bytes_ = T * H * 512 * 2 * 2 + T * (K + 128) * (L.ROW_BYTES + 4)
    tflops, tbps = flops / ms / 1e9, bytes_ / ms / 1e9
    roof = max(tflops / ceilings["bf16_matmul_tflops"], tbps / ceilings["copy_tbps"])
    best = min(peers.values()) if peers else None
    r = {"op": op, "shape": dict(config=cfg, tokens=T, s_q=s_q, heads=H, topk=K + 128), "ours_ms": ms,
         "peers": peers, "tflops": tflops, "tbps": tbps, "roofline_frac": roof,
         "ratio_vs_best_peer": best / ms if best else None, **(extra or {})}
    print(f"{op:8s} {cfg:5s} T={T:6d} s_q={s_q} H={H:3d} K={K + 128:5d}  ours {ms:.4f} ms  {tflops:6.1f} TFLOP/s  "
          f"{tbps:5.2f} TB/s  roof {roof:.2f}  " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in {**peers, **(extra or {})}.items()),
          flush=True)
    return r


def fp8_matmul_tflops() -> float:
    """The e4m3 matmul rate (torch._scaled_mm, 8192^3), the FP8 ceiling; 0 where it does not run."""
    n = 8192
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        ms = bench_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), graph=False)
        return 2 * n ** 3 / ms / 1e9
    except Exception as e:  # noqa: BLE001 - a ceiling we cannot measure is reported as 0
        print(f"fp8 matmul: {type(e).__name__}: {e}")
        return 0.0


def engine_peers(errors: dict) -> dict:
    """SGLang's FP8 sparse decode kernels that run here: ``name -> fn(q [B, s_q, H, 512], k_cache, indices,
    extra_k_cache, extra_indices, sink)``; what does not import or build is recorded in ``errors``."""
    peers = {}
    try:
        from sglang.kernels.ops.attention.dsv4.triton_sparse_decode import triton_fp8_attention_fwd

        peers["sglang_triton"] = lambda q, kc, i1, xc, i2, sink: triton_fp8_attention_fwd(
            q, kc, 512, 512 ** -0.5, i1, attn_sink=sink, extra_k_cache=xc, extra_indices_in_kvcache=i2)
    except Exception as e:  # noqa: BLE001
        errors["sglang_triton"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        from sglang.kernels.ops.attention.dsv4.tilelang_fp8_attention import dpsk_v4_fp8_attention_fwd

        peers["sglang_tilelang"] = lambda q, kc, i1, xc, i2, sink: dpsk_v4_fp8_attention_fwd(
            q, kc, None, None, 512, None, softmax_scale=512 ** -0.5, is_fp8_kvcache=True, indices=i1,
            attn_sink=sink, extra_k_cache=xc, extra_indices_in_kvcache=i2)
    except Exception as e:  # noqa: BLE001
        errors["sglang_tilelang"] = f"{type(e).__name__}: {str(e)[:300]}"
    return peers


def flashmla_peer(errors: dict):
    """FlashMLA's compiled ops (``flashmla_peer.ops``), or None with the reason in ``errors``."""
    try:
        import flashmla_peer

        return flashmla_peer.ops
    except Exception as e:  # noqa: BLE001 - not staged on this machine: recorded, the run goes on
        errors["flashmla"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def flashmla_decode(ops, q4, swa, i14, c4, i24, sink, out4):
    """A callable running FlashMLA's sparse decode on these inputs, its scheduler metadata made by a first call
    and reused."""
    scale = 512 ** -0.5
    res = ops.sparse_decode_fwd(q4, swa.unsqueeze(2), i14, None, sink, None, None, c4.unsqueeze(2), i24, None, 512,
                                scale, out4, False)
    meta, splits = res[2], res[3]
    return lambda: ops.sparse_decode_fwd(q4, swa.unsqueeze(2), i14, None, sink, meta, splits, c4.unsqueeze(2), i24,
                                         None, 512, scale, out4, False)


def flashmla_prefill(ops, q, swa, i1, c4, i2, sink):
    """A callable running FlashMLA's sparse prefill over a bf16 workspace holding every row of both caches
    (window rows first), with the index lists rebased into it; and that workspace and those lists."""
    rows = [dsv4.read_kv_v4(c, torch.arange(c.shape[0] * c.shape[1], device=c.device)) for c in (swa, c4)]
    kv = torch.cat(rows).unsqueeze(1).contiguous()
    idx = torch.cat([i1, i2 + rows[0].shape[0]], dim=1).unsqueeze(1).contiguous()
    out = torch.empty_like(q)
    return (lambda: ops.sparse_prefill_fwd(q, kv, idx, 512 ** -0.5, 512, sink, None, out)), kv, idx


def ws_times(q, swa, i1, c4, i2, sink, out, program="paired_ws") -> dict:
    """A workspace program's times (``program``: ``paired_ws`` or ``portable_ws``), keyed by its name:
    ``<program>_eager_ms`` the whole call (its workspace built, then the kernel), ``<program>_build_ms`` the
    workspace alone, ``<program>_ms`` the kernel alone on a workspace built once (from a CUDA graph, as the other
    programs' ``*_ms``); ``out`` holds the call's output after."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
    from musa_attn_backend.kernels.dsv4.sparse.workspace import build_workspace

    def call():
        ti.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink, out=out, program=program)

    build = lambda: build_workspace(swa, i1, extra_cache=c4, extra_indices=i2,  # noqa: E731
                                    read_rows=ti._read_rows("bench"))
    ws = build()
    kernel = ti._ws_kernel(program, q.shape[1], True)
    lse, maxl = (torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) for _ in range(2))
    times = {f"{program}_eager_ms": bench_ms(call, graph=False), f"{program}_build_ms": bench_ms(build, graph=False),
             f"{program}_ms": bench_ms(lambda: kernel(q, ws.rows, ws.indices, ws.lengths, sink, 512 ** -0.5,
                                                      float("-inf"), out, lse, maxl)),
             f"{program}_rows": ws.rows.shape[0]}
    call()
    return times


def _compile(job):
    """One kernel of :func:`precompile` (in a worker process: it lands in the kernel cache on disk)."""
    from musa_attn_backend import config
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
    from musa_attn_backend.kernels.dsv4.writers import tilelang_impl as wti

    kind, args, kwargs = job
    kwargs = dict(kwargs)
    if kwargs.get("program") in SCHED_FORMS:
        ti.SCHED_CLUSTER, kwargs["program"] = kwargs["program"] == CLUSTER, "scheduled"
    with config.override(musa_forms=kwargs.pop("musa_forms", False)):
        getattr(wti if kind.startswith("write_") else ti, kind)(*args, **kwargs)
    return job


# the scheduled program's two 65-128-head forms, named as programs here: "cluster", the clustered form at every
# token count, and "plain", the unclustered one; "scheduled" is the program as it runs (the clustered form from
# tilelang_impl.SCHED_CLUSTER_MIN_TOKENS query tokens)
CLUSTER, PLAIN = "cluster", "plain"
SCHED_FORMS = {CLUSTER: (True, 0), PLAIN: (False, 0)}


def precompile(configs, portable: bool, tilings: str, workers: int = 8, programs=()) -> None:
    """Compile every kernel the run launches in parallel worker processes first (TileLang compiles one at a time
    per process; the run then loads them from the kernel cache), reporting failures without stopping."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    hopper = ti.sparse_mqa_program() != "portable"
    variants = [dict(program=ti.sparse_mqa_program())]
    variants += [dict(program=p) for p in programs if p != ti.sparse_mqa_program()]
    if ti.sparse_mqa_program() == "scheduled" and PLAIN not in programs:  # its form for calls of few tokens
        variants.append(dict(program=PLAIN))
    variants += [dict(program="portable")] if hopper and portable else []
    variants += [dict(program="portable", musa_forms=True)] if portable else []
    jobs = [("sparse_mqa_kernel", (CONFIGS[c][0], True, True, split, "bfloat16"), v)
            for c in configs for split in (False, True) for v in variants]
    jobs += [("combine_kernel", (CONFIGS[c][0], True, "bfloat16"), {}) for c in configs]
    if "scheduled" in programs or ti.sparse_mqa_program() == "scheduled":
        jobs += [("sched_combine_kernel", (CONFIGS[c][0], True, "bfloat16"), {}) for c in configs]
    extra = [tuple(int(v) for v in t.split(":")) for t in tilings.split(",") if t]
    jobs += [(k, ("bfloat16",), {"tiling": t}) for k in ("write_kv_v4_kernel", "write_index_k_kernel")
             for t in [None] + extra]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, fut in [(j, pool.submit(_compile, j)) for j in jobs]:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - the run itself reports what cannot launch
                print(f"precompile {job}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f} s", flush=True)


def _try(fn, errors: list) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the run records it where the result is needed
        errors.append(f"{type(e).__name__}: {str(e)[:300]}")


def time_peer(name, fn, errors):
    try:
        fn()
        return bench_ms(fn)
    except Exception as e:  # noqa: BLE001 - a peer that fails on a shape is recorded, not fatal
        errors.setdefault(name, f"{type(e).__name__}: {str(e)[:300]}")
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-portable", action="store_true", help="skip timing the portable program")
    ap.add_argument("--configs", default="flash,pro", help="comma-separated: flash, pro")
    ap.add_argument("--ops", default="decode,decode_mtp,prefill",
                    help="comma-separated: decode (s_q 1), decode_mtp (s_q 2), prefill; the writers always run")
    ap.add_argument("--no-precompile", action="store_true", help="compile each kernel at its first launch instead")
    ap.add_argument("--writer-tilings", default="", help="also time the writers at these tilings, "
                                                          "tokens-per-block:threads, comma-separated (e.g. 16:256)")
    ap.add_argument("--programs", default="scheduled",
                    help="also time these sparse MQA programs (comma-separated: scheduled, cluster and plain (the "
                         "scheduled one's clustered and unclustered 65-128-head forms at every token count), paired, "
                         "paired_ws and portable_ws (over a bf16 workspace: the call, its build and its kernel "
                         "timed apart), "
                         "portable); ours_ms is the default program's")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    programs = [p for p in args.programs.split(",") if p]
    import threading

    from musa_attn_backend import _ffi_launch

    ext_error: list = []
    # the compiled launch's extension built beside the kernels (its first build takes 30-60 s)
    ext = threading.Thread(target=lambda: _try(_ffi_launch.load, ext_error), daemon=True)
    ext.start()
    if not args.no_precompile:
        precompile(args.configs.split(","), not args.no_portable, args.writer_tilings,
                   programs=programs)
    ext.join()
    ceilings = measure_ceilings()
    ceilings["fp8_matmul_tflops"] = fp8_matmul_tflops()
    print("ceilings", ceilings, flush=True)
    errors: dict = {"compiled_launch": ext_error[0]} if ext_error else {}
    peer_fns = engine_peers(errors)
    fm = flashmla_peer(errors)
    ctx = 65536
    swa, c4 = caches(ctx)
    rows = []
    decode_b = (1, 32, 64) if args.quick else (1, 8, 32, 64, 128)
    prefill_t = (4096,) if args.quick else (4096, 16384)
    g = torch.Generator(device="cuda").manual_seed(0)
    program = tilelang_impl.sparse_mqa_program()
    sched_defaults = (tilelang_impl.SCHED_CLUSTER, tilelang_impl.SCHED_CLUSTER_MIN_TOKENS)
    for cfg, (H, K) in ((c, CONFIGS[c]) for c in args.configs.split(",")):
        ops = set(args.ops.split(","))
        runs = ([("decode", B, 1) for B in decode_b if "decode" in ops]
                + [("decode", B, 2) for B in decode_b if "decode_mtp" in ops]
                + [("prefill", T, 1) for T in prefill_t if "prefill" in ops])
        for op, B, s_q in runs:
            T = B * s_q
            q, i1, i2, sink = inputs(T, H, K, swa, c4, g)
            out = torch.empty_like(q)

            plan = dsv4.sparse_mqa_plan(q, i1, None, i2, None)

            def ours(prog=program):
                # the scheduled program's forms by SCHED_FORMS, the defaults restored for every other program
                tilelang_impl.SCHED_CLUSTER, tilelang_impl.SCHED_CLUSTER_MIN_TOKENS = SCHED_FORMS.get(
                    prog, sched_defaults)
                tilelang_impl.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink, out=out,
                                                  program="scheduled" if prog in SCHED_FORMS else prog, plan=plan)

            ms = bench_ms(ours)
            extra = {"program": program}
            ours_out = out.clone()
            for prog in programs:
                if prog in tilelang_impl.WORKSPACE_PROGRAMS:  # a workspace built with a host synchronisation: no graph
                    try:
                        extra.update(ws_times(q, swa, i1, c4, i2, sink, out, prog))
                        extra[f"{prog}_max_abs_diff"] = (out.float() - ours_out.float()).abs().max().item()
                    except Exception as e:  # noqa: BLE001 - a program that fails is recorded, the run goes on
                        errors.setdefault(prog, f"{type(e).__name__}: {str(e)[:300]}")
                elif prog != program:
                    try:
                        extra[f"{prog}_ms"] = bench_ms(lambda p=prog: ours(p))
                        extra[f"{prog}_eager_ms"] = bench_ms(lambda p=prog: ours(p), graph=False)
                        extra[f"{prog}_max_abs_diff"] = (out.float() - ours_out.float()).abs().max().item()
                    except Exception as e:  # noqa: BLE001 - a program that fails is recorded, the run goes on
                        errors.setdefault(prog, f"{type(e).__name__}: {str(e)[:300]}")
            extra["eager_ms"] = bench_ms(ours, graph=False)
            extra["plan_ms"] = bench_ms(lambda: dsv4.sparse_mqa_plan(q, i1, None, i2, None))
            if op == "decode":  # FlashMLA's entry as the engines call it: one metadata object for the batch's layers
                meta = dsv4.get_mla_metadata()[0]
                entry = lambda: dsv4.flash_mla_with_kvcache(  # noqa: E731
                    q.view(B, s_q, H, 512), swa.unsqueeze(2), None, None, 512, meta, indices=i1.view(B, s_q, 128),
                    attn_sink=sink, extra_k_cache=c4.unsqueeze(2), extra_indices_in_kvcache=i2.view(B, s_q, K))
                entry()
                extra["entry_eager_ms"] = bench_ms(entry, graph=False)  # as configured (MUSA_ATTN_COMPILED_LAUNCH)
                compiled_default = tilelang_impl.SCHED_COMPILED_LAUNCH
                # the same through TileLang's launches and through the compiled launch (one call into C++, the
                # batch's later calls replaying the launches recorded there)
                for key, forced in (("entry_tilelang_eager_ms", False), ("entry_compiled_eager_ms", True)):
                    try:
                        tilelang_impl.SCHED_COMPILED_LAUNCH = forced
                        entry()
                        extra[key] = bench_ms(entry, graph=False)
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        errors.setdefault("compiled_launch", f"{type(e).__name__}: {str(e)[:300]}")
                    finally:
                        tilelang_impl.SCHED_COMPILED_LAUNCH = compiled_default
            if fm is not None:
                try:
                    if op == "decode":
                        out4 = torch.empty(B, s_q, H, 512, device="cuda", dtype=torch.bfloat16)
                        fn = flashmla_decode(fm, q.view(B, s_q, H, 512), swa, i1.view(B, s_q, 128), c4,
                                             i2.view(B, s_q, K), sink, out4)
                        extra["flashmla_ms"] = bench_ms(fn)
                        extra["flashmla_eager_ms"] = bench_ms(fn, graph=False)
                        extra["flashmla_max_abs_diff"] = (out4.view(T, H, 512).float()
                                                          - ours_out.float()).abs().max().item()
                    else:
                        fn, kv, idx = flashmla_prefill(fm, q, swa, i1, c4, i2, sink)
                        extra["flashmla_prefill_ms"] = bench_ms(fn, graph=False, rep=10)
                        if "paired_ws" in programs:  # our paired_ws program on FlashMLA's own inputs
                            ours_fm = lambda: dsv4.flash_mla_sparse_fwd(q, kv, idx, 512 ** -0.5,  # noqa: E731
                                                                        attn_sink=sink)
                            extra["paired_ws_on_flashmla_inputs_ms"] = bench_ms(ours_fm, graph=False, rep=10)
                            extra["paired_ws_on_flashmla_inputs_max_abs_diff"] = (
                                ours_fm()[0].float() - fn()[0].float()).abs().max().item()
                            del ours_fm
                        ws_bytes = T * (K + 128) * (L.ROW_BYTES + 512 * 2)  # read the FP8 rows, write bf16 rows
                        extra["workspace_floor_ms"] = ws_bytes / ceilings["copy_tbps"] / 1e9
                        extra["flashmla_max_abs_diff"] = (fn()[0].float() - ours_out.float()).abs().max().item()
                        del fn, kv, idx
                        # the same tokens through FlashMLA's FP8 decode kernel (each a one-query request): the
                        # kernel that reads the FP8 cache as ours does, where its prefill reads a bf16 workspace.
                        # Up to 4096 requests: its scheduling-metadata kernel fails to launch at 16384 (invalid
                        # argument, H100, 2026-12-06) and leaves the CUDA context unusable for the rest of the run
                        if T <= 4096:
                            out4 = torch.empty(T, 1, H, 512, device="cuda", dtype=torch.bfloat16)
                            fn = flashmla_decode(fm, q.view(T, 1, H, 512), swa, i1.view(T, 1, 128), c4,
                                                 i2.view(T, 1, K), sink, out4)
                            extra["flashmla_fp8_decode_ms"] = bench_ms(fn, rep=10)
                            del fn, out4
                except Exception as e:  # noqa: BLE001 - a FlashMLA failure is recorded, the run goes on
                    errors.setdefault("flashmla", f"{type(e).__name__}: {str(e)[:300]}")
            if program != "portable" and not args.no_portable:
                extra["portable_ms"] = bench_ms(lambda: ours("portable"))
            if not args.no_portable:
                from musa_attn_backend import config

                with config.override(musa_forms=True):
                    extra["musa_form_ms"] = bench_ms(lambda: ours("portable"))
            peers = {}
            if "flashmla_ms" in extra:
                peers["flashmla"] = extra["flashmla_ms"]
            elif "flashmla_prefill_ms" in extra:
                peers["flashmla"] = extra["flashmla_prefill_ms"]
            if T <= 4096:
                for name, fn in list(peer_fns.items()):
                    q4, i14, i24 = q.view(B, s_q, H, 512), i1.view(B, s_q, 128), i2.view(B, s_q, K)
                    t_ms = time_peer(name, lambda fn=fn: fn(q4, swa.unsqueeze(2), i14, c4.unsqueeze(2), i24, sink),
                                     errors)
                    if t_ms is not None:
                        peers[name] = t_ms
                    elif name == "sglang_tilelang":  # a build failure is not shape-specific: try it once
                        del peer_fns[name]
            if T <= 4096 and s_q == 1:
                peers["torch_gather"] = bench_ms(lambda: dsv4.sparse_mqa(
                    q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink, impl="reference"), graph=False,
                    rep=5, warmup=1)
            rows.append(row(op, cfg, T, H, K, ms, peers, ceilings, s_q, extra))
            Path(args.out, "dsv4-attention-partial.json").write_text(json.dumps(
                {"ceilings": ceilings, "peer_errors": errors, "rows": rows}))  # survives a cut-off run
            torch.cuda.empty_cache()
    writer_rows(rows, ceilings, g, args.writer_tilings)
    write_run(args.out, "dsv4-attention", run_document(ceilings, errors, rows))
    Path(args.out, "dsv4-attention-partial.json").unlink(missing_ok=True)


def run_document(ceilings: dict, errors: dict, rows: list) -> dict:
    """A run's JSON: device, commit, date, versions, the ceilings, the peers' errors, the rows."""
    import tilelang

    return {"device": torch.cuda.get_device_name(), "commit": git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "tilelang": tilelang.__version__,
                         "python": _platform.python_version()},
            "ceilings": ceilings, "peer_errors": errors, "rows": rows}


def writer_rows(rows, ceilings, g, tilings: str):
    """Writer throughput at 16k rows (random distinct slots), at the default tiling and at each of ``tilings``
    ("T:threads,..."), against the copy rate."""
    from musa_attn_backend.kernels.dsv4.writers import tilelang_impl

    extra_tilings = [tuple(int(v) for v in t.split(":")) for t in tilings.split(",") if t]
    for name, width, row_bytes in (("write_kv_v4", 512, L.ROW_BYTES), ("write_index_k", 128, L.INDEX_ROW_BYTES)):
        T = 16384
        x = torch.randn(T, width, device="cuda", generator=g).to(torch.bfloat16)
        if name == "write_kv_v4":
            cache = L.new_kv_cache(T // 64, 64, "cuda")
            fn = lambda: dsv4.write_kv_v4(x, cache, slots, impl="tilelang")  # noqa: E731
        else:
            buf = torch.zeros(T // 64, L.index_page_bytes(64), dtype=torch.uint8, device="cuda")
            cache = dsv4.paged_view(buf, 64, L.INDEX_ROW_BYTES)
            fn = lambda: dsv4.write_index_k(x, cache, slots, impl="tilelang")  # noqa: E731
        slots = torch.randperm(T, device="cuda", generator=g)
        ms = bench_ms(fn)
        moved = T * (width * 2 + row_bytes + 8)  # read the rows and slots, write the packed rows
        tbps = moved / ms / 1e9
        sweep = {}
        attr = "WRITE_KV_TILING" if name == "write_kv_v4" else "WRITE_INDEX_K_TILING"
        default = getattr(tilelang_impl, attr)
        for tiling in extra_tilings:
            setattr(tilelang_impl, attr, tiling)
            try:
                sweep[f"{tiling[0]}x{tiling[1]}"] = bench_ms(fn)
            finally:
                setattr(tilelang_impl, attr, default)
        rows.append({"op": name, "shape": dict(tokens=T), "ours_ms": ms, "peers": {}, "tbps": tbps,
                     "roofline_frac": tbps / ceilings["copy_tbps"], "ratio_vs_best_peer": None,
                     "tiling": f"{default[0]}x{default[1]}", "tiling_sweep_ms": sweep})
        print(f"{name:14s} T={T}  {ms:.4f} ms  {tbps:.2f} TB/s  {tbps / ceilings['copy_tbps']:.2f} of copy  "
              + "  ".join(f"{k} {v:.4f}" for k, v in sweep.items()), flush=True)


if __name__ == "__main__":
    main()
