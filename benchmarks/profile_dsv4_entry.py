"""Where the host time of one eager V4 decode call goes (issue 38): our ``flash_mla_with_kvcache`` through
TileLang's launches and through the compiled launch (``SCHED_COMPILED_LAUNCH``), beside FlashMLA's call on the same
inputs. Per call: host microseconds (the loop's time with the GPU far from full: a sync every 20 calls) and the
cProfile table of our call, written to ``--out``. GPU only; prints one line per form.

    python benchmarks/profile_dsv4_entry.py --config flash --tokens 1 --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_dsv4_attention import CONFIGS, caches, flashmla_decode, flashmla_peer, inputs  # noqa: E402

from musa_attn_backend.kernels import dsv4  # noqa: E402


def host_us(fn, calls: int = 2000) -> float:
    """Host microseconds a call, the GPU kept from becoming the bottleneck (a sync every 20 calls)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    spent = 0.0
    for i in range(0, calls, 20):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        spent += time.perf_counter() - t0
        torch.cuda.synchronize()
    return spent / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash", choices=sorted(CONFIGS))
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args(argv)
    from musa_attn_backend import _ffi_launch
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    _ffi_launch.load()
    H, K = CONFIGS[args.config]
    B, s_q = args.tokens, 1
    swa, c4 = caches(65536)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, i1, i2, sink = inputs(B, H, K, swa, c4, g)
    meta = dsv4.get_mla_metadata()[0]

    def ours():
        dsv4.flash_mla_with_kvcache(q.view(B, s_q, H, 512), swa.unsqueeze(2), None, None, 512, meta,
                                    indices=i1.view(B, s_q, 128), attn_sink=sink, extra_k_cache=c4.unsqueeze(2),
                                    extra_indices_in_kvcache=i2.view(B, s_q, K))

    ours()
    rows = {}
    for form, compiled in (("tilelang", False), ("compiled", True)):
        tilelang_impl.SCHED_COMPILED_LAUNCH = compiled
        ours()
        ours()
        rows[form] = host_us(ours)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            ours()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
        (Path(args.out) / f"profile-{args.config}-T{B}-{form}.txt").write_text(text.getvalue())
    errors: dict = {}
    fm = flashmla_peer(errors)
    if fm is not None:
        out4 = torch.empty(B, s_q, H, 512, device="cuda", dtype=torch.bfloat16)
        rows["flashmla"] = host_us(flashmla_decode(fm, q.view(B, s_q, H, 512), swa, i1.view(B, s_q, 128), c4,
                                                   i2.view(B, s_q, K), sink, out4))
    else:
        print("flashmla:", errors)
    print(f"host us a call, {args.config} T {B}: " + "  ".join(f"{k} {v:.1f}" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
