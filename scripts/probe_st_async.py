"""Probe of the building block issue 37's next design needs (docs/dsv4.md, "Sharing the dequantisation at 128
heads"): a per-thread 16-byte store into the shared memory of the other CTA of a cluster of two, completing bytes
on that CTA's mbarrier (PTX ``st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32``), which TileLang has
no operation for. The store is the package's own (``rows.send16``: a device function of
``kernels/dsv4/sparse/cluster_store.cuh``, which the kernel's compile force-includes, called with ``T.call_extern``;
what the clustered scheduled program calls); the kernel is a two-CTA exchange: each CTA's 128 threads store their
four words of ``A[cta]`` into the peer's stage, each CTA waits on its own barrier (armed for the 2,048 bytes the
peer sends) and copies its stage to ``B[cta]``, so ``B[c] == A[1 - c]``.

    python scripts/probe_st_async.py            # compile for sm_90a (CPU machine: nvcc only) and print the source
    python scripts/probe_st_async.py --run      # on a Hopper GPU: run it and check the exchange

CUDA only (MUSA MP31 has no clusters).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

THREADS = 128


def build():
    import tilelang.language as T

    from musa_attn_backend.kernels.dsv4.sparse.rows import send16

    @T.prim_func
    def exchange(A: T.Tensor((2, THREADS, 4), "uint32"), B: T.Tensor((2, THREADS, 4), "uint32")):
        with T.ClusterKernel(2, cluster_dims=(2, 1, 1), threads=THREADS) as bx:
            S = T.alloc_shared((THREADS, 4), "uint32")
            bar = T.alloc_barrier(1)
            tx = T.get_thread_binding()
            T.cluster_sync()  # both barriers exist before either CTA stores into the other
            if tx == 0:
                T.mbarrier_arrive_expect_tx(bar[0], THREADS * 16)
            send16(S[tx, 0], 1 - T.block_rank_in_cluster(), A[bx, tx, 0], A[bx, tx, 1], A[bx, tx, 2], A[bx, tx, 3],
                   bar[0])
            T.mbarrier_wait_parity(bar[0], 0)
            for j in T.serial(4):
                B[bx, tx, j] = S[tx, j]
            T.cluster_sync()  # neither CTA exits while the other may still store into it

    return exchange


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true")
    args = ap.parse_args(argv)
    import tilelang as tl

    from musa_attn_backend.kernels.dsv4.sparse.rows import CLUSTER_STORE_HEADER

    kernel = tl.compile(build(), target={"kind": "cuda", "arch": "sm_90a"},
                        compile_flags=["-include", str(CLUSTER_STORE_HEADER)])
    if not args.run:
        print(kernel.get_kernel_source())
        return 0
    import torch

    a = torch.randint(0, 2**31 - 1, (2, THREADS, 4), dtype=torch.int64, device="cuda").to(torch.uint32)
    b = torch.zeros_like(a)
    kernel(a, b)
    torch.cuda.synchronize()
    ok = torch.equal(b[0].to(torch.int64), a[1].to(torch.int64)) and torch.equal(b[1].to(torch.int64),
                                                                                  a[0].to(torch.int64))
    print("exchange", "ok" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
