"""Device debugging of the MoE ops (not a test): host syncs of fused_experts, and the contiguous mismatch."""
import sys, traceback, warnings
import torch
sys.path.insert(0, "tests/moe")
from musa_attn_backend.kernels import moe
from test_gpu_moe import weights, routing

dev = torch.device("cuda")
# 1. every synchronising op of the contiguous fused_experts, with its stack
E, H, I, k, T = 16, 512, 256, 6, 200
w13, s13 = weights(E, 2 * I, H, dev, seed=6)
w2, s2 = weights(E, H, I, dev, seed=7)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
ids = torch.rand(T, E).topk(k, 1).indices.to(torch.int32).to(dev)
w = torch.rand(T, k).to(dev)
run = lambda: moe.fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, swiglu_limit=10.0, layout="contiguous", impl="tilelang")
run(); torch.cuda.synchronize()
def show(msg, *a, **kw):
    print("SYNC:", msg); traceback.print_stack(limit=8)
warnings.showwarning = show
torch.cuda.set_sync_debug_mode("warn")
run()
torch.cuda.set_sync_debug_mode("default")
# 2. the contiguous mismatch, repeated
N, K = 256, 384
E, T = 64, 16384
b, sb = weights(E, N, K, dev)
row_src, layout = moe.align_routing(routing(T, k, E, False, dev), E)
x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
a, sa = moe.quantize_groups(x[(row_src.clamp(min=0) // k).long()])
ref = moe.grouped_gemm_contiguous_reference(a, sa, b, sb, layout)
rows = layout >= 0
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    out = torch.full((layout.numel(), N), float("nan"), device=dev, dtype=torch.bfloat16)
    moe.grouped_gemm_fp8(a, sa, b, sb, layout, out, impl="tilelang")
    o, r = out.float(), ref.float()
    bound = 2 ** -6 * r.abs() + 2 ** -12 * r[rows].abs().max()
    bad = ((o - r).abs() > bound) & rows[:, None]
    nan_bad = torch.isnan(o[rows]).sum().item()
    print(f"rep {rep}: bad {int(bad.sum())} nan-in-written {nan_bad} maxref {float(r[rows].abs().max()):.2f}")
    for i, j in bad.nonzero().tolist()[:8]:
        print(f"  row {i} col {j} (tile {i // 128} row {i % 128}, expert {int(layout[i])}, first {int(layout[i // 128 * 128])}): out {float(o[i, j])} ref {float(r[i, j])}")
