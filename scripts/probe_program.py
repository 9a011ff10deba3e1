"""Whether a sparse MQA program new to the GPU finishes and agrees with the scheduled program: each case in its own
process under a timeout, so a hang (a barrier that never completes) kills only that process. The gate before a
program's first GPU tests (the paired program's, 2026-12-06, found its hang; the clustered 128-head form's, removed
since, passed).

    python scripts/probe_program.py paired           # every case of the paired program
    python scripts/probe_program.py paired T H K     # one case: T tokens, H heads, K compressed entries
"""
import subprocess
import sys

CASES = {"paired": [(1, 64, 0), (1, 64, 64), (1, 64, 128), (4, 64, 512), (1, 128, 128)]}

which = sys.argv[1] if len(sys.argv) > 1 else "paired"
if len(sys.argv) > 2:
    import torch

    sys.path.insert(0, "benchmarks")
    from bench_dsv4_attention import caches, inputs

    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti

    T, H, K = (int(x) for x in sys.argv[2:5])
    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(4096)
    q, i1, i2, sink = inputs(T, H, max(K, 1), swa, c4, g)
    kw = dict(extra_cache=c4, extra_indices=i2) if K else {}
    ref = ti.sparse_mqa_tilelang(q, swa, i1, sink=sink, program="scheduled", **kw)
    out = ti.sparse_mqa_tilelang(q, swa, i1, sink=sink, program=which, **kw)
    torch.cuda.synchronize()
    print("finished", sys.argv[1:], "max diff vs scheduled", float((out.float() - ref.float()).abs().max()), flush=True)
else:
    for i, (T, H, K) in enumerate(CASES[which]):
        try:
            r = subprocess.run([sys.executable, __file__, which, str(T), str(H), str(K)], capture_output=True,
                               text=True, timeout=150 if i == 0 else 60)
            print(which, T, H, K, "rc", r.returncode, (r.stdout + r.stderr).strip().splitlines()[-3:], flush=True)
        except subprocess.TimeoutExpired:
            print(which, T, H, K, "HANG (timeout)", flush=True)
