"""One DeepSeek-V4 sparse MQA launch per program and mode, and one launch of each indexer program, against the
references, on the GPU: a quick check (run under `timeout`) before the full GPU tests, which would hang on a
deadlocked program."""

import sys
import time

import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti


def main() -> int:
    dev = "cuda"
    swa = L.new_kv_cache(8, 256, dev)
    c4 = L.new_kv_cache(40, 64, dev)
    for c in (swa, c4):
        n = c.shape[0] * c.shape[1]
        dsv4.write_kv_v4(torch.randn(n, 512, device=dev).to(torch.bfloat16), c, torch.arange(n, device=dev))
    bad = 0
    for program in ("scheduled", "paired", "portable"):
        for T, H in ((2, 128), (300, 64)):
            q = torch.randn(T, H, 512, device=dev).to(torch.bfloat16)
            i1 = torch.randint(-1, 8 * 256, (T, 128), device=dev, dtype=torch.int32)
            i2 = torch.randint(-1, 40 * 64, (T, 512), device=dev, dtype=torch.int32)
            sink = torch.randn(H, device=dev)
            t0 = time.time()
            got, lse = ti.sparse_mqa_tilelang(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink,
                                              return_lse=True, program=program)
            torch.cuda.synchronize()
            ref, ref_lse = dsv4.sparse_mqa(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink,
                                           return_lse=True, impl="reference")
            err = (got.float() - ref.float()).abs().max().item()
            lerr = (lse - ref_lse).abs().max().item()
            ok = err < 2e-2 and lerr < 2e-3
            bad += not ok
            print(f"{program:10s} T={T:4d} H={H:3d} max|out-ref| {err:.2e} max|lse-ref| {lerr:.2e} "
                  f"{'ok' if ok else 'FAIL'} ({time.time() - t0:.1f} s)", flush=True)
    bad += indexer_smoke(dev)
    return 1 if bad else 0


def indexer_smoke(dev) -> int:
    """One launch of each indexer program (prefill logits, paged logits with MTP rows, top-k) against its
    reference."""
    bad = 0
    q = torch.randn(9, 64, 128, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(9, 64, device=dev)
    k = torch.randn(3000, 128, device=dev).to(torch.float8_e4m3fn)
    ks = torch.rand(3000, device=dev) + 0.5
    starts = torch.randint(0, 100, (9,), device=dev, dtype=torch.int32)
    ends = starts + torch.randint(0, 2900, (9,), device=dev, dtype=torch.int32)
    cache = dsv4.paged_view(torch.zeros(50, L.index_page_bytes(64), dtype=torch.uint8, device=dev), 64,
                            L.INDEX_ROW_BYTES)
    dsv4.write_index_k(torch.randn(3200, 128, device=dev), cache, torch.arange(3200, device=dev))
    q4 = torch.randn(3, 2, 64, 128, device=dev).to(torch.float8_e4m3fn)
    table = torch.randint(0, 50, (3, 20), device=dev, dtype=torch.int32)
    lens = torch.randint(0, 1280, (3, 2), device=dev, dtype=torch.int32)
    runs = [("indexer_logits", lambda impl: dsv4.indexer_logits(q, w, k, ks, starts, ends, impl=impl)),
            ("paged_indexer_logits", lambda impl: dsv4.paged_indexer_logits(q4, w[:6], cache, lens, table, 1280,
                                                                            impl=impl))]
    for name, fn in runs:
        t0 = time.time()
        got = fn("tilelang")
        torch.cuda.synchronize()
        ref = fn("reference")
        fin = torch.isfinite(ref)
        ok = torch.equal(torch.isneginf(got), torch.isneginf(ref)) and bool(
            ((got - ref).abs().where(fin, 0) <= 1e-3 * ref.abs().where(fin, 0).amax() + 1e-3 * ref.abs()).all())
        bad += not ok
        print(f"{name:22s} {'ok' if ok else 'FAIL'} ({time.time() - t0:.1f} s)", flush=True)
    qb = torch.randn(7, 64, 128, device=dev).to(torch.bfloat16)
    wb = torch.randn(7, 64, device=dev).to(torch.bfloat16)
    ang = torch.rand(100, 32, device=dev) * 6.3
    pos = torch.randint(0, 100, (7,), device=dev)
    t0 = time.time()
    q8, wq = dsv4.indexer_q(qb, wb, pos, ang.cos(), ang.sin(), impl="tilelang")
    torch.cuda.synchronize()
    r8, rq = dsv4.indexer_q(qb, wb, pos, ang.cos(), ang.sin(), impl="reference")
    ok = torch.allclose(wq, rq, rtol=1e-5) and (q8.float() == r8.float()).float().mean().item() > 0.99
    bad += not ok
    print(f"{'indexer_q':22s} {'ok' if ok else 'FAIL'} ({time.time() - t0:.1f} s)", flush=True)
    logits = torch.randn(5, 4000, device=dev)
    n = torch.tensor([4000, 100, 3000, 513, 2000], device=dev, dtype=torch.int32)
    t0 = time.time()
    got = dsv4.indexer_topk(logits, n, 512, impl="tilelang")
    torch.cuda.synchronize()
    ref = dsv4.indexer_topk(logits, n, 512, impl="reference")
    ok = torch.equal(got.sort(dim=1).values, ref.sort(dim=1).values)  # no ties in random floats
    bad += not ok
    print(f"{'indexer_topk':22s} {'ok' if ok else 'FAIL'} ({time.time() - t0:.1f} s)", flush=True)
    for ratio, d in ((4, 512), (128, 128)):
        coff = 2 if ratio == 4 else 1
        T = 300
        kv = torch.randn(T, 2 * coff * d, device=dev)
        ape = torch.randn(ratio, coff * d, device=dev)
        ang = torch.rand(T + 1, 32, device=dev) * 6.3
        runs = []
        for impl in ("tilelang", "reference"):
            state = torch.zeros(T, 2 * coff * d, device=dev)
            cache = (L.new_kv_cache(8, 64, dev) if d == 512 else
                     dsv4.paged_view(torch.zeros(8, L.index_page_bytes(64), dtype=torch.uint8, device=dev), 64,
                                     L.INDEX_ROW_BYTES))
            t0 = time.time()
            rows = dsv4.compress(kv, ape, torch.arange(T, device=dev), torch.zeros(T, dtype=torch.int32, device=dev),
                                 torch.tensor([0, T], dtype=torch.int32, device=dev),
                                 torch.tensor([T], dtype=torch.int32, device=dev), ratio=ratio, state=state,
                                 state_table=torch.zeros(1, 4, dtype=torch.int32, device=dev), state_block=T,
                                 state_ring=T, norm_weight=torch.ones(d, device=dev), eps=1e-6, cos=ang.cos(),
                                 sin=ang.sin(), cache=cache, out_slots=torch.arange(T, device=dev) // ratio,
                                 rotate=d == 128, return_rows=True, impl=impl)
            torch.cuda.synchronize()
            runs.append((rows, state, time.time() - t0))
        (a, sa, dt), (b, sb, _) = runs
        fin = ~torch.isnan(b)
        ok = torch.equal(torch.isnan(a), torch.isnan(b)) and torch.allclose(a[fin], b[fin], rtol=1e-4, atol=1e-4) \
            and torch.equal(sa, sb)
        bad += not ok
        print(f"{'compress r=' + str(ratio) + ' d=' + str(d):22s} {'ok' if ok else 'FAIL'} ({dt:.1f} s)", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
