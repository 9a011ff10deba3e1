"""Device diagnosis of the contiguous MoE GEMM: where its output differs from the reference."""
import sys
import torch
sys.path.insert(0, "tests/moe")
from test_gpu_moe import weights, routing
from musa_attn_backend.kernels import moe

dev = "cuda"
for (N, K, T, E) in [(4096, 4096, 64, 256), (4096, 4096, 64, 32), (6144, 7168, 300, 32), (4096, 4096, 64, 128),
                     (256, 384, 64, 256)]:
    b, sb = weights(E, N, K, dev)
    row_src, layout = moe.align_routing(routing(T, 6, E, False, dev), E)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    a, sa = moe.quantize_groups(x[(row_src.clamp(min=0) // 6).long()])
    out = torch.full((layout.numel(), N), float("nan"), device=dev, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, b, sb, layout, out, impl="tilelang")
    ref = moe.grouped_gemm_contiguous_reference(a, sa, b, sb, layout)
    rows = layout >= 0
    o, r = out.float(), ref.float()
    bad = ((o - r).abs() > 2 ** -7 * r.abs() + 2 ** -12 * r.abs().max()) | ~torch.isfinite(o)
    bad &= rows.unsqueeze(1)
    br = bad.any(1).nonzero().flatten()
    print(f"N {N} K {K} T {T} E {E}: M {layout.numel()} valid rows {int(rows.sum())} bad rows {br.numel()} "
          f"bad elems {int(bad.sum())} nan {int(torch.isnan(o[rows]).sum())} unwritten-ok "
          f"{bool(torch.isnan(o[~rows]).all())}")
    if br.numel():
        t = (br // 128).unique()
        print("  bad tiles", t[:20].tolist(), "experts", layout[t * 128][:20].tolist())
        m = int(br[0])
        cols = bad[m].nonzero().flatten()
        print("  row", m, "bad cols", cols[:10].tolist(), "n", cols.numel(), "o", o[m, cols[:4]].tolist(),
              "r", r[m, cols[:4]].tolist())
    del b, sb
    torch.cuda.empty_cache()
