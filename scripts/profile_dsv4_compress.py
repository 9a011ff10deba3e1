"""Per-kernel GPU time of one compressor call (the bench's cases), from torch.profiler: which launch a decode step
spends its time in.   python scripts/profile_dsv4_compress.py"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from musa_attn_backend.kernels import dsv4  # noqa: E402
from musa_attn_backend.kernels.dsv4 import layout as L  # noqa: E402
from musa_attn_backend.testing.dsv4_compress import call_args, make_case  # noqa: E402

for ratio, d, layout, rotate, scale in [(4, L.D, "paged", False, "pow2"), (128, L.D, "paged", False, "pow2"),
                                        (128, L.D, "ring", False, "pow2")]:
    for mode, B in (("decode", 1), ("decode", 128), ("prefill", 1)):
        schedules = [[4096]] * B if mode == "prefill" else [[1023, 1]] * B
        case = make_case(ratio, d, layout, schedules, "cuda", seed=ratio + d)
        calls = call_args(case, rotate, scale)
        kw = next(calls)
        if mode == "decode":
            dsv4.compress(**kw, impl="tilelang")
            kw = next(calls)
        for _ in range(3):
            dsv4.compress(**kw, impl="tilelang")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                dsv4.compress(**kw, impl="tilelang")
            torch.cuda.synchronize()
        print(f"== ratio {ratio} d {d} {layout} {mode} B {B}")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            print(f"  {e.device_time_total / 10:9.1f} us/call  x{e.count // 10:<3d} {e.key[:90]}")
