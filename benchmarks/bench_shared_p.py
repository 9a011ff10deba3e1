"""What staging P through shared memory costs (the programs MUSA gets) against keeping it in registers, on the
same GPU in the same run.

    python benchmarks/bench_shared_p.py [--out benchmarks/results] [--jobs 14]

MUSA's GEMMs read no A operand from registers, so there every attention program writes the softmax
probabilities P to a shared tile before the ``P V`` product (``platform.gemm_a_in_registers``;
``MUSA_ATTN_SHARED_P=1`` does the same on CUDA). Rows:

* ``prefill``: one tiling (the non-ping-pong default of the shape class) with P in registers (``register_p``)
  and in shared memory (``ours_ms``); ``musa_choice``: the tiling MP31 would pick (its 192 KB of shared memory
  leave out some), with P in shared memory, run here; ``default``: what this GPU runs by default (on Hopper
  the ping-pong kernel); ``sdpa_cudnn``: the strongest peer on contiguous K/V.
* ``decode``: the 64-row decode tiling (more than 16 query rows a KV head: speculative verify, or many heads
  a KV head), P in registers or shared; ``sdpa_flash`` the peer.

Every kernel is compiled first, in parallel worker processes, into the kernel cache. Rooflines: prefill
against a measured bf16 matmul rate, decode against measured copy bandwidth (bench_attention.measure_ceilings).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform as _platform
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_attention import bench_ms, git_commit, measure_ceilings, paged_cache, write_run  # noqa: E402

from musa_attn_backend import config  # noqa: E402
from musa_attn_backend.kernels import paged_attention  # noqa: E402
from musa_attn_backend.kernels.attention import tilelang_impl as ti  # noqa: E402
from musa_attn_backend.metadata import PagedKVMeta  # noqa: E402

# (q heads, kv heads, head dim, FP8 cache, page size, query length)
PREFILL = [(32, 8, 128, False, 1, 4096), (32, 8, 128, False, 128, 4096), (32, 8, 128, False, 1, 16384),
           (32, 8, 128, True, 16, 4096), (16, 4, 256, False, 1, 4096)]
# (q heads, kv heads, query tokens a request, batch, context): 32 and 64 rows a KV head
DECODE = [(32, 1, 1, 32, 8192), (32, 8, 8, 32, 4096), (32, 1, 1, 128, 4096), (32, 8, 8, 8, 32768)]


def _tiling(d, fp8, page):
    """(forced non-ping-pong tiling, MP31's choice) for a prefill shape class."""
    with config.override(target="sm_90a"):
        same = next(c for c in ti.prefill_candidates(d, d, fp8, page, False) if not c.pingpong)
    with config.override(target="mp_31"):
        musa = ti.prefill_config(d, d, fp8, page, False)
    return same, musa


def _prefill_variants(d, fp8, page):
    same, musa = _tiling(d, fp8, page)
    return [("register_p", same, False), ("ours", same, True), ("musa_choice", musa, True), ("default", None, False)]


def _spec(hq, hkv, d, fp8, page):
    lay = (hkv * d, hkv * d, d)
    return ti.AttnSpec(hq, hkv, d, d, "bfloat16", "float8_e4m3" if fp8 else "bfloat16", k_layout=lay, v_layout=lay)


def _build(job):
    """Compile one kernel (worker process): ``(kind, args, shared_p)``."""
    kind, args, shared_p = job
    with config.override(shared_p=shared_p):
        if kind == "prefill":
            spec, page, cfg = args
            ti.prefill_kernel(spec, True, page, cfg=cfg)
        else:
            spec, max_q = args
            dcfg = ti.decode_config(max_q, spec.group, spec.is_fp8, spec.dv)
            ti.decode_kernel(spec, dcfg, True)
            ti.decode_kernel(spec, dcfg, False)
            ti.combine_kernel(spec)
    return job


def prebuild(jobs_n: int) -> None:
    jobs = []
    for hq, hkv, d, fp8, page, _ in PREFILL:
        for _, cfg, shared_p in _prefill_variants(d, fp8, page):
            jobs.append(("prefill", (_spec(hq, hkv, d, fp8, page), page, cfg), shared_p))
    for hq, hkv, q, _, _ in DECODE:
        for shared_p in (False, True):
            jobs.append(("decode", (_spec(hq, hkv, 128, False, 64), q), shared_p))
    import multiprocessing

    with ProcessPoolExecutor(max_workers=jobs_n, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build, dict.fromkeys(jobs)))


