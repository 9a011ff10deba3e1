"""vLLM's DeepSeek-V4 attention through our layer (``MusaDeepseekV4Attention.forward_mqa``): the layer call against
the kernel it launches, run alone, at vLLM's batch shapes.

    python benchmarks/bench_vllm_dsv4.py [--out benchmarks/results] [--quick]
    python benchmarks/bench_vllm_dsv4.py --smoke        (CPU, tiny shapes: the harness only)

Each row is one batch: decode (``B`` requests of ``L`` tokens, one new token each) or prefill (one request of
``E`` tokens from scratch), 64 heads (V4-Flash) or 128 (V4-Pro), compress ratio 0 (window only), 4 (window + the
indexer's 512 rows) or 128 (window + every C128 row). The caches are laid out as vLLM binds them: one buffer of
93,888-byte physical blocks holding a 64-row SWA page, a 64-row C4 page and a 2-row C128 page at their offsets,
every group's blocks handed out at random from one pool. The rows a query reads are written with our writer; the
C4 choice is random rows of the request's (as the indexer's would be: this bench times attention, not the
indexer).

Per row: ``layer_ms`` is what ``forward_mqa`` runs per layer call (the window and compressed slots from the
batch's positions, requests and block tables by :func:`musa_attn_backend.metadata.vllm_dsv4.attention_indices`,
then ``sparse_mqa``; eager, CUDA events: host work between launches shows); ``kernel_ms`` the same ``sparse_mqa``
call alone on those slots; ``kept`` = kernel_ms / layer_ms. ``*_graph_ms``: the same replayed from a CUDA graph.
The roofline is the larger of the bytes of every row read once at the run's copy rate and the FLOPs at its bf16
matmul rate, taken of the kernel's graph time. FlashMLA, where ``flashmla_peer`` imports (vLLM's wheel's build,
staged by ``../shared/device/prepare.sh --peers``): decode rows on the same caches and slots, eager
(``flashmla_eager_ms``, its metadata made once) and from a graph (``flashmla_graph_ms``), beside ``layer_ms`` /
``layer_graph_ms``, with ``flashmla_max_abs_diff`` to our output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_attention import bench_parser, capture_graph, eager_ms, git_commit, package_versions, run_rows  # noqa: E402

ROW_BYTES = 584
WINDOW = 128
TOPK = 512
BLOCK_STRIDE = 93_888  # vLLM's packed block for V4 (two 8,640-byte indexer/state pages, two 37,440, one 1,728)
OFFSETS = {"swa": 0, 4: 37_440, 128: 74_880}
ROWS = {"swa": 64, 4: 64, 128: 2}
BLOCK_TOKENS = {"swa": 64, 4: 256, 128: 256}


def view(buf: torch.Tensor, kind) -> torch.Tensor:
    nb = buf.numel() // BLOCK_STRIDE
    return buf.as_strided((nb, ROWS[kind], ROW_BYTES), (BLOCK_STRIDE, ROW_BYTES, 1), OFFSETS[kind])


def build(mode: str, heads: int, ratio: int, batch: int, context: int, device: str, seed: int = 0):
    from musa_attn_backend.kernels import dsv4
    from musa_attn_backend.metadata import vllm_dsv4 as meta

    g = torch.Generator(device="cpu").manual_seed(seed)
    T = batch if mode == "decode" else context
    kinds = ["swa"] + ([ratio] if ratio else [])
    need = {k: -(-context // BLOCK_TOKENS[k]) for k in kinds}
    total = batch * sum(need.values()) + 1
    buf = torch.zeros(total * BLOCK_STRIDE, dtype=torch.uint8, device=device)
    pool = torch.randperm(total - 1, generator=g).add(1)
    tables, at = {}, 0
    for k in kinds:
        n = batch * need[k]
        tables[k] = pool[at:at + n].view(batch, need[k]).to(torch.int32).to(device)
        at += n
    if mode == "decode":
        positions = torch.full((batch,), context - 1, dtype=torch.long, device=device)
        req = torch.arange(batch, dtype=torch.int32, device=device)
    else:
        positions = torch.arange(context, device=device)
        req = torch.zeros(context, dtype=torch.int32, device=device)
    # the rows the batch reads: each request's last window, and all its compressed rows
    for k in kinds:
        cache = view(buf, k)
        per_req = (torch.arange(max(0, context - WINDOW) if mode == "decode" else 0, context) if k == "swa"
                   else torch.arange(context // ratio))
        local = per_req.view(1, -1).expand(batch, -1).to(device)
        rows_of = BLOCK_TOKENS[k] // (1 if k == "swa" else ratio)
        slots = meta.local_to_global(local, torch.arange(batch, device=device), tables[k], rows_of).flatten()
        for lo in range(0, slots.numel(), 1 << 20):
            s = slots[lo:lo + (1 << 20)]
            dsv4.write_kv_v4(torch.randn(s.numel(), 512, generator=g).to(torch.bfloat16).to(device), cache, s)
    topk_local = None
    if ratio == 4:
        seen = torch.div(positions + 1, 4, rounding_mode="floor")
        width = max(int(seen.max()), 1)
        score = torch.rand(T, width, generator=g).to(device)
        score = score.masked_fill(torch.arange(width, device=device) >= seen.view(-1, 1), -1.0)
        k = min(TOPK, width)
        val, idx = score.topk(k, dim=1)
        topk_local = torch.full((T, TOPK), -1, dtype=torch.int32, device=device)
        topk_local[:, :k] = torch.where(val >= 0, idx, -1).to(torch.int32)
    q = torch.randn(T, heads, 512, generator=g).to(torch.bfloat16).to(device)
    sink = torch.randn(heads, generator=g).to(device)
    out = torch.empty_like(q)

    def indices():
        return meta.attention_indices(positions, req, tables["swa"], 64, WINDOW, ratio,
                                      tables.get(ratio), 256, topk_local, context)

    def attend(window, compressed):
        extra = {} if compressed is None else dict(extra_cache=view(buf, ratio), extra_indices=compressed)
        dsv4.sparse_mqa(q, view(buf, "swa"), window, sink=sink, out=out, **extra)

    def flashmla(ops, window, compressed):
        """FlashMLA's sparse decode on the same caches and slots (its metadata made once), or None where it does
        not take the batch (prefill, or a compressed set that is no multiple of 64 entries)."""
        if mode != "decode" or (compressed is not None and compressed.shape[1] % 64):
            return None
        from bench_dsv4_attention import flashmla_decode

        xc = view(buf, ratio) if compressed is not None else None
        out4 = torch.empty(batch, 1, heads, 512, dtype=torch.bfloat16, device=device)
        if xc is None:
            scale = 512 ** -0.5
            res = ops.sparse_decode_fwd(q.view(batch, 1, heads, 512), view(buf, "swa").unsqueeze(2),
                                        window.view(batch, 1, -1), None, sink, None, None, None, None, None, 512,
                                        scale, out4, False)
            return lambda: ops.sparse_decode_fwd(q.view(batch, 1, heads, 512), view(buf, "swa").unsqueeze(2),
                                                 window.view(batch, 1, -1), None, sink, res[2], res[3], None, None,
                                                 None, 512, scale, out4, False), out4
        return flashmla_decode(ops, q.view(batch, 1, heads, 512), view(buf, "swa"), window.view(batch, 1, -1), xc,
                               compressed.view(batch, 1, -1), sink, out4), out4

    return indices, attend, out, flashmla


def roofline_ms(mode, heads, ratio, batch, context, ceilings) -> float:
    T = batch if mode == "decode" else context
    extra = {0: 0, 4: TOPK, 128: context // 128}[ratio]
    rows = batch * (WINDOW + extra) if mode == "decode" else context + (context // ratio if ratio else 0)
    byte_ms = (rows * ROW_BYTES + T * heads * 512 * 2 * 2) / (ceilings["copy_tbps"] * 1e9)
    keys = WINDOW + (extra if mode == "decode" else {0: 0, 4: TOPK, 128: context // 256}[ratio])
    flop_ms = 2 * T * heads * keys * 1024 / (ceilings["bf16_matmul_tflops"] * 1e9)
    return max(byte_ms, flop_ms)


def measure(cfg, ceilings, device: str, rep: int) -> dict:
    mode, heads, ratio, batch, context = cfg
    cuda = device != "cpu"
    indices, attend, out, flashmla = build(mode, heads, ratio, batch, context, device)
    row = {"op": f"vllm_dsv4_{mode}", "shape": {"heads": heads, "compress_ratio": ratio, "batch": batch,
                                                 "context": context, "tokens": out.shape[0]}}
    with torch.no_grad():
        fixed = indices()

        def layer():
            attend(*indices())

        def alone():
            attend(*fixed)

        layer()
        assert torch.isfinite(out.float()).all(), "non-finite attention output"
        row["ours_ms"] = row["layer_ms"] = eager_ms(layer, rep=rep, cuda=cuda)
        row["kernel_ms"] = eager_ms(alone, rep=rep, cuda=cuda)
        row["kept"] = row["kernel_ms"] / row["layer_ms"]
        row["peers"] = {"standalone_kernel": row["kernel_ms"]}
        if cuda:
            for name, fn in (("layer_graph_ms", layer), ("kernel_graph_ms", alone)):
                try:
                    row[name] = eager_ms(capture_graph(fn).replay, rep=rep)
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    row.setdefault("notes", []).append(f"{name}: {type(e).__name__}: {e}"[:300])
            if "layer_graph_ms" in row and "kernel_graph_ms" in row:
                row["kept_graph"] = row["kernel_graph_ms"] / row["layer_graph_ms"]
            ops = FLASHMLA.get("ops")
            if ops is not None:
                try:
                    made = flashmla(ops, *fixed)
                    if made is not None:
                        fn, fm_out = made
                        row["flashmla_eager_ms"] = eager_ms(fn, rep=rep)
                        row["flashmla_graph_ms"] = eager_ms(capture_graph(fn).replay, rep=rep)
                        row["flashmla_max_abs_diff"] = (fm_out.view_as(out).float() - out.float()).abs().max().item()
                        row["peers"]["flashmla"] = row["flashmla_eager_ms"]
                        row["peers"]["flashmla_graph"] = row["flashmla_graph_ms"]
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    row.setdefault("notes", []).append(f"flashmla: {type(e).__name__}: {e}"[:300])
            roof = roofline_ms(mode, heads, ratio, batch, context, ceilings)
            row["roofline_ms"] = roof
            row["roofline_fraction"] = roof / row.get("kernel_graph_ms", row["kernel_ms"])
    if cuda:
        torch.cuda.empty_cache()
    return row


FLASHMLA: dict = {}  # "ops": FlashMLA's compiled ops where flashmla_peer imports (../shared/device/prepare.sh --peers)


def configs(quick: bool, smoke: bool):
    if smoke:
        return [("decode", 16, r, 3, 700) for r in (0, 4, 128)] + [("prefill", 16, r, 1, 600) for r in (4, 128)]
    out = []
    for h in (64, 128):
        for r in (0, 4, 128):
            for b in (1, 8, 32, 64, 128):
                if quick and b not in (1, 64):
                    continue
                out.append(("decode", h, r, b, 16384))
            for t in (4096, 16384):
                if quick and t != 16384:
                    continue
                out.append(("prefill", h, r, 1, t))
    return out


def versions() -> dict:
    return package_versions("tilelang", "vllm")


def main(argv=None) -> int:
    ap = bench_parser(__doc__, HERE / "results")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    ceilings = {}
    if not args.smoke:
        from bench_attention import measure_ceilings

        ceilings = measure_ceilings()
        try:
            import flashmla_peer

            FLASHMLA["ops"] = flashmla_peer.ops
        except Exception as e:  # noqa: BLE001 - not staged: the run goes on without it, the reason recorded
            FLASHMLA["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    def describe(r):
        return (f"layer {r['layer_ms']:.4f} ms, kernel {r['kernel_ms']:.4f} ms, kept {r['kept']:.2f}"
                + (f", graph kept {r['kept_graph']:.2f}" if "kept_graph" in r else "")
                + (f", roofline {r['roofline_fraction']:.2f}" if "roofline_fraction" in r else "")
                + (f", FlashMLA eager {r['flashmla_eager_ms']:.4f} / graph {r['flashmla_graph_ms']:.4f} ms"
                   if "flashmla_graph_ms" in r else ""))

    return run_rows("vllm-dsv4", "vllm_dsv4", configs(args.quick, args.smoke),
                    lambda cfg: measure(cfg, ceilings, device, 3 if args.smoke else args.rep),
                    ("mode", "heads", "compress_ratio", "batch", "context"), describe, args.out, args.smoke,
                    lambda: {"kind": "vllm-dsv4-layer", "device": torch.cuda.get_device_name()
                             if device == "cuda" else "cpu", "commit": git_commit(), "versions": versions(),
                             "ceilings": ceilings,
                             "peer_errors": {"flashmla": FLASHMLA["error"]} if "error" in FLASHMLA else {}})


if __name__ == "__main__":
    sys.exit(main())
