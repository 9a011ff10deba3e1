"""One DeepSeek-V4 sparse MQA launch per program and mode against the reference, on the GPU: a quick check (run
under `timeout`) before the full GPU tests, which would hang on a deadlocked program."""

import sys
import time

import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.kernels.dsv4 import tilelang_impl as ti


def main() -> int:
    dev = "cuda"
    swa = L.new_kv_cache(8, 256, dev)
    c4 = L.new_kv_cache(40, 64, dev)
    for c in (swa, c4):
        n = c.shape[0] * c.shape[1]
        dsv4.write_kv_v4(torch.randn(n, 512, device=dev).to(torch.bfloat16), c, torch.arange(n, device=dev))
    bad = 0
    for program, producer in (("warp_specialized", "rows"), ("warp_specialized", "async"), ("portable", "rows")):
        ti.WS_PRODUCER = producer
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
            print(f"{program:16s} {producer:5s} T={T:4d} H={H:3d} max|out-ref| {err:.2e} max|lse-ref| {lerr:.2e} "
                  f"{'ok' if ok else 'FAIL'} ({time.time() - t0:.1f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
