"""Which paired-program launches finish: each case in its own process under a timeout (a hang kills only it)."""
import subprocess
import sys

CASES = [(1, 64, None), (1, 64, 64), (1, 64, 128), (4, 64, 512), (1, 128, 128)]

if len(sys.argv) > 1:
    import torch
    sys.path.insert(0, "benchmarks")
    from bench_dsv4_attention import caches, inputs
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
    T, H, K = (int(x) for x in sys.argv[1:4])
    g = torch.Generator(device="cuda").manual_seed(0)
    swa, c4 = caches(4096)
    q, i1, i2, sink = inputs(T, H, max(K, 1), swa, c4, g)
    kw = dict(extra_cache=c4, extra_indices=i2) if K else {}
    out = ti.sparse_mqa_tilelang(q, swa, i1, sink=sink, program=sys.argv[4], **kw)
    torch.cuda.synchronize()
    ref = ti.sparse_mqa_tilelang(q, swa, i1, sink=sink, program="scheduled", **kw)
    print("finished", sys.argv[1:], "max diff vs scheduled", float((out.float() - ref.float()).abs().max()), flush=True)
else:
    for T, H, K in CASES:
        for prog in ("paired",):
            try:
                r = subprocess.run([sys.executable, __file__, str(T), str(H), str(K or 0), prog], capture_output=True,
                                   text=True, timeout=120 if (T, H, K) == CASES[0] else 45)
                print(T, H, K, prog, "rc", r.returncode, (r.stdout + r.stderr).strip().splitlines()[-3:], flush=True)
            except subprocess.TimeoutExpired:
                print(T, H, K, prog, "HANG (timeout)", flush=True)
