"""DeepSeek-V4 indexer benchmark: our TileLang logits (prefill and paged decode) and top-k against the peers that
run here, in one run, with the FP8 matmul rate (``torch._scaled_mm``, 8192^3) and the copy bandwidth measured in
the same run as the ceilings.

    python benchmarks/bench_dsv4_indexer.py [--quick] [--out benchmarks/results]

Rows:
- ``logits_prefill``: T query tokens x S compressed keys, 64 heads. ``causal``: token t sees keys
  ``[0, (S * (t + 1)) // T)`` (the shape of a fresh prefill); ``full``: every key. FLOPs = 2 * 64 * 128 per
  (token, visible key); the roofline is the FP8 matmul rate.
- ``logits_paged``: B requests of 1 query row at ``context`` compressed keys each (8k-256k tokens: 2k-64k keys),
  pages of 64 shuffled over the cache. Bytes = keys x 132 + logits x 4; the roofline is the copy rate.
- ``topk``: B rows of L logits, k 512 / 1024; bytes = B x L x 4.
- ``compress``: one call of the compressor (ratio 4 / 128, the attention (512) or indexer (128) width, vLLM's
  paged state or SGLang's rings): ``prefill`` 4096 new tokens of one request; ``decode`` one token for each of B
  requests at a position that emits a row (their earlier tokens compressed before timing). Bytes = the
  ``[kv | score]`` rows read (the new tokens' and, for decode, the window's from the state) + the state rows
  written + the cache rows written; the roofline is the copy rate.

Peers: ``deepgemm``: DeepGEMM's ``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits`` (2.8.1, SM90: FP8 q
without a scale, float32 weights and key scales, the paged cache in 64-row blocks of 132-byte rows, its scheduling
metadata made once, untimed; the 2.6 names where those are missing), with ``calc_diff`` and the largest
difference to our logits over the keys each row sees (``deepgemm_check``); ``torch_ref`` (our float32 reference run
on the GPU), SGLang's TileLang ``tilelang_fp8_paged_mqa_logits`` and torch ``fp8_paged_mqa_logits_torch`` (paged,
where SGLang is importable; what fails is recorded under ``peer_errors``), ``torch.topk`` (top-k).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_attention import bench_ms, measure_ceilings, write_run  # noqa: E402
from bench_dsv4_attention import fp8_matmul_tflops, run_document  # noqa: E402

from musa_attn_backend.kernels import dsv4  # noqa: E402
from musa_attn_backend.kernels.dsv4 import layout as L  # noqa: E402
from musa_attn_backend.testing.dsv4_compress import call_args, make_case  # noqa: E402
from musa_attn_backend.testing.numeric import calc_diff  # noqa: E402

H = 64


def row(op, shape, ms, peers, ceilings, flops=0.0, bytes_=0.0):
    tflops, tbps = flops / ms / 1e9, bytes_ / ms / 1e9
    roof = max(tflops / ceilings["fp8_matmul_tflops"] if ceilings["fp8_matmul_tflops"] else 0.0,
               tbps / ceilings["copy_tbps"])
    best = min(peers.values()) if peers else None
    r = {"op": op, "shape": shape, "ours_ms": ms, "peers": peers, "tflops": tflops, "tbps": tbps,
         "roofline_frac": roof, "ratio_vs_best_peer": best / ms if best else None}
    print(f"{op:15s} {shape}  ours {ms:.4f} ms  {tflops:6.1f} TFLOP/s  {tbps:5.2f} TB/s  roof {roof:.2f}  "
          + "  ".join(f"{k} {v:.4f}" for k, v in peers.items()), flush=True)
    return r


def time_peer(name, fn, errors, **kw):
    try:
        fn()
        return bench_ms(fn, **kw)
    except Exception as e:  # noqa: BLE001 - a peer that fails is recorded, not fatal
        errors.setdefault(name, f"{type(e).__name__}: {str(e)[:300]}")
        return None


def sglang_paged_peers(errors: dict) -> dict:
    """SGLang's paged indexer logits that run here: ``name -> fn(q [B, 1, 64, 128], cache [P, 64, 1, 132], w,
    lens [B], table [B, W], max_len)``."""
    peers = {}
    try:
        from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

        peers["sglang_torch"] = lambda q, c, w, n, t, m: fp8_paged_mqa_logits_torch(q, c, w, n, t, None, m, False)
    except Exception as e:  # noqa: BLE001
        errors["sglang_torch"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        from sglang.kernels.ops.attention.dsa.tilelang_kernel import tilelang_fp8_paged_mqa_logits

        peers["sglang_tilelang"] = lambda q, c, w, n, t, m: tilelang_fp8_paged_mqa_logits(q, c, w, n, t, None, m,
                                                                                         False)
    except Exception as e:  # noqa: BLE001
        errors["sglang_tilelang"] = f"{type(e).__name__}: {str(e)[:300]}"
    return peers


def deepgemm_logits(errors: dict) -> dict:
    """DeepGEMM's indexer logits where ``deep_gemm`` imports: ``{"prefill": fn(q, w, k, ks, starts, ends,
    max_keys) -> [T, max_keys]`` (row t's keys from ``starts[t]`` at column 0), ``"paged": (fn(q, cache4, w, lens,
    table, max_len, meta) -> [B, max_len], meta_fn(lens) -> meta)``}."""
    try:
        import deep_gemm as dg
    except Exception as e:  # noqa: BLE001
        errors["deepgemm"] = f"{type(e).__name__}: {str(e)[:300]}"
        return {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {}
    if hasattr(dg, "fp8_fp4_mqa_logits"):  # 2.8: q as (fp8, scale or None), the compressed width given
        out["prefill"] = lambda q, w, k, ks, st, en, n: dg.fp8_fp4_mqa_logits((q, None), (k, ks), w, st, en, n)
        out["paged"] = (lambda q, c, w, lens, t, n, meta: dg.fp8_fp4_paged_mqa_logits((q, None), c, w, lens, t, meta,
                                                                                      n),
                        lambda lens: dg.get_paged_mqa_logits_metadata(lens, 64, sms))
    else:  # 2.6
        out["prefill"] = lambda q, w, k, ks, st, en, n: dg.fp8_mqa_logits(q, (k, ks), w, st, en, clean_logits=False)
        out["paged"] = (lambda q, c, w, lens, t, n, meta: dg.fp8_paged_mqa_logits(q, c, w, lens, t, meta, n, False),
                        lambda lens: dg.get_paged_mqa_logits_metadata(lens, 64, sms))
    return out


def agreement(ours: torch.Tensor, theirs: torch.Tensor, seen: torch.Tensor) -> dict:
    """``calc_diff`` and the largest difference of two logits tables over the entries ``seen`` marks."""
    a, b = ours[seen].float(), theirs[seen].float()
    return {"calc_diff": calc_diff(a, b), "max_abs_diff": float((a - b).abs().max()) if a.numel() else 0.0}


def prefill_rows(rows, ceilings, errors, g, quick):
    dg = deepgemm_logits(errors)
    shapes = [(4096, 16384)] if quick else [(4096, 16384), (4096, 65536), (16384, 65536)]
    for T, S in shapes:
        q = torch.randn(T, H, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(T, H, device="cuda", generator=g)
        k = torch.randn(S, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        ks = torch.rand(S, device="cuda", generator=g) + 0.5
        for mode in ("causal", "full"):
            t = torch.arange(T, device="cuda")
            ends = ((S * (t + 1)) // T if mode == "causal" else torch.full_like(t, S)).to(torch.int32)
            starts = torch.zeros_like(ends)
            pairs = float(ends.sum())
            ms = bench_ms(lambda: dsv4.indexer_logits(q, w, k, ks, starts, ends, impl="tilelang"), graph=False)
            peers = {}
            if T * S <= 4096 * 16384:
                t_ms = time_peer("torch_ref", lambda: dsv4.indexer_logits(q, w, k, ks, starts, ends,
                                                                          impl="reference"), errors, graph=False,
                                 rep=3, warmup=1)
                if t_ms:
                    peers["torch_ref"] = t_ms
            check = {}
            if "prefill" in dg:
                fn = lambda: dg["prefill"](q, w, k, ks, starts, ends, S)  # noqa: E731
                t_ms = time_peer("deepgemm", fn, errors, graph=False)
                if t_ms:
                    peers["deepgemm"] = t_ms
                    seen = torch.arange(S, device="cuda")[None, :] < ends[:, None]  # starts are 0: columns = keys
                    check = agreement(dsv4.indexer_logits(q, w, k, ks, starts, ends, impl="tilelang"),
                                      fn()[:, :S], seen)
            r = row("logits_prefill", dict(tokens=T, keys=S, heads=H, mode=mode), ms, peers, ceilings,
                    flops=2 * H * 128 * pairs, bytes_=T * S * 4 + S * 132)
            if check:
                r["deepgemm_check"] = check
            rows.append(r)
            torch.cuda.empty_cache()


def paged_rows(rows, ceilings, errors, g, quick):
    peers_fns = sglang_paged_peers(errors)
    dg = deepgemm_logits(errors)
    batches = (1, 32, 128) if quick else (1, 8, 32, 128)
    contexts = (2048, 16384) if quick else (2048, 16384, 65536)
    for ctx in contexts:
        pages_per_req = ctx // 64
        for B in batches:
            n_pages = B * pages_per_req
            buf = torch.empty(n_pages, L.index_page_bytes(64), dtype=torch.uint8, device="cuda")
            cache = dsv4.paged_view(buf, 64, L.INDEX_ROW_BYTES)
            for s0 in range(0, n_pages * 64, 1 << 20):
                s = torch.arange(s0, min(n_pages * 64, s0 + (1 << 20)), device="cuda")
                dsv4.write_index_k(torch.randn(len(s), 128, device="cuda", generator=g), cache, s)
            table = torch.randperm(n_pages, device="cuda", generator=g).view(B, pages_per_req).to(torch.int32)
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(B, 1, H, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
            w = torch.randn(B, H, device="cuda", generator=g)
            ms = bench_ms(lambda: dsv4.paged_indexer_logits(q, w, cache, lens, table, ctx, clean=False,
                                                            impl="tilelang"))
            peers = {}
            c4 = cache.view(n_pages, 64, 1, L.INDEX_ROW_BYTES)
            for name, fn in peers_fns.items():
                t_ms = time_peer(name, lambda fn=fn: fn(q, c4, w, lens, table, ctx), errors)
                if t_ms:
                    peers[name] = t_ms
            check = {}
            if "paged" in dg:
                fn_dg, meta_of = dg["paged"]
                lens2 = lens.view(B, 1)  # [batch, next_n]
                meta = meta_of(lens2)
                fn = lambda: fn_dg(q, c4, w, lens2, table, ctx, meta)  # noqa: E731
                t_ms = time_peer("deepgemm", fn, errors)
                if t_ms:
                    peers["deepgemm"] = t_ms
                    ours = dsv4.paged_indexer_logits(q, w, cache, lens, table, ctx, clean=False, impl="tilelang")
                    check = agreement(ours.view(B, -1)[:, :ctx], fn().view(B, -1)[:, :ctx],
                                      torch.ones(B, ctx, dtype=torch.bool, device="cuda"))
            r = row("logits_paged", dict(batch=B, keys=ctx), ms, peers, ceilings,
                    flops=2 * H * 128 * B * ctx, bytes_=B * ctx * (132 + 4))
            if check:
                r["deepgemm_check"] = check
            rows.append(r)
            torch.cuda.empty_cache()


def topk_rows(rows, ceilings, errors, g, quick):
    for k in (512, 1024):
        for B in ((1, 128) if quick else (1, 32, 128)):
            for n in ((2048, 65536) if quick else (2048, 16384, 65536)):
                logits = torch.randn(B, n, device="cuda", generator=g)
                lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
                ms = bench_ms(lambda: dsv4.indexer_topk(logits, lens, k, impl="tilelang"))
                peers = {}
                t_ms = time_peer("torch_topk", lambda: torch.topk(logits, k, dim=1, sorted=False), errors)
                if t_ms:
                    peers["torch_topk"] = t_ms
                rows.append(row("topk", dict(rows=B, length=n, k=k), ms, peers, ceilings, bytes_=B * n * 4))


COMPRESS_CASES = [(4, L.D, "paged", False, "pow2"), (4, L.INDEX_D, "ring", True, "exact"),
                  (128, L.D, "paged", False, "pow2"), (128, L.D, "ring", False, "pow2")]


def compress_rows(rows, ceilings, errors, g, quick):
    for ratio, d, layout, rotate, scale in COMPRESS_CASES:
        coff = 2 if ratio == 4 else 1
        width = 2 * coff * d
        row_bytes = L.ROW_BYTES if d == L.D else L.INDEX_ROW_BYTES
        win = coff * ratio
        for mode, B in [("prefill", 1)] + [("decode", b) for b in ((128,) if quick else (1, 32, 128))]:
            # decode: each request's earlier tokens first, so the timed token (position 1023) emits a row
            schedules = [[4096]] * B if mode == "prefill" else [[1023, 1]] * B
            case = make_case(ratio, d, layout, schedules, "cuda", seed=ratio + d)
            calls = call_args(case, rotate, scale)
            kw = next(calls)
            if mode == "decode":  # the earlier tokens first; the decode step is timed
                dsv4.compress(**kw, impl="tilelang")
                kw = next(calls)
            T = kw["kv_score"].shape[0]
            emitted = T // ratio if mode == "prefill" else T
            state_writes = T if layout == "paged" else min(T, case.addr["state_ring"] * B)
            reads = T * width * 4 + (T * (win - 1) * width * 4 if mode == "decode" else 0)
            bytes_ = reads + state_writes * width * 4 + emitted * row_bytes
            ms = bench_ms(lambda: dsv4.compress(**kw, impl="tilelang"))
            rows.append(row("compress", dict(mode=mode, batch=B, tokens=T, ratio=ratio, width=d, state=layout,
                                             rotate=rotate, scale=scale), ms, {}, ceilings, bytes_=bytes_))
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ops", default="prefill,paged,topk,compress",
                    help="comma-separated: prefill, paged, topk, compress")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    ceilings = measure_ceilings()
    ceilings["fp8_matmul_tflops"] = fp8_matmul_tflops()
    print("ceilings", ceilings, flush=True)
    errors: dict = {}
    rows: list = []
    g = torch.Generator(device="cuda").manual_seed(0)
    ops = set(args.ops.split(","))
    for name, fn in (("topk", topk_rows), ("paged", paged_rows), ("compress", compress_rows),
                     ("prefill", prefill_rows)):
        if name in ops:
            try:
                fn(rows, ceilings, errors, g, args.quick)
            except Exception as e:  # noqa: BLE001 - keep the rows measured so far
                errors[f"ours_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
    write_run(args.out, "dsv4-indexer", run_document(ceilings, errors, rows))


if __name__ == "__main__":
    main()
