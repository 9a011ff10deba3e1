"""SGLang layer-call benchmark: our ``tilelang_musa`` backend vs SGLang's own ``triton`` backend.

    python benchmarks/bench_sglang_backend.py [--out benchmarks/results] [--ops decode,extend]
                                              [--page-sizes 1,64] [--timing auto|graph|eager]
    python benchmarks/bench_sglang_backend.py --smoke      (CPU, tiny shapes, fp32, peer torch_native)
    python benchmarks/bench_sglang_backend.py --smoke --peers triton,torch_native   (+ Triton interpreter)

Both backends run through SGLang 0.5.23's attention test kit
(``sglang.test.kits.attention_unittest.attention_methods.dense_attention``): the kit's ``MockModelRunner``
(SGLang's real ``ReqToTokenPool`` and ``MHATokenToKVPool``), a kit ``RadixAttention`` layer and a
``ForwardBatch`` laid out like the kit's ``_make_forward_batch`` with its default "shuffled_pages" layout
(each request's pages in random order). Our backend is found in SGLang's registry after ``load_plugins()``.

Per row (one batch shape), for each backend on the *same* runner, cache and inputs:
  * ``init_forward_metadata(forward_batch)`` once, outside the timed region (an engine does it once per
    batch and reuses it for every layer);
  * the timed unit is one layer call ``layer(q, k, v, forward_batch)`` (``RadixAttention`` ->
    ``backend.forward`` with ``save_kv_cache=True``: it writes the new tokens' K/V, then attends);
  * outputs of the two backends are compared first (``max_abs_diff``);
  * timing: the layer call captured once in a CUDA graph and its replays timed with CUDA events (median
    of ``--rep`` after warm-up). If the capture fails for either backend, that row times both eagerly
    and says so (row ``timing`` and ``notes``); the top-level ``timing`` is the mode the run asked for.

A failing backend on a shape records an error string in the row; the run continues (a CUDA fault that
poisons the context makes the later rows fail too; rerun those with ``--ops`` / ``--page-sizes`` /
``--decode-batches``). Each run writes ``sglang-backend-<UTC stamp>.json`` under ``--out`` and prints a table.

Not modelled: the engine's decode CUDA-graph metadata path (``init_forward_metadata_out_graph`` on
``init_cuda_graph_state`` buffers); here the metadata is the eager ``init_forward_metadata`` for both
backends and only the layer call is captured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform as _platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_attention import capture_graph, eager_ms, git_commit  # noqa: E402

from musa_attn_backend import BACKEND_NAME as OURS  # noqa: E402
from musa_attn_backend.testing.numeric import tolerance  # noqa: E402

HIDDEN_SIZE = 64  # the kit module's hidden size; only its (unused) projections depend on it


# --------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    op: str  # "decode" | "extend"
    batch: int
    prefix: int  # keys already in the cache, per request
    extend: int  # new tokens per request (1 for decode)
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def seqlen_k(self) -> int:
        return self.prefix + self.extend

    def as_dict(self) -> dict:
        return dict(batch=self.batch, seqlen_q=self.extend, seqlen_k=self.seqlen_k, heads_q=self.heads_q,
                    heads_kv=self.heads_kv, head_dim=self.head_dim, page_size=self.page_size,
                    dtype=str(self.dtype).replace("torch.", ""))

    def label(self) -> str:
        return f"{self.op} b{self.batch} q{self.extend} k{self.seqlen_k} p{self.page_size}"


DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (1024, 4096, 16384)
EXTEND_MIXES = ((1, 0, 4096), (4, 2048, 1024), (16, 1024, 256))  # (batch, prefix, extend)


def gpu_shapes(ops, page_sizes, max_tokens, hq=32, hkv=8, d=128, dtype=torch.bfloat16,
               decode_batches=DECODE_BATCHES, decode_contexts=DECODE_CONTEXTS, extend_mixes=EXTEND_MIXES):
    """Decode: batch 1/8/32/128 x context 1k/4k/16k; extend: three prefix/extend mixes. Shapes with
    batch * seqlen_k > max_tokens are skipped (the KV pool: 4 KiB per token at 8 KV heads x 128 x bf16)."""
    shapes, skipped = [], []
    for ps in page_sizes:
        if "decode" in ops:
            for b in decode_batches:
                for ctx in decode_contexts:
                    s = Shape("decode", b, ctx - 1, 1, hq, hkv, d, ps, dtype)
                    (shapes if b * ctx <= max_tokens else skipped).append(s)
        if "extend" in ops:
            for b, prefix, ext in extend_mixes:
                s = Shape("extend", b, prefix, ext, hq, hkv, d, ps, dtype)
                (shapes if b * (prefix + ext) <= max_tokens else skipped).append(s)
    return shapes, skipped


def smoke_shapes(ops, page_sizes, hq=8, hkv=2, d=64, dtype=torch.float32):
    shapes = []
    for ps in page_sizes:
        if "decode" in ops:
            for b, ctx in ((1, 9), (3, 33)):
                shapes.append(Shape("decode", b, ctx - 1, 1, hq, hkv, d, ps, dtype))
        if "extend" in ops:
            for b, prefix, ext in ((1, 0, 12), (2, 5, 7)):
                shapes.append(Shape("extend", b, prefix, ext, hq, hkv, d, ps, dtype))
    return shapes, []


# --------------------------------------------------------------------------------------------- SGLang
def import_sglang(peers, device):
    """Import SGLang, register our plugin and return the kit module."""
    if device == "cpu" and "triton" in peers:
        # SGLang's Triton kernels run on a CPU only in Triton's interpreter (slow; tiny shapes only).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit

    return kit


def ensure_sgl_kernel_pdl_helper(notes: list) -> None:
    """SGLang's triton backend does ``from sgl_kernel.utils import is_arch_support_pdl`` on CUDA. With an
    import-only ``sgl_kernel`` stub that helper may be missing: give it SGLang's own JIT-side equivalent
    (``sglang.kernels.jit.utils.is_arch_support_pdl``, compute capability >= 9). Nothing in SGLang is edited;
    the shim is recorded in the JSON."""
    if not torch.cuda.is_available():
        return
    try:
        import sgl_kernel  # noqa: F401
    except Exception:
        return  # no sgl_kernel at all: leave it; the triton row then records the import error
    try:
        from sgl_kernel.utils import is_arch_support_pdl  # noqa: F401
        return
    except Exception:
        pass
    import types

    from sglang.kernels.jit.utils import is_arch_support_pdl as _pdl

    mod = sys.modules.get("sgl_kernel.utils")
    if mod is None:
        try:
            import sgl_kernel.utils as mod  # type: ignore
        except Exception:
            mod = types.ModuleType("sgl_kernel.utils")
            sys.modules["sgl_kernel.utils"] = mod
            sys.modules["sgl_kernel"].utils = mod
    mod.is_arch_support_pdl = _pdl
    notes.append("sgl_kernel.utils.is_arch_support_pdl missing (stub): shimmed with "
                 "sglang.kernels.jit.utils.is_arch_support_pdl")


def make_case(kit, shape: Shape, backend: str):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = ForwardMode.DECODE if shape.op == "decode" else ForwardMode.EXTEND
    return kit.DenseAttentionCase(
        name=f"bench_{shape.op}_b{shape.batch}_k{shape.seqlen_k}_p{shape.page_size}", backend=backend,
        forward_mode=mode, num_heads=shape.heads_q, num_kv_heads=shape.heads_kv, page_size=shape.page_size,
        prefix_lens=(shape.prefix,) * shape.batch,
        extend_lens=() if shape.op == "decode" else (shape.extend,) * shape.batch)


def context_len_for(case) -> int:
    """Per-request slot block of the kit runner: the longest request rounded up to whole pages, plus a page."""
    need = max(case.seq_lens)
    return -(-need // case.page_size) * case.page_size + case.page_size


def make_runner(kit, case, *, dtype, device, head_dim, max_context_len):
    cfg = kit.TinyModelConfig(num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=head_dim,
                              hidden_size=HIDDEN_SIZE, context_len=max_context_len)
    return kit.MockModelRunner(case=case, model_config=cfg, dtype=dtype, device=device,
                               max_context_len=max_context_len, head_dim=head_dim)


def shuffled_page_locs(case, max_context_len: int, seed: int) -> torch.Tensor:
    """``[batch, max_seq]`` int64 slot of each (request, position): request ``r`` owns the slot block
    ``page_size + r * max_context_len + [0, max_context_len)`` (the kit's), its logical pages in a random
    order (the kit's default "shuffled_pages" layout, drawn vectorised). Slot 0 (SGLang's padding slot) is
    never used."""
    ps, b = case.page_size, case.batch_size
    pages_per_req = max(1, max_context_len // ps)
    g = torch.Generator().manual_seed(seed)
    perm = torch.argsort(torch.rand(b, pages_per_req, generator=g), dim=1)
    pos = torch.arange(max(case.seq_lens))
    phys_page = perm[:, (pos // ps) % pages_per_req]
    base = ps + torch.arange(b).unsqueeze(1) * max_context_len
    return base + phys_page * ps + pos % ps


def make_forward_batch(case, runner, locs: torch.Tensor, device):
    """The ``ForwardBatch`` the kit's ``_make_forward_batch`` builds for ``loc_fn(r, p) = locs[r, p]``,
    without its per-token Python loop (tests/sglang/test_bench_harness_sglang.py checks they are equal)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    seq_lens, input_lens = case.seq_lens, case.input_lens
    decode = case.forward_mode.is_decode()
    r2t = runner.req_to_token_pool.req_to_token
    out_locs, positions = [], []
    for r, s in enumerate(seq_lens):
        r2t[r, :s] = locs[r, :s].to(device=r2t.device, dtype=r2t.dtype)
        first = s - 1 if decode else case.prefix_lens[r]
        out_locs.append(locs[r, first:first + input_lens[r]])
        positions.append(torch.arange(first, first + input_lens[r], dtype=torch.int64))
    batch = ForwardBatch(
        forward_mode=case.forward_mode,
        batch_size=case.batch_size,
        input_ids=torch.arange(case.num_input_tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(case.batch_size, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32, device="cpu"),
        out_cache_loc=torch.cat(out_locs).to(device=device, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        positions=torch.cat(positions).to(device),
    )
    runner.kv_index_translator.bind_own_plan(batch)  # as the kit does: the batch is its own KV plan
    if not decode:
        batch.extend_prefix_lens = torch.tensor(case.prefix_lens, dtype=torch.int32, device=device)
        batch.extend_prefix_lens_cpu = list(case.prefix_lens)
        batch.extend_seq_lens = torch.tensor(input_lens, dtype=torch.int32, device=device)
        batch.extend_seq_lens_cpu = list(input_lens)
        batch.extend_num_tokens = case.num_input_tokens
    return batch


def fill_prefix_kv(case, runner, layer, locs, *, dtype, device, chunk=1 << 18):
    """Random K/V for every request's prefix, written through the pool's ``set_kv_buffer`` (as the kit's
    ``_populate_prefix_kv``), in chunks to bound the temporary memory."""
    loc = torch.cat([locs[r, :p] for r, p in enumerate(case.prefix_lens)])
    hkv, d = case.num_kv_heads, layer.qk_head_dim
    for i in range(0, loc.numel(), chunk):
        part = loc[i:i + chunk].to(device)
        k = torch.randn(part.numel(), hkv, d, dtype=dtype, device=device)
        v = torch.randn(part.numel(), hkv, d, dtype=dtype, device=device)
        runner.token_to_kv_pool.set_kv_buffer(layer, part, k, v)


# --------------------------------------------------------------------------------------------- timing
def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# --------------------------------------------------------------------------------------------- one row
def agreement_tol(kit, dtype: torch.dtype) -> float:
    """Max |ours - peer| still called agreement. 16-bit: the kit's own dense bound (``DENSE_ATOL``), the one
    SGLang's kit holds every backend to on this runner; the peers are SGLang's backends, so ours is held to
    the same bound as them, not to the table's single-kernel bound (which ``tests/`` apply against the float32
    reference). float32: the table's kernel bound (musa_attn_backend.testing.numeric), as absolute bound."""
    return tolerance(torch.float32) if dtype == torch.float32 else float(kit.DENSE_ATOL)


def run_row(kit, shape: Shape, peers, *, device, timing, warmup, rep, seed=0, verbose=False) -> dict:
    """One shape: ours and each peer on the same kit runner, cache and inputs. Never raises: a failure is
    recorded in ``row["errors"]`` (per backend, or ``setup``)."""
    cuda = device != "cpu"
    row = {"op": shape.op, "shape": shape.as_dict(), "ours_ms": None, "peers": {}, "ratio": None,
           "max_abs_diff": None, "timing": None}
    errors, notes, held = {}, [], {}
    try:
        _measure(kit, shape, list(peers), row, errors, notes, held, device=device, timing=timing, warmup=warmup,
                 rep=rep, seed=seed, verbose=verbose)
    except Exception as e:
        errors["setup"] = _err(e)
        if verbose:
            traceback.print_exc()
    finally:
        # Everything of the row is out of scope here except the runner (its server-args override is undone).
        runner = held.pop("runner", None)
        if runner is not None:
            runner._server_args_override.restore()
        del runner
        gc.collect()
        if cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e:  # a faulted CUDA context: later rows will say so too
                errors.setdefault("cleanup", _err(e))
    main_peer = peers[0] if peers else None
    if row["ours_ms"] and main_peer in row["peers"]:
        row["ratio"] = row["peers"][main_peer] / row["ours_ms"]  # > 1: ours faster
    if len(row["peers"]) > 1 and row["ours_ms"]:
        row["ratios"] = {p: ms / row["ours_ms"] for p, ms in row["peers"].items()}
    if errors:
        row["errors"] = errors
    if notes:
        row["notes"] = notes
    return row


def _measure(kit, shape, peers, row, errors, notes, held, *, device, timing, warmup, rep, seed, verbose):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    cuda = device != "cpu"
    case = make_case(kit, shape, OURS)
    max_ctx = context_len_for(case)
    torch.manual_seed(seed)
    runner = held["runner"] = make_runner(kit, case, dtype=shape.dtype, device=device, head_dim=shape.head_dim,
                                          max_context_len=max_ctx)
    module = kit.ProjectedDenseAttention(hidden_size=HIDDEN_SIZE, num_heads=shape.heads_q,
                                         num_kv_heads=shape.heads_kv, head_dim=shape.head_dim, dtype=shape.dtype,
                                         device=device)
    layer = module.attn
    locs = shuffled_page_locs(case, max_ctx, seed + 17)
    fb = make_forward_batch(case, runner, locs, device)
    fill_prefix_kv(case, runner, layer, locs, dtype=shape.dtype, device=device)
    t = case.num_input_tokens
    q = torch.randn(t, shape.heads_q * shape.head_dim, dtype=shape.dtype, device=device)
    k = torch.randn(t, shape.heads_kv * shape.head_dim, dtype=shape.dtype, device=device)
    v = torch.randn(t, shape.heads_kv * shape.head_dim, dtype=shape.dtype, device=device)

    def call():
        return layer(q, k, v, fb)  # RadixAttention -> backend.forward(..., save_kv_cache=True)

    # 1) each backend on the same runner: metadata once, one call to check (also the JIT warm-up)
    state, outs = {}, {}
    for name in [OURS] + peers:
        try:
            backend = ATTENTION_BACKENDS[name](runner)
            ctx = ForwardContext(attn_backend=backend)
            with forward_context(ctx):
                backend.init_forward_metadata(fb)
                out = call()
            if cuda:
                torch.cuda.synchronize()
            outs[name] = out.float().reshape(t, -1).clone()
            state[name] = {"backend": backend, "ctx": ctx}
        except Exception as e:
            errors[name] = _err(e)
            if verbose:
                traceback.print_exc()
    diffs = {}
    for p in peers:
        if OURS in outs and p in outs:
            try:
                diffs[p] = (outs[OURS] - outs[p]).abs().max().item()
            except Exception as e:  # e.g. a peer returning another shape
                errors[f"compare_{p}"] = _err(e)
    outs.clear()
    if diffs:
        row["max_abs_diff"] = diffs[peers[0]] if peers[0] in diffs else max(diffs.values())
        row["agree"] = all(math.isfinite(x) and x <= agreement_tol(kit, shape.dtype) for x in diffs.values())
        if len(diffs) > 1:
            row["max_abs_diff_by_peer"] = diffs

    # 2) one timing mode for every backend of the row: graph if every capture works, else eager
    mode = timing
    if mode == "graph":
        for name, s in state.items():
            try:
                with forward_context(s["ctx"]):
                    s["graph"] = capture_graph(call)
            except Exception as e:
                notes.append(f"{name}: CUDA graph capture failed ({_err(e)}); row timed eagerly")
                mode = "eager"
                break
        if mode == "eager":
            for s in state.values():
                s.pop("graph", None)
            if cuda:
                torch.cuda.synchronize()
    row["timing"] = mode
    timer = functools.partial(eager_ms, cuda=cuda)  # (fn, warmup, rep)
    for name, s in state.items():
        try:
            if mode == "graph":
                ms = timer(s["graph"].replay, warmup, rep)
            else:
                with forward_context(s["ctx"]):
                    ms = timer(call, warmup, rep)
        except Exception as e:
            errors[name] = _err(e)
            if verbose:
                traceback.print_exc()
            continue
        if name == OURS:
            row["ours_ms"] = ms
        else:
            row["peers"][name] = ms
    state.clear()


# --------------------------------------------------------------------------------------------- output
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except Exception:
        return "unknown"


def device_name(device: str) -> str:
    if device == "cpu":
        return f"cpu ({_platform.processor() or _platform.machine()}, {os.cpu_count()} cores)"
    return torch.cuda.get_device_name()


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "-"


def print_table(rows, peers):
    main = peers[0] if peers else "peer"
    print(f"{'op':7s} {'B':>4s} {'sq':>5s} {'sk':>6s} {'pg':>3s} {'ours ms':>9s} {main + ' ms':>12s} "
          f"{'ratio':>6s} {'max|diff|':>9s} {'timing':>6s}  errors")
    for r in rows:
        s = r["shape"]
        err = "; ".join(f"{k}: {v}" for k, v in r.get("errors", {}).items())
        if r.get("agree") is False:
            err = "DISAGREE " + err
        print(f"{r['op']:7s} {s['batch']:4d} {s['seqlen_q']:5d} {s['seqlen_k']:6d} {s['page_size']:3d} "
              f"{_fmt(r['ours_ms'], '9.4f'):>9s} {_fmt(r['peers'].get(main), '12.4f'):>12s} "
              f"{_fmt(r['ratio'], '6.2f'):>6s} {_fmt(r['max_abs_diff'], '9.2e'):>9s} {r['timing'] or '-':>6s}  "
              f"{err[:120]}")


def _ints(s: str):
    return [int(x) for x in s.split(",") if x.strip()]


def _mixes(s: str):
    """``"1x0+4096,4x2048+1024"`` -> ``[(1, 0, 4096), (4, 2048, 1024)]`` (batch x prefix + extend)."""
    out = []
    for item in s.split(","):
        b, rest = item.strip().split("x")
        prefix, ext = rest.split("+")
        out.append((int(b), int(prefix), int(ext)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny shapes, fp32, peer torch_native, perf_counter timing (plumbing check)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--ops", default="decode,extend")
    ap.add_argument("--page-sizes", default=None, help="comma list (default 1,64; smoke: 1,4)")
    ap.add_argument("--peers", default=None,
                    help="SGLang backends to compare with (default triton; smoke: torch_native). With --smoke, "
                         "'triton' runs in Triton's CPU interpreter")
    ap.add_argument("--timing", choices=("auto", "graph", "eager"), default="auto",
                    help="auto: graph on a GPU, eager on a CPU")
    ap.add_argument("--max-tokens", type=int, default=2 * 1024 * 1024,
                    help="skip shapes with batch * seqlen_k above this (KV pool memory cap)")
    ap.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)))
    ap.add_argument("--decode-contexts", default=",".join(map(str, DECODE_CONTEXTS)))
    ap.add_argument("--extend-mixes", default=",".join(f"{b}x{p}+{e}" for b, p, e in EXTEND_MIXES),
                    help="comma list of BATCHxPREFIX+EXTEND")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rep", type=int, default=None)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of row errors")
    args = ap.parse_args(argv)

    ops = [o for o in args.ops.split(",") if o]
    if args.smoke:
        device = "cpu"
        peers = (args.peers or "torch_native").split(",")
        page_sizes = _ints(args.page_sizes or "1,4")
        shapes, skipped = smoke_shapes(ops, page_sizes)
        warmup, rep = args.warmup if args.warmup is not None else 1, args.rep or 3
    else:
        if not torch.cuda.is_available():
            print("bench_sglang_backend: needs a CUDA GPU (or use --smoke)", file=sys.stderr)
            return 2
        device = "cuda"
        peers = (args.peers or "triton").split(",")
        page_sizes = _ints(args.page_sizes or "1,64")
        shapes, skipped = gpu_shapes(ops, page_sizes, args.max_tokens, decode_batches=_ints(args.decode_batches),
                                     decode_contexts=_ints(args.decode_contexts),
                                     extend_mixes=_mixes(args.extend_mixes))
        warmup, rep = args.warmup if args.warmup is not None else 5, args.rep or 30
    timing = args.timing if args.timing != "auto" else ("eager" if device == "cpu" else "graph")
    if timing == "graph" and device == "cpu":
        print("bench_sglang_backend: CUDA graphs need a GPU; timing eagerly", file=sys.stderr)
        timing = "eager"

    try:
        kit = import_sglang(peers, device)
    except Exception as e:
        print(f"bench_sglang_backend: SGLang / its attention test kit does not import ({_err(e)})",
              file=sys.stderr)
        return 2
    run_notes = []
    ensure_sgl_kernel_pdl_helper(run_notes)
    for s in skipped:
        print(f"  skip {s.label()}: batch*seqlen_k > --max-tokens {args.max_tokens}")

    rows = []
    with torch.no_grad():
        for shape in shapes:
            t0 = time.perf_counter()
            row = run_row(kit, shape, peers, device=device, timing=timing, warmup=warmup, rep=rep,
                          verbose=args.verbose)
            rows.append(row)
            status = "; ".join(f"{k}: {v}" for k, v in row.get("errors", {}).items()) or "ok"
            print(f"  {shape.label():32s} ours {_fmt(row['ours_ms'], '.4f')} ms, "
                  + ", ".join(f"{p} {_fmt(row['peers'].get(p), '.4f')} ms" for p in peers)
                  + f", diff {_fmt(row['max_abs_diff'], '.2e')} [{row['timing']}] "
                  f"({time.perf_counter() - t0:.1f}s) {status[:160]}", flush=True)

    print_table(rows, peers)
    now = _dt.datetime.now(_dt.timezone.utc)
    doc = {
        "device": device_name(device),
        "commit": git_commit(),
        "date": now.isoformat(),
        "torch": torch.__version__,
        "tilelang": _version("tilelang"),
        "sglang": _version("sglang"),
        "triton": _version("triton"),
        "timing": timing,
        "smoke": bool(args.smoke),
        "peers": peers,
        "method": ("kit MockModelRunner + RadixAttention layer call (save_kv_cache=True); "
                   "init_forward_metadata once per batch outside the timed region; median of "
                   f"{rep} reps after {warmup} warm-up ({'CUDA events' if device != 'cpu' else 'perf_counter'})"),
        "timing_fallback_rows": sum(1 for r in rows if timing == "graph" and r["timing"] == "eager"),
        "agreement_tol": agreement_tol(kit, shapes[0].dtype) if shapes else None,
        "notes": run_notes,
        "skipped": [s.as_dict() | {"op": s.op} for s in skipped],
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sglang-backend-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
