"""The MoE expert GEMMs (:mod:`musa_attn_backend.kernels.moe`) against the grouped GEMMs torch has, in one run.

    python benchmarks/bench_moe.py [--out benchmarks/results] [--quick] [--models flash,pro]
    python benchmarks/bench_moe.py --smoke        (CPU, tiny shapes: the harness only)
    python benchmarks/bench_moe.py --plot benchmarks/results/moe-....json   (the PNG of a run, beside it)
    python benchmarks/bench_moe.py --compile-only 12 [--tiling ...]   (compile the run's kernels, 12 processes)

Each row is one GEMM of one MoE layer's routed experts: ``gate_up`` (``N = 2 I``, ``K = H``) or ``down`` (``N = H``,
``K = I``) of V4-Flash (256 experts, H 4096, I 2048) or V4-Pro (384, 7168, 3072), for ``T`` tokens with uniform
top-6 routing (each token's six experts drawn at random). FP8 e4m3 weights with 128 x 128 block scales (random
bytes, NaN codes cleared), activations quantised 1 x 128.

Timed, each replayed from a CUDA graph (median of the replays):

- ``ours``: :func:`grouped_gemm_fp8` on the contiguous layout of the routing (segments padded to 128 rows, the
  layout sized for the worst routing of ``T x 6`` choices, as the layer op runs it with no host sync);
- ``ours_masked`` (``T <= 512``): :func:`grouped_gemm_fp8_masked` with ``max_m`` the largest expert's rows
  rounded up to 64;
- ``scaled_grouped_mm``: ``torch._scaled_grouped_mm``, row-wise FP8 scales (one per row of A and per column of B,
  not blocks: less work than ours), fast accumulation, segments padded to 16;
- ``grouped_mm_bf16``: ``torch._grouped_mm`` on bf16 copies of the same operands;
- ``dense_scaled_mm``: ``torch._scaled_mm`` (row-wise, fast accumulation) of one dense ``[T * 6, K] x [K, N]``: the
  same FLOPs without grouping, an upper reference;
- ``deepgemm``: DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` / ``_masked`` (``deep_gemm``, staged on the device
  by ``prepare.sh --peers``) on our operands as they are (its SM90 recipe is ours: 1 x 128 activation and 128 x 128
  weight scales in float32, rows aligned to 128, -1 for padding), with ``calc_diff`` (DeepGEMM's measure; its tests
  pass below 1e-3) and the largest difference to our output over the real rows; ``deepgemm_masked`` beside
  ``ours_masked`` (``expected_m`` the mean rows of a routed expert);
- ``sglang_triton``: SGLang's Triton ``fused_moe_kernel`` (``invoke_fused_moe_kernel``) with 128 x 128 block FP8,
  the same weights and 1 x 128 activations, under the tile config SGLang picks for this GPU and shape
  (``try_get_optimal_moe_config``, recorded); its token alignment is computed here in torch, untimed, because
  SGLang's is a compiled op;
- ``ours_fp4`` / ``ours_fp4_masked`` (``T <= 512``): both layouts with MXFP4 weights of the same shape (random
  E2M1 bytes, UE8M0 scales), converted in the kernel under the default forms; ``ours_fp4_forms_ms`` /
  ``ours_fp4_masked_forms_ms``: each conversion form (:data:`FP4_FORMS`: ``tilelang_impl``'s ``packing``, to bf16
  from ``bytes`` or ``words``, or ``fp8``, to e4m3 for FP8 tensor cores, with 1, 2 or 4 spans of 32 values a K
  step); above 512 tokens ``ours_fp4_forms_ms`` alone, without ``bytes`` (the contiguous ``auto`` rule's choice);
- ``ours_gemm_swiglu`` (gate_up rows): :func:`grouped_gemm_swiglu_fp8`, GEMM1 with the SwiGLU and GEMM2's
  quantisation in its epilogue, against ``ours`` plus ``ours_swiglu_quant`` (:func:`swiglu_quant` over the chosen
  rows of ``ours``' output), the two steps it replaces.

``moe_layer`` rows time the whole routed-expert op, :func:`fused_experts` (routing, quantisation, both GEMMs,
V4's clamped SwiGLU, the weighted sum; FP8 and FP4 weights), against the same layer composed from SGLang's Triton
GEMMs (its kernel twice, torch for the SwiGLU, the quantisation and the sum); ``ours_paths_ms`` times the FP8 layer
under each of ``layer.SWIGLU_PATHS`` (torch ops, one ``swiglu_quant`` pass, the epilogue-fused GEMM1), and
``ours_glue_ms`` with its glue (the quantise-and-scatter, the weighted sum) as TileLang programs and as torch ops
(``layer.GLUE_KERNELS``); at masked sizes ``ours_route_ms`` with the routing in one launch and as torch ops
(``layer.ROUTE_KERNEL``).

The roofline of a row is the larger of its FLOPs at the run's dense FP8 matmul rate (``torch._scaled_mm`` at 8192^3)
and its bytes (the weights of the experts the routing touches, A and D) at the run's copy rate.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_attention import bench_ms, git_commit, measure_ceilings, package_versions  # noqa: E402
from musa_attn_backend.kernels import moe  # noqa: E402
from musa_attn_backend.testing.numeric import calc_diff  # noqa: E402

MODELS = {"flash": dict(E=256, H=4096, I=2048), "pro": dict(E=384, H=7168, I=3072)}
TOPK = 6


def random_fp8_weights(E, N, K, device, seed=0):
    """Random e4m3 bytes (NaN codes cleared) and block scales: what the GEMMs read, without a float copy."""
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device=device, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0
    b = raw.view(torch.float8_e4m3fn)
    sb = torch.rand(E, N // 128, K // 128, device=device, generator=g) * 1e-3 + 1e-4
    return b, sb


def fp8_rate(device) -> float:
    """Dense FP8 matmul TFLOP/s (``torch._scaled_mm``, row-wise scales, fast accumulation) at 8192^3."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).T
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    ms = bench_ms(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True))
    return 2 * n ** 3 / ms / 1e9