def prefill_rows(ceilings):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for hq, hkv, d, fp8, page, s in PREFILL:
        q = torch.randn(s, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v, table = paged_cache(1, s, hkv, d, page, torch.bfloat16)
        if fp8:
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        meta = PagedKVMeta.from_vllm(
            block_table=table, query_start_loc=torch.tensor([0, s], dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor([s], dtype=torch.int32, device="cuda"),
            slot_mapping=torch.arange(s, device="cuda"), page_size=page, max_seqlen_q=s, max_seqlen_k=s)
        # scales as device tensors (a Python float would be copied to the device inside the graph capture)
        ones = torch.ones(hkv, device="cuda")
        scales = dict(k_scale=ones, v_scale=ones) if fp8 else {}
        ms, cfgs = {}, {}
        for name, cfg, shared_p in _prefill_variants(d, fp8, page):
            with config.override(shared_p=shared_p):
                ms[name] = bench_ms(lambda: paged_attention(q, k, v, meta, causal=True, impl="tilelang",
                                                            **scales) if cfg is None else
                                    ti.paged_attention_tilelang(q, k, v, meta, causal=True, prefill_cfg=cfg,
                                                                **scales))
                cfgs[name] = str(cfg or ti.prefill_config(d, d, fp8, page, False))
        qt = q.view(1, s, hq, d).transpose(1, 2)
        kt, vt = (torch.randn(1, hq, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
            fn()
            ms["sdpa_cudnn"] = bench_ms(fn)
        flops = 4 * hq * s * s * d * 0.5
        rows.append(_row("prefill", dict(batch=1, seqlen_q=s, seqlen_k=s, heads_q=hq, heads_kv=hkv, head_dim=d,
                                          page_size=page, causal=True, fp8=fp8), ms, cfgs,
                         flops / ms["ours"] / 1e9 / ceilings["bf16_matmul_tflops"]))
        del k, v, kt, vt
        torch.cuda.empty_cache()
    return rows


def decode_rows(ceilings):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    d, page = 128, 64
    for hq, hkv, qlen, b, ctx in DECODE:
        k, v, table = paged_cache(b, ctx, hkv, d, page, torch.bfloat16)
        q = torch.randn(b * qlen, hq, d, device="cuda", dtype=torch.bfloat16)
        meta = PagedKVMeta.from_vllm(
            block_table=table, query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda") * qlen,
            seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"),
            slot_mapping=torch.zeros(b * qlen, dtype=torch.int64, device="cuda"), page_size=page,
            max_seqlen_q=qlen, max_seqlen_k=ctx)
        ms, cfgs = {}, {}
        for name, shared_p in (("register_p", False), ("ours", True)):
            with config.override(shared_p=shared_p):
                ms[name] = bench_ms(lambda: paged_attention(q, k, v, meta, impl="tilelang"))
                cfgs[name] = str(ti.decode_config(qlen, hq // hkv))
        qt = q.view(b, qlen, hq, d).transpose(1, 2)
        kt, vt = (torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
            try:
                fn()
                ms["sdpa_flash"] = bench_ms(fn)
            except Exception as e:
                print(f"  sdpa_flash skipped: {type(e).__name__}: {e}"[:200])
        kv_bytes = b * ctx * hkv * d * 2 * 2
        rows.append(_row("decode", dict(batch=b, seqlen_q=qlen, seqlen_k=ctx, heads_q=hq, heads_kv=hkv, head_dim=d,
                                         page_size=page, causal=True, fp8=False), ms, cfgs,
                         kv_bytes / ms["ours"] / 1e9 / ceilings["copy_tbps"]))
        del k, v, kt, vt
        torch.cuda.empty_cache()
    return rows


def _row(op, shape, ms, cfgs, roof):
    peers = {k: v for k, v in ms.items() if k != "ours"}
    row = {"op": op, "shape": shape, "ours_ms": ms["ours"], "peers": peers, "configs": cfgs,
           "roofline_frac": roof,
           "shared_p_cost": ms["ours"] / ms["register_p"],  # > 1: staging P costs that factor
           "ratio_vs_peers": {k: v / ms["ours"] for k, v in peers.items()}}
    print(f"{op:8s} {shape}  shared {ms['ours']:.4f} ms  register {ms['register_p']:.4f} ms  "
          f"cost x{row['shared_p_cost']:.3f}  " + "  ".join(f"{k} {v:.4f}" for k, v in peers.items()
                                                             if k != "register_p"), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--jobs", type=int, default=8, help="parallel compile processes")
    args = ap.parse_args(argv)
    prebuild(args.jobs)
    ceilings = measure_ceilings()
    rows = prefill_rows(ceilings) + decode_rows(ceilings)
    import tilelang

    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "tilelang": tilelang.__version__,
                        "python": _platform.python_version()},
           "what": "P staged through shared memory (MUSA's programs) vs in registers, same tiling, same run",
           "ceilings": ceilings, "rows": rows}
    write_run(args.out, "shared-p", doc)


if __name__ == "__main__":
    main()
