"""SGLang's DeepSeek-V4 attention through our backend, built by SGLang's own V4 kit: one layer call against the
kernel it launches, run alone.

    python benchmarks/bench_sglang_dsv4.py [--out benchmarks/results] [--quick]
    python benchmarks/bench_sglang_dsv4.py --smoke        (CPU, tiny shapes: the harness only)

Each row is one batch: decode (``B`` requests of ``L`` tokens, one new token each) or prefill (one request
extending ``E`` tokens after ``L - E`` cached ones), 64 heads (V4-Flash) or 128 (V4-Pro), compress ratio 0 (window
only), 4 (window + the indexer's 512 rows) or 128 (window + every C128 row). The kit's fixture builds SGLang's
``DeepSeekV4TokenToKVPool``, ``ReqToTokenPool`` and ``ForwardBatch``, and SGLang's registry builds our backend;
two things are changed for long contexts: the compressed pools span the whole token range (the kit sizes them
for one page) and the forward batch is filled by tensor ops instead of a per-token loop (the same values).
Caches are written with our writer (random rows); the C4 rows a query reads are random rows of the pool, as the
indexer's choice would be (this bench times attention, not the indexer).

Per row: ``meta_ms`` is ``init_forward_metadata`` (once per batch; wall time), ``layer_ms`` one
``backend.forward`` layer call (eager, CUDA events: host work between its launches shows), ``kernel_ms`` the
sparse attention call that layer made, replayed alone with the same arguments, and ``kept`` = kernel_ms /
layer_ms, the share of the standalone kernel's speed the backend keeps. Under CUDA graphs (the engine's decode)
host work disappears: ``layer_graph_ms`` / ``kernel_graph_ms`` are the same calls replayed from a graph. The
roofline is the larger of the bytes every cache row read once take at the run's copy rate and the attention's
FLOPs at its bf16 matmul rate; its fraction is taken of the kernel's GPU time (the graph replay). No peer backend runs here (SGLang's own needs FlashMLA, which does not install).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import sys
import unittest
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_attention import bench_parser, capture_graph, eager_ms, git_commit, package_versions, run_rows  # noqa: E402

from musa_attn_backend import BACKEND_NAME as OURS  # noqa: E402

ROW_BYTES = 584  # one FP8 MODEL1 cache row
WINDOW = 128


class _TC(unittest.TestCase):
    __test__ = False

    def runTest(self):  # pragma: no cover - a carrier of assert methods for the kit
        pass


def import_kit():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit

    return kit


@contextlib.contextmanager
def long_context_kit(kit):
    """The kit, made to hold long contexts while the context is open: compressed pools over the whole token range,
    and its forward batch filled by tensor ops (``_make_forward_batch``'s values without its per-token loop)."""
    real_pool, real_batch = kit.DeepSeekV4TokenToKVPool, kit._make_forward_batch

    def pool(**kw):
        return real_pool(**{**kw, "c4_size": kw["swa_size"], "c128_size": kw["swa_size"]})

    kit.DeepSeekV4TokenToKVPool, kit._make_forward_batch = pool, make_forward_batch
    try:
        yield kit
    finally:
        kit.DeepSeekV4TokenToKVPool, kit._make_forward_batch = real_pool, real_batch


def make_forward_batch(case, runner, *, max_context_len: int, device: str):
    """``kit._make_forward_batch`` by tensor ops: request ``r``'s token ``p`` at full location
    ``1 + r * max_context_len + p``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    seq, inp, pre = case.seq_lens, case.input_lens, case.prefix_lens
    for r, n in enumerate(seq):
        runner.req_to_token_pool.req_to_token[r, :n] = (1 + r * max_context_len + torch.arange(
            n, device=device)).to(runner.req_to_token_pool.req_to_token.dtype)
    positions = torch.cat([torch.arange(p, p + i, device=device) for p, i in zip(pre, inp)])
    starts = torch.repeat_interleave(torch.tensor([1 + r * max_context_len for r in range(len(seq))], device=device),
                                     torch.tensor(inp, device=device))
    batch = ForwardBatch(
        forward_mode=case.forward_mode, batch_size=case.batch_size,
        input_ids=torch.arange(case.num_input_tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(case.batch_size, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), out_cache_loc=(starts + positions).to(torch.int64),
        seq_lens_sum=sum(seq), positions=positions.to(torch.int64))
    runner.kv_index_translator.bind_own_plan(batch)
    if case.forward_mode.is_extend(include_draft_extend_v2=True):
        ext = torch.tensor(inp, dtype=torch.int32, device=device)
        batch.extend_prefix_lens = torch.tensor(pre, dtype=torch.int32, device=device)
        batch.extend_prefix_lens_cpu = list(pre)
        batch.extend_seq_lens = ext
        batch.extend_seq_lens_cpu = list(inp)
        batch.extend_start_loc = torch.zeros_like(ext)
        if case.batch_size > 1:
            batch.extend_start_loc[1:] = torch.cumsum(ext[:-1], dim=0)
        batch.extend_num_tokens = case.num_input_tokens
    return batch


def fill_rows(buffer: torch.Tensor, rows_per_page: int, seed: int, chunk: int = 1 << 18) -> int:
    """Random valid FP8 rows in every slot of a pool buffer, with our writer; returns the slot count."""
    from musa_attn_backend.kernels import dsv4

    cache = dsv4.paged_view(buffer.view(torch.uint8), rows_per_page)
    slots = cache.shape[0] * rows_per_page
    g = torch.Generator(device=buffer.device).manual_seed(seed)
    for lo in range(0, slots, chunk):
        n = min(chunk, slots - lo)
        rows = torch.randn(n, 512, device=buffer.device, generator=g).to(torch.bfloat16)
        dsv4.write_kv_v4(rows, cache, torch.arange(lo, lo + n, device=buffer.device, dtype=torch.int64))
    return slots


def build(kit, mode: str, heads: int, ratio: int, batch: int, context: int, extend: int, device: str):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if mode == "decode":
        case = kit.DSV4AttentionCase(name="bench", backend=OURS, forward_mode=ForwardMode.DECODE, num_heads=heads,
                                     page_size=kit.DSV4_PAGE_SIZE, prefix_lens=(context - 1,) * batch,
                                     compress_ratio=ratio, attn_sink_value=0.5)
    else:
        case = kit.DSV4AttentionCase(name="bench", backend=OURS, forward_mode=ForwardMode.EXTEND, num_heads=heads,
                                     page_size=kit.DSV4_PAGE_SIZE, prefix_lens=(context - extend,) * batch,
                                     extend_lens=(extend,) * batch, compress_ratio=ratio, attn_sink_value=0.5)
    page = kit.DSV4_PAGE_SIZE
    max_ctx = -(-context // page) * page
    swa_size = -(-(1 + batch * max_ctx) // page) * page + page
    fixture = kit.build_dsv4_attention_fixture(_TC(), case, swa_size=swa_size, max_context_len=max_ctx,
                                               device=device, compression_ratios=[ratio])
    pool = fixture.runner.token_to_kv_pool
    fill_rows(pool.get_swa_key_buffer_radix(0), pool.get_swa_key_page_size(), seed=1)
    extra_rows = 0
    if ratio:
        extra_rows = fill_rows(pool.get_extra_key_buffer(0), pool.get_extra_key_page_size(0), seed=2)
    q, _ = fixture.actual_module.project(fixture.input_hidden)
    return fixture, q, extra_rows


def seed_c4(fixture, extra_rows: int, context: int) -> int:
    """The indexer's output stand-in: each query reads ``min(top-k, context // 4)`` random rows of the pool."""
    md = fixture.backend.forward_metadata.core_metadata
    idx = md.sparse_page_indices(4)
    num_q, topk = idx.shape
    k = min(topk, context // 4)
    g = torch.Generator(device=idx.device).manual_seed(3)
    seeded = torch.full_like(idx, -1)
    seeded[:, :k] = torch.randint(0, extra_rows, (num_q, k), device=idx.device, generator=g, dtype=idx.dtype)
    lens = md.sparse_topk_lengths(4)
    md.set_sparse_topk(4, page_indices=seeded, topk_lengths=torch.full_like(lens, k))
    return k


def roofline_ms(mode, heads, ratio, batch, context, extend, k_c4, ceilings) -> float:
    q_tokens = batch * (1 if mode == "decode" else extend)
    extra = {0: 0, 4: k_c4, 128: context // 128}[ratio]
    keys = WINDOW + extra  # per query
    # cache bytes: decode reads each request's rows once; prefill reads the extend's window rows plus its rows
    rows = batch * keys if mode == "decode" else batch * (extend + WINDOW + (context // ratio if ratio else 0))
    byte_ms = (rows * ROW_BYTES + q_tokens * heads * 512 * 2 * 2) / (ceilings["copy_tbps"] * 1e9)
    flop_ms = 2 * q_tokens * heads * keys * (512 + 512) / (ceilings["bf16_matmul_tflops"] * 1e9)
    return max(byte_ms, flop_ms)


def measure(kit, cfg, ceilings, device: str, rep: int, profile: bool = False) -> dict:
    mode, heads, ratio, batch, context, extend = cfg
    cuda = device != "cpu"
    fixture, q, extra_rows = build(kit, mode, heads, ratio, batch, context, extend, device)
    backend, fb = fixture.backend, fixture.forward_batch
    row = {"op": f"sglang_dsv4_{mode}", "shape": {"heads": heads, "compress_ratio": ratio, "batch": batch,
                                                   "context": context, "extend": extend if mode != "decode" else 1}}
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        meta = []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            t0 = _dt.datetime.now()
            backend.init_forward_metadata(fb)
            if cuda:
                torch.cuda.synchronize()
            meta.append((_dt.datetime.now() - t0).total_seconds() * 1e3)
        k_c4 = seed_c4(fixture, extra_rows, context) if ratio == 4 else 0
        calls = []
        kernel = backend._flash_mla_with_kvcache

        def recording(*a, **kw):
            calls.append((a, kw))
            return kernel(*a, **kw)

        backend._flash_mla_with_kvcache = recording

        def layer():
            return backend.forward(q=q, k=q, v=q, layer=fixture.actual_module.attn, forward_batch=fb,
                                   compress_ratio=ratio, save_kv_cache=False, attn_sink=fixture.actual_module.attn_sink)

        out = layer()
        backend._flash_mla_with_kvcache = kernel
        assert calls, "the layer call made no sparse attention call"
        assert torch.isfinite(out.float()).all(), "non-finite attention output"
        recorded = list(calls)

        def alone():
            for a, kw in recorded:
                kernel(*a, **kw)

        row["meta_ms"] = sorted(meta)[1]
        row["ours_ms"] = row["layer_ms"] = eager_ms(layer, rep=rep, cuda=cuda)
        row["kernel_ms"] = eager_ms(alone, rep=rep, cuda=cuda)
        row["kernel_calls"] = len(recorded)
        row["kept"] = row["kernel_ms"] / row["layer_ms"]
        row["peers"] = {"standalone_kernel": row["kernel_ms"]}
        if cuda:
            for name, fn in (("layer_graph_ms", layer), ("kernel_graph_ms", alone)):
                try:
                    g = capture_graph(fn)
                    row[name] = eager_ms(g.replay, rep=rep)
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    row.setdefault("notes", []).append(f"{name}: {type(e).__name__}: {e}"[:300])
            if "layer_graph_ms" in row and "kernel_graph_ms" in row:
                row["kept_graph"] = row["kernel_graph_ms"] / row["layer_graph_ms"]
            roof = roofline_ms(mode, heads, ratio, batch, context, extend, k_c4, ceilings)
            row["roofline_ms"] = roof  # against the kernel's GPU time (its graph replay) where it was captured
            row["roofline_fraction"] = roof / row.get("kernel_graph_ms", row["kernel_ms"])
            if profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    alone()
                torch.cuda.synchronize()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    del fixture, q
    if cuda:
        torch.cuda.empty_cache()
    return row


def configs(quick: bool, smoke: bool):
    if smoke:
        return [("decode", 16, r, 2, 300, 1) for r in (0, 4, 128)] + [("prefill", 16, 4, 1, 300, 40)]
    heads = (64, 128)
    out = []
    for h in heads:
        for r in (0, 4, 128):
            for b, ctx in ((1, 4096), (1, 65536), (32, 16384), (64, 32768)):
                if quick and (b, ctx) not in ((1, 65536), (64, 32768)):
                    continue
                out.append(("decode", h, r, b, ctx, 1))
            for ctx, e in ((4096, 4096), (65536, 4096)):
                if quick and ctx != 65536:
                    continue
                out.append(("prefill", h, r, 1, ctx, e))
    return out


def versions() -> dict:
    return package_versions("tilelang", "sglang")


def main(argv=None) -> int:
    ap = bench_parser(__doc__, HERE / "results")
    ap.add_argument("--profile", action="store_true", help="print a host profile of the first row's sparse call")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    kit = import_kit()
    ceilings = {}
    if not args.smoke:
        from bench_attention import measure_ceilings

        ceilings = measure_ceilings()
    first = [True]

    def measure_one(cfg):
        with long_context_kit(kit):
            row = measure(kit, cfg, ceilings, device, 3 if args.smoke else args.rep, profile=args.profile and first[0])
        first[0] = False
        return row

    def describe(r):
        return (f"layer {r['layer_ms']:.4f} ms, kernel {r['kernel_ms']:.4f} ms, kept {r['kept']:.2f}"
                + (f", graph kept {r['kept_graph']:.2f}" if "kept_graph" in r else "")
                + (f", roofline {r['roofline_fraction']:.2f}" if "roofline_fraction" in r else "")
                + f", metadata {r['meta_ms']:.3f} ms")

    return run_rows("sglang-dsv4", "sglang_dsv4", configs(args.quick, args.smoke), measure_one,
                    ("mode", "heads", "compress_ratio", "batch", "context", "extend"), describe, args.out, args.smoke,
                    lambda: {"kind": "sglang-dsv4-backend", "device": torch.cuda.get_device_name()
                             if device == "cuda" else "cpu", "commit": git_commit(), "versions": versions(),
                             "ceilings": ceilings})


if __name__ == "__main__":
    sys.exit(main())