def random_fp4_weights(E, N, K, device, seed=0):
    """Random packed E2M1 bytes and UE8M0 scale bytes around 2^-7."""
    g = torch.Generator(device=device).manual_seed(seed)
    b = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=device, generator=g)
    sb = torch.randint(116, 124, (E, N, K // 32), dtype=torch.uint8, device=device, generator=g)
    return b, sb


def triton_alignment(ids: torch.Tensor, num_experts: int, block_m: int):
    """What SGLang's ``moe_align_block_size`` gives its Triton kernel, in torch (host syncs; untimed):
    ``sorted_token_ids`` (each expert's choices, ``ids``' flat positions, padded to ``block_m`` with ``ids.numel()``),
    ``expert_ids`` (one per block) and ``num_tokens_post_padded``."""
    flat = ids.flatten().long()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    order = torch.argsort(flat, stable=True)
    e = flat[order]
    rank = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[e]
    sorted_ids = torch.full((total,), flat.numel(), dtype=torch.int32, device=ids.device)
    sorted_ids[((torch.cumsum(padded, 0) - padded)[e] + rank)] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=ids.device, dtype=torch.int32),
                                         padded // block_m)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=ids.device)


def sglang_config(w1_shape, w2_shape, top_k: int, T: int) -> dict:
    """SGLang's Triton MoE config for block-FP8 weights at ``T`` tokens (its tuned tables, else its default). The
    lookup reads the deterministic-inference flag from the runtime context a server publishes; in a bare process
    none is published, so the lookup sees the server's default (off) instead of raising."""
    from types import SimpleNamespace
    from unittest import mock

    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as cfg

    exec_default = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    published = runtime_context.get_context().is_config_namespace_published("exec")
    with mock.patch.object(cfg, "get_exec", cfg.get_exec if published else (lambda: exec_default)):
        config = cfg.try_get_optimal_moe_config(w1_shape, w2_shape, top_k, "fp8_w8a8", T, block_shape=[128, 128])
    return dict(config[0] if isinstance(config, tuple) else config)


def sglang_triton(model_shape, ids, a_tok, sa_tok, b, sb, out, topk_weights=None, per_choice=False):
    """SGLang's Triton block-FP8 MoE GEMM of token rows ``a_tok [T, K]`` (each gathered once per choice; with
    ``per_choice`` the rows are already ``[T * k, K]``, as SGLang runs its down GEMM) into ``out [T * k, N]``, times
    ``topk_weights`` when given: ``(fn, config)``."""
    import triton.language as tl
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel

    E, H, I = model_shape
    T, k = ids.shape
    config = sglang_config((E, 2 * I, H), (E, H, I), k, T)
    sorted_ids, expert_ids, post = triton_alignment(ids, E, config["BLOCK_SIZE_M"])
    w = topk_weights if topk_weights is not None else torch.ones(T, k, device=ids.device)

    def fn():
        invoke_fused_moe_kernel(a_tok, b, None, out, sa_tok, sb, None, w, ids, sorted_ids, expert_ids, post,
                                topk_weights is not None, 1 if per_choice else k, config, compute_type=tl.bfloat16, use_fp8_w8a8=True,
                                use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                                per_channel_quant=False, block_shape=[128, 128])
    return fn, dict(config)


def peers(a_rows, counts, b, N, K, device):
    """The peers' callables on the same routing: ``{name: fn}`` (a peer that cannot be set up is left out, its
    error recorded by the caller)."""
    E = b.shape[0]
    out = {}
    padded = (counts + 15) // 16 * 16
    offs = torch.cumsum(padded, 0).to(torch.int32)
    Mp = int(offs[-1])
    a16 = torch.zeros(max(Mp, 16), K, device=device, dtype=torch.float8_e4m3fn)
    sa16 = torch.ones(max(Mp, 16), device=device)
    bt = b.transpose(-2, -1)
    sbr = torch.ones(E, N, device=device)
    out["scaled_grouped_mm"] = lambda: torch._scaled_grouped_mm(a16, bt, sa16, sbr, offs=offs,
                                                                out_dtype=torch.bfloat16, use_fast_accum=True)
    abf = a16.to(torch.bfloat16)
    bbf = b.to(torch.bfloat16).transpose(-2, -1)
    out["grouped_mm_bf16"] = lambda: torch._grouped_mm(abf, bbf, offs=offs, out_dtype=torch.bfloat16)
    M = max(a_rows, 16)
    ad = torch.zeros(M, K, device=device, dtype=torch.float8_e4m3fn)
    bd = b[0].T  # [K, N] column-major
    out["dense_scaled_mm"] = lambda: torch._scaled_mm(ad, bd, torch.ones(M, 1, device=device),
                                                      torch.ones(1, N, device=device), out_dtype=torch.bfloat16,
                                                      use_fast_accum=True)
    return out, (abf, bbf)


def deepgemm(row: dict, name: str, fn, ours, theirs, real, time) -> None:
    """Time DeepGEMM's ``fn`` (writing ``theirs``) into ``row["peers"][name]`` with its agreement with ``ours`` over
    the rows ``real`` selects; a failure is recorded instead."""
    try:
        fn()
        if theirs.is_cuda:
            torch.cuda.synchronize()
        a, b = ours[real].float(), theirs[real].float()
        row["peers"][name] = {"ms": time(fn), "calc_diff": calc_diff(a, b),
                              "max_abs_diff": float((a - b).abs().max()) if a.numel() else 0.0}
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        row["peers"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}


def deepgemm_peers(row: dict, a, sa, b, sb, layout, masked, T: int, E: int, time) -> None:
    """DeepGEMM's contiguous grouped GEMM (and, with ``masked = (a, sa, masked_m, out)``, its masked one) on our FP8
    operands, each checked against our FP8 GEMM's output computed here again: the timed runs before this one wrote
    the FP4 programs' results into the same output buffers, so those buffers are not our FP8 answer."""
    try:
        import deep_gemm
    except ImportError as e:
        row["peers"]["deepgemm"] = {"error": f"ImportError: {e}"[:300]}
        return
    ours = moe.grouped_gemm_fp8(a, sa, b, sb, layout, torch.empty(layout.numel(), b.shape[1], device=a.device,
                                                                      dtype=torch.bfloat16))
    theirs = torch.empty_like(ours)
    deepgemm(row, "deepgemm", lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), theirs, layout),
             ours, theirs, layout >= 0, time)
    if masked is None:
        return
    am, sam, mm, om = masked
    ours_m = moe.grouped_gemm_fp8_masked(am, sam, b, sb, mm, torch.empty_like(om))
    theirs_m = torch.empty_like(om)
    expected = max(1, (T * TOPK + E - 1) // E)  # DeepGEMM's hint: the mean rows of a routed expert
    real = torch.arange(om.shape[1], device=om.device)[None, :] < mm[:, None]
    deepgemm(row, "deepgemm_masked", lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked((am, sam), (b, sb), theirs_m,
                                                                                   mm, expected),
             ours_m, theirs_m, real, time)


def rate_and_ratio(row: dict, flops: int, nbytes: int, ceilings: dict) -> None:
    """A timed row's roofline (the larger of its FLOPs at the run's FP8 matmul rate and its bytes at the copy
    rate), its fraction, ours in TFLOP/s, and the best peer with ``ratio_vs_best_peer`` (the peer's time over
    ours; ``dense_scaled_mm``, the ungrouped upper reference, is not a peer for that, nor DeepGEMM's masked GEMM,
    which ``masked_ratio_vs_deepgemm`` sets against ours masked)."""
    roof = max(flops / (ceilings["fp8_matmul_tflops"] * 1e9), nbytes / (ceilings["copy_tbps"] * 1e9))
    row["roofline_ms"], row["roofline_fraction"] = roof, roof / row["ours_ms"]
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9
    timed = {k: v["ms"] for k, v in row["peers"].items() if isinstance(v, dict) and "ms" in v
             and k not in ("dense_scaled_mm", "deepgemm_masked")}
    dgm = row["peers"].get("deepgemm_masked", {})
    if "ms" in dgm and row.get("ours_masked_ms"):  # the masked layout against DeepGEMM's masked GEMM
        row["masked_ratio_vs_deepgemm"] = dgm["ms"] / row["ours_masked_ms"]
    if timed:
        best = min(timed, key=timed.get)
        row["best_peer"], row["ratio_vs_best_peer"] = best, timed[best] / row["ours_ms"]


def measure(model: str, gemm: str, T: int, ceilings: dict, device: str, smoke: bool) -> dict:
    cfg = MODELS[model] if not smoke else dict(E=8, H=256, I=128)
    E, H, I = cfg["E"], cfg["H"], cfg["I"]
    N, K = (2 * I, H) if gemm == "gate_up" else (H, I)
    b, sb = random_fp8_weights(E, N, K, device)
    g = torch.Generator().manual_seed(T)
    ids = torch.rand(T, E, generator=g).topk(TOPK, dim=1).indices.to(torch.int32).to(device)
    row_src, layout = moe.align_routing(ids, E)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    a, sa = moe.quantize_groups(x[(row_src.clamp(min=0) // TOPK).long()])
    out = torch.empty(layout.numel(), N, device=device, dtype=torch.bfloat16)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    touched = int((counts > 0).sum())
    flops = 2 * T * TOPK * N * K
    nbytes = touched * N * K + T * TOPK * (K + 2 * N)
    row = {"op": f"moe_{gemm}", "shape": {"model": model, "T": T, "topk": TOPK, "E": E, "N": N, "K": K,
                                          "rows": T * TOPK, "layout_rows": layout.numel(),
                                          "experts_touched": touched},
           "flops": flops, "bytes": nbytes}
    time = (lambda fn: bench_ms(fn, rep=20)) if device == "cuda" else (lambda fn: (fn(), 0.0)[1])
    masked = None  # the masked layout's operands (T <= 512), for DeepGEMM's masked GEMM beside ours

    row["ours_ms"] = time(lambda: moe.grouped_gemm_fp8(a, sa, b, sb, layout, out))
    if T <= 512:
        max_m = max(64, (int(counts.max()) + 63) // 64 * 64)
        am, sam = moe.quantize_groups(torch.randn(E, max_m, K, device=device, dtype=torch.bfloat16))
        om = torch.empty(E, max_m, N, device=device, dtype=torch.bfloat16)
        mm = counts.to(torch.int32)
        row["ours_masked_ms"] = time(lambda: moe.grouped_gemm_fp8_masked(am, sam, b, sb, mm, om))
        row["shape"]["max_m"] = max_m
        masked = (am, sam, mm, om)
        b4, sb4 = random_fp4_weights(E, N, K, device)
        row["ours_fp4_ms"] = time(lambda: moe.grouped_gemm_fp8(a, sa, b4, sb4, layout, out))
        row["ours_fp4_masked_ms"] = time(lambda: moe.grouped_gemm_fp8_masked(am, sam, b4, sb4, mm, om))
        row["ours_fp4_masked_forms_ms"] = fp4_forms(FP4_FORMS, time, lambda: moe.grouped_gemm_fp8_masked(
            am, sam, b4, sb4, mm, om))
        row["ours_fp4_forms_ms"] = fp4_forms(FP4_FORMS, time, lambda: moe.grouped_gemm_fp8(
            a, sa, b4, sb4, layout, out))
        del b4, sb4
    else:  # prefill sizes: the contiguous FP4 programs that the ``auto`` packing chooses between
        b4, sb4 = random_fp4_weights(E, N, K, device)
        row["ours_fp4_forms_ms"] = fp4_forms([f for f in FP4_FORMS if f[1] != "bytes"], time,
                                             lambda: moe.grouped_gemm_fp8(a, sa, b4, sb4, layout, out))
        del b4, sb4
    if gemm == "gate_up":  # the epilogue-fused GEMM1, and the SwiGLU + quantisation pass it replaces
        try:
            qs = (torch.empty(layout.numel(), N // 2, device=device, dtype=torch.float8_e4m3fn),
                  torch.empty(layout.numel(), N // 256, device=device))
            row["ours_gemm_swiglu_ms"] = time(lambda: moe.grouped_gemm_swiglu_fp8(a, sa, b, sb, layout, 10.0, qs))
            chosen = torch.nonzero(layout >= 0).flatten().to(torch.int32)
            row["ours_swiglu_quant_ms"] = time(lambda: moe.swiglu_quant(out, chosen, 10.0, qs))
            del qs
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["fused_error"] = f"{type(e).__name__}: {e}"[:300]
    row["peers"] = {}
    if device == "cuda":
        try:
            fns, keep = peers(T * TOPK, counts, b, N, K, device)
            for name, fn in fns.items():
                try:
                    row["peers"][name] = {"ms": time(fn)}
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    row["peers"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            del keep, fns
        except Exception as e:  # noqa: BLE001
            row["peers"]["setup_error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            a_tok, sa_tok = moe.quantize_groups(x)
            out_t = torch.empty(T * TOPK, N, device=device, dtype=torch.bfloat16)
            fn, config = sglang_triton((E, H, I), ids, a_tok, sa_tok, b, sb, out_t)
            row["peers"]["sglang_triton"] = {"ms": time(fn), "config": config}
            del out_t
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["peers"]["sglang_triton"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        deepgemm_peers(row, a, sa, b, sb, layout, masked, T, E, time)
        rate_and_ratio(row, flops, nbytes, ceilings)
    del b, sb, a, sa, out, masked
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def measure_layer(model: str, T: int, ceilings: dict, device: str, smoke: bool) -> dict:
    """One MoE layer's routed experts: :func:`fused_experts` with FP8 and with FP4 weights, and the same layer
    from SGLang's Triton GEMMs."""
    from musa_attn_backend.kernels.moe import layer

    cfg = MODELS[model] if not smoke else dict(E=8, H=256, I=128)
    E, H, I = cfg["E"], cfg["H"], cfg["I"]
    w13, s13 = random_fp8_weights(E, 2 * I, H, device, seed=1)
    w2, s2 = random_fp8_weights(E, H, I, device, seed=2)
    g = torch.Generator().manual_seed(T)
    ids = torch.rand(T, E, generator=g).topk(TOPK, dim=1).indices.to(torch.int32).to(device)
    w = torch.rand(T, TOPK, generator=g).to(device)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    out = torch.empty(T, H, device=device, dtype=torch.bfloat16)
    flops = 2 * T * TOPK * 3 * I * H
    touched = int((torch.bincount(ids.flatten().long(), minlength=E) > 0).sum())
    row = {"op": "moe_layer", "shape": {"model": model, "T": T, "topk": TOPK, "E": E, "H": H, "I": I,
                                        "experts_touched": touched},
           "flops": flops, "bytes": touched * 3 * I * H + 4 * T * H}
    time = (lambda fn: bench_ms(fn, rep=20)) if device == "cuda" else (lambda fn: (fn(), 0.0)[1])
    run = lambda a, sa, b, sb: moe.fused_experts(x, a, b, w, ids, w13_scale=sa, w2_scale=sb,  # noqa: E731
                                                  swiglu_limit=10.0, out=out)
    row["ours_ms"] = time(lambda: run(w13, s13, w2, s2))
    row["ours_paths_ms"] = {}  # FP8 under each between-GEMM path (layer.SWIGLU_PATH; ours_ms: the default)
    default = layer.SWIGLU_PATH
    try:
        for path in layer.SWIGLU_PATHS:
            layer.SWIGLU_PATH = path
            row["ours_paths_ms"][path] = time(lambda: run(w13, s13, w2, s2))
    finally:
        layer.SWIGLU_PATH = default
    glue, row["ours_glue_ms"] = layer.GLUE_KERNELS, {}
    try:  # the glue as TileLang programs and as torch ops
        for name, on in (("kernels", True), ("torch", False)):
            layer.GLUE_KERNELS = on
            row["ours_glue_ms"][name] = time(lambda: run(w13, s13, w2, s2))
    finally:
        layer.GLUE_KERNELS = glue
    route, row["ours_route_ms"] = layer.ROUTE_KERNEL, {}
    if T <= layer.MASKED_MAX_TOKENS:  # the masked layout's routing in one launch and as torch ops
        try:
            for name, on in (("kernel", True), ("torch", False)):
                layer.ROUTE_KERNEL = on
                row["ours_route_ms"][name] = time(lambda: run(w13, s13, w2, s2))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["ours_route_ms"]["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            layer.ROUTE_KERNEL = route
    w13f, s13f = random_fp4_weights(E, 2 * I, H, device, seed=1)
    w2f, s2f = random_fp4_weights(E, H, I, device, seed=2)
    row["ours_fp4_ms"] = time(lambda: run(w13f, s13f, w2f, s2f))
    del w13f, s13f, w2f, s2f
    row["peers"] = {}
    if device == "cuda":
        try:
            a1, sa1 = moe.quantize_groups(x)
            h1 = torch.empty(T * TOPK, 2 * I, device=device, dtype=torch.bfloat16)
            a2 = torch.empty(T * TOPK, I, device=device, dtype=torch.float8_e4m3fn)
            sa2 = torch.empty(T * TOPK, I // 128, device=device)
            h2 = torch.empty(T * TOPK, H, device=device, dtype=torch.bfloat16)
            gemm1, config = sglang_triton((E, H, I), ids, a1, sa1, w13, s13, h1)
            gemm2, _ = sglang_triton((E, H, I), ids, a2, sa2, w2, s2, h2, topk_weights=w, per_choice=True)

            def peer():
                q, s = moe.quantize_groups(x)
                a1.copy_(q)
                sa1.copy_(s)
                gemm1()
                q, s = moe.quantize_groups(layer.swiglu(h1, 10.0))
                a2.copy_(q)
                sa2.copy_(s)
                gemm2()
                torch.sum(h2.view(T, TOPK, H), 1, out=out)

            row["peers"]["sglang_triton"] = {"ms": time(peer), "config": config}
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["peers"]["sglang_triton"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rate_and_ratio(row, flops, row["bytes"], ceilings)
        torch.cuda.empty_cache()
    return row


def plot(rows, path) -> bool:
    """Time against tokens, one panel per model and GEMM, ours (both layouts) and the peers; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({(r["shape"]["model"], r["op"]) for r in rows if "ours_ms" in r})  # gemms and the layer
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (model, op) in zip(axes[0], panels):
        sel = sorted((r for r in rows if r["shape"]["model"] == model and r["op"] == op and "ours_ms" in r),
                     key=lambda r: r["shape"]["T"])
        T = [r["shape"]["T"] for r in sel]
        ax.plot(T, [r["ours_ms"] for r in sel], "o-", label="ours (contiguous)")
        masked = [r for r in sel if "ours_masked_ms" in r]
        ax.plot([r["shape"]["T"] for r in masked], [r["ours_masked_ms"] for r in masked], "o-", label="ours (masked)")
        fp4 = [r for r in sel if "ours_fp4_ms" in r]
        ax.plot([r["shape"]["T"] for r in fp4], [r["ours_fp4_ms"] for r in fp4], "o-", label="ours (FP4 experts)")
        for peer in ("scaled_grouped_mm", "grouped_mm_bf16", "sglang_triton"):
            have = [r for r in sel if "ms" in r["peers"].get(peer, {})]
            ax.plot([r["shape"]["T"] for r in have], [r["peers"][peer]["ms"] for r in have], "s--", label=peer)
        ax.plot(T, [r["roofline_ms"] for r in sel], ":", color="gray", label="roofline")
        ax.set(xscale="log", yscale="log", xlabel="tokens (top-6)", ylabel="ms", title=f"V4-{model} {op[4:]}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def versions() -> dict:
    return package_versions("tilelang", "deep_gemm")


# the FP4 forms each FP4 row times: (name, tilelang_impl packing, FP8-MMA spans of 32 values a K step)
FP4_FORMS = [("bytes", "bytes", 1), ("words", "words", 1), ("fp8", "fp8", 1), ("fp8_spans2", "fp8", 2),
             ("fp8_spans4", "fp8", 4)]


def fp4_forms(forms, time, fn) -> dict:
    """``{form: ms}`` of ``fn`` (an FP4 GEMM launch) under each of ``forms`` (:data:`FP4_FORMS` entries); the
    FP4 defaults are restored afterwards."""
    from musa_attn_backend.kernels.moe import tilelang_impl as ti

    dicts = (ti.CONTIGUOUS_FP4, ti.MASKED_FP4, ti.CONTIGUOUS_FP4_FP8, ti.MASKED_FP4_FP8)
    saved = [dict(d) for d in dicts]
    out = {}
    try:
        for form, packing, spans in forms:
            ti.MASKED_FP4["packing"] = ti.CONTIGUOUS_FP4["packing"] = packing
            ti.MASKED_FP4_FP8["spans"] = ti.CONTIGUOUS_FP4_FP8["spans"] = spans
            out[form] = time(fn)
    finally:
        for d, v in zip(dicts, saved):
            d.update(v)
    return out


def kernels_for(models, tiling: dict, masked_tiling: dict = None) -> list:
    """The TileLang programs a run of ``models`` compiles, as ``(tilelang_impl function, args, tiling)``: the
    contiguous FP8 GEMM under ``tiling`` (and its large-M stages, where the run keeps that rule), everything else
    under its default."""
    from musa_attn_backend.kernels.moe import tilelang_impl

    contiguous = [tiling]
    if tilelang_impl.LARGE_M_STAGES is not None:
        contiguous.append({**tiling, "num_stages": tilelang_impl.LARGE_M_STAGES[1]})
    jobs = []
    for model in models:
        E, H, I = (MODELS[model][k] for k in ("E", "H", "I"))
        for N, K in ((2 * I, H), (H, I)):
            jobs += [("contiguous_kernel", (N, K), t) for t in contiguous]
            jobs += [("masked_kernel", (N, K), dict(masked_tiling or {}))]
            jobs += [(name, (N, K), {"packing": p, **({"spans": n} if p == "fp8" else {})})
                     for _, p, n in FP4_FORMS for name in ("masked_fp4_kernel", "contiguous_fp4_kernel")]
        jobs += [("contiguous_swiglu_kernel", (I, H, 10.0), {}), ("masked_swiglu_kernel", (I, H, 10.0), {}),
                 ("swiglu_quant_kernel", (I, 10.0), {}), ("combine_kernel", (H, TOPK), {}),
                 ("quantize_scatter_kernel", (H, TOPK), {})]
    return jobs


def _compile_job(job) -> str:
    import time as _time

    from musa_attn_backend.kernels.moe import tilelang_impl

    name, args, tiling = job
    t0 = _time.perf_counter()
    getattr(tilelang_impl, name)(*args, **tiling)
    return f"{name}{args} {tiling or ''}: {_time.perf_counter() - t0:.0f} s"


def compile_all(jobs: list, workers: int) -> None:
    """Compile ``jobs`` (:func:`kernels_for`) into the kernel cache in ``workers`` processes: a fresh machine
    compiles a run's dozen programs in about the time of one."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_compile_job, jobs):
            print("compiled", line, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--quick", action="store_true", help="V4-Flash, T in {1, 64, 4096}")
    ap.add_argument("--models", default="flash,pro")
    ap.add_argument("--tokens", default="1,8,64,512,4096,16384")
    ap.add_argument("--ops", default="gate_up,down,layer", help="which rows: the two GEMMs and the whole layer")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (the harness only)")
    ap.add_argument("--compile-only", type=int, default=0, metavar="WORKERS",
                    help="only compile the kernels this run would use, in this many processes, and exit")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of a results file, beside it")
    ap.add_argument("--tiling", default="", metavar="K=V,...",
                    help="the contiguous programs' tiling for this run (kernels.moe.tilelang_impl.CONTIGUOUS keys: "
                         "block_n, num_stages, threads, policy, swizzle, persistent), recorded in the JSON")
    ap.add_argument("--masked-tiling", default="", metavar="K=V,...",
                    help="the masked FP8 program's tiling for this run (tilelang_impl.MASKED keys: block_m, "
                         "block_n, num_stages, threads), recorded in the JSON")
    args = ap.parse_args(argv)
    if args.plot:
        src = Path(args.plot)
        return 0 if plot(json.loads(src.read_text())["rows"], src.with_suffix(".png")) else 1
    device = "cpu" if args.smoke else "cuda"
    tiling = {}
    for item in filter(None, args.tiling.split(",")):
        key, value = item.split("=", 1)
        tiling[key] = value if key == "policy" else int(value)
    from musa_attn_backend.kernels.moe import tilelang_impl

    tilelang_impl.CONTIGUOUS.update(tiling)
    if "num_stages" in tiling:  # the run's stages at every size
        tilelang_impl.LARGE_M_STAGES = None
    masked_tiling = {k: int(v) for k, v in (i.split("=", 1) for i in filter(None, args.masked_tiling.split(",")))}
    tilelang_impl.MASKED.update(masked_tiling)
    if args.compile_only:
        models = ["flash"] if args.quick else args.models.split(",")
        compile_all(kernels_for(models, tiling, masked_tiling), args.compile_only)
        return 0
    ceilings = {}
    if not args.smoke:
        ceilings = measure_ceilings()
        ceilings["fp8_matmul_tflops"] = fp8_rate(device)
        print("ceilings", ceilings, flush=True)
    tokens = [1, 64, 4096] if args.quick else [int(t) for t in args.tokens.split(",")]
    models = ["flash"] if args.quick or args.smoke else args.models.split(",")
    if args.smoke:
        tokens = [1, 37]
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"moe-{'smoke-' if args.smoke else ''}{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
    rows = []
    for model in models:
        for gemm in args.ops.split(","):
            for T in tokens:
                try:
                    rows.append(measure_layer(model, T, ceilings, device, args.smoke) if gemm == "layer"
                                else measure(model, gemm, T, ceilings, device, args.smoke))
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    traceback.print_exc()
                    rows.append({"op": f"moe_{gemm}", "shape": {"model": model, "T": T},
                                 "errors": f"{type(e).__name__}: {e}"[:500]})
                r = rows[-1]
                peer = "  ".join(f"{k} {v['ms']:.4f}" for k, v in r.get("peers", {}).items()
                                 if isinstance(v, dict) and "ms" in v)
                print(f"{r['op']:<12} {model:<5} T {T:>6}: " + (r.get("errors") or (
                    f"ours {r['ours_ms']:.4f} ms" + (f" masked {r['ours_masked_ms']:.4f}" if "ours_masked_ms" in r
                                                    else "")
                    + (f" fp4 {r['ours_fp4_ms']:.4f}" if "ours_fp4_ms" in r else "")
                    + (f" ({r['ours_tflops']:.0f} TFLOP/s, roofline {r['roofline_fraction']:.2f}, "
                       f"vs best peer {r['ratio_vs_best_peer']:.2f}x)" if "ratio_vs_best_peer" in r else "")
                    + f"  | {peer}")), flush=True)
                doc = {"kind": "moe-grouped-gemm", "device": torch.cuda.get_device_name() if device == "cuda"
                       else "cpu", "commit": git_commit(), "date": stamp.isoformat(), "versions": versions(),
                       "ceilings": ceilings, "tiling": dict(tilelang_impl.CONTIGUOUS), "masked_tiling": dict(tilelang_impl.MASKED),
                       "large_m_stages": tilelang_impl.LARGE_M_STAGES, "rows": rows}
                path.write_text(json.dumps(doc, indent=1) + "\n")
    if device == "cuda" and plot(rows, path.with_suffix(".png")):
        print(f"plot in {path.with_suffix('.png')}")
    print(f"results in {path}")
    return 0 if all("errors" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
