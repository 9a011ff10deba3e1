"""The host cost of one TileLang kernel launch by execution backend (issue 38: an eager V4 decode call is two
launches plus glue, and FlashMLA's whole eager call is the bar: docs/dsv4.md): do-nothing kernels of 1 to 27
tensor arguments (the scheduled V4 program takes 29 tensors and scalars) compiled for each backend TileLang offers
here, then timed over N eager calls (host time per call, the GPU idle), for tvm_ffi also its compiled entry called
without TileLang's Python wrapper; a ``torch.empty`` and a torch kernel launch beside, for scale. The slope over the
argument count says what packing the plan's arrays into fewer tensors would save.

    python scripts/launch_overhead.py [--calls 3000] [--tensors 1,8,16,27] [--backends tvm_ffi,nvrtc,cython] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tiny_program(n_tensors: int):
    """A do-nothing program of ``n_tensors`` int32 vectors and two float scalars (TileLang parses a program from its
    source file, so the generated text is written to one and imported)."""
    import importlib.util
    import tempfile

    args = ", ".join(f"a{i}: T.Tensor((N,), 'int32')" for i in range(n_tensors))
    src = f"""import tilelang.language as T
N = T.dynamic("n")


@T.prim_func
def main({args}, s0: T.float32, s1: T.float32):
    with T.Kernel(1, threads=32) as bx:
        a{n_tensors - 1}[0] = a0[0]
"""
    path = Path(tempfile.mkdtemp()) / "tiny_launch_program.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tiny_launch_program", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def per_call_us(fn, calls: int) -> float:
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--tensors", default="1,8,16,27", help="argument counts to time, comma-separated")
    ap.add_argument("--backends", default="tvm_ffi,nvrtc,cython")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tilelang
    import torch

    rows = {}
    counts = [int(n) for n in args.tensors.split(",")]
    for n in counts:
        bufs = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(n)]
        func = tiny_program(n)
        for backend in args.backends.split(","):
            try:
                k = tilelang.compile(func, target="cuda", execution_backend=backend)
                k(*bufs, 1.0, 2.0)
                rows[f"{backend}/{n}"] = round(per_call_us(lambda: k(*bufs, 1.0, 2.0), args.calls), 2)
                if backend == "tvm_ffi":  # the compiled module's entry itself, without TileLang's Python wrapper
                    exe = k.adapter._get_executable()
                    rows[f"{backend}_executable/{n}"] = round(per_call_us(lambda: exe(*bufs, 1.0, 2.0), args.calls), 2)
            except Exception as e:  # noqa: BLE001 - a backend missing here is recorded, not fatal
                rows[f"{backend}/{n}"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(backend, n, {k_: v for k_, v in rows.items() if k_.endswith(f"/{n}")}, flush=True)
    bufs = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(2)]
    empty = torch.empty(0, device="cuda")
    rows["torch.empty"] = round(per_call_us(lambda: torch.empty(64, 512, device="cuda"), args.calls), 2)
    rows["torch_add_launch"] = round(per_call_us(lambda: torch.add(bufs[0], 1, out=bufs[1]), args.calls), 2)
    del empty
    res = {"op": "launch_overhead_us", "tensors": counts, "device": torch.cuda.get_device_name(),
           "tilelang": tilelang.__version__, "torch": torch.__version__, "rows": rows}
    print(json.dumps(res))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "launch_overhead.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
