"""The host time of one eager V4 decode call through FlashMLA's entry (``flash_mla_with_kvcache``), measured on
this CPU machine with the kernels stubbed (issue 38, item 3): CPU tensors, the TileLang path forced, every
``compile_cached`` answered with a launch that does nothing, so what is timed is the glue an engine's layer pays
besides its two launches. Prints the mean over the calls of a batch's later layers (one metadata object, FlashMLA's
pattern), the first call's, and the functions that took the time (cProfile).

    python scripts/host_path.py [--batch 1] [--heads 64] [--calls 400] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--topk", type=int, default=512, help="the extra (compressed) set's index entries")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    import torch

    from musa_attn_backend import _tilelang, config
    from musa_attn_backend.kernels import dsv4
    from musa_attn_backend.kernels.dsv4 import layout as L
    from musa_attn_backend.kernels.dsv4.sparse import flash_mla

    flash_mla.resolve_impl = lambda impl, device, op: "tilelang"  # CPU tensors through the TileLang glue
    b, h, k2 = args.batch, args.heads, args.topk
    swa, c4 = L.new_kv_cache(4, 256, "cpu"), L.new_kv_cache(64, 64, "cpu")
    q = torch.randn(b, 1, h, 512).to(torch.bfloat16)
    i1 = torch.randint(0, 4 * 256, (b, 1, 128), dtype=torch.int32)
    i2 = torch.randint(0, 64 * 64, (b, 1, k2), dtype=torch.int32)
    sink = torch.randn(h)

    def call(meta):
        return dsv4.flash_mla_with_kvcache(q, swa.unsqueeze(2), None, None, 512, meta, indices=i1, attn_sink=sink,
                                           extra_k_cache=c4.unsqueeze(2), extra_indices_in_kvcache=i2)

    with config.override(target="sm_90a", dsv4_program="scheduled"), \
            _tilelang.intercepting(lambda key, build, target, pc: (lambda *a: None)):
        meta = dsv4.get_mla_metadata()[0]
        t0 = time.perf_counter()
        call(meta)
        first = time.perf_counter() - t0
        for _ in range(20):
            call(meta)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call(meta)
        later = (time.perf_counter() - t0) / args.calls
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call(meta)
        prof.disable()
    print(f"batch {b}, {h} heads: first call {first * 1e6:.0f} us, later calls {later * 1e6:.1f} us each "
          f"(kernels stubbed; CPU tensors)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
