"""vLLM backend benchmark: ``TILELANG_MUSA`` (ours) vs vLLM's ``TRITON_ATTN``, through vLLM's builder + impl.

    python benchmarks/bench_vllm_backend.py [--out benchmarks/results] [--quick] [--ops decode,prefill,mixed]
                                            [--page-sizes 16,64] [--no-graph]
    python benchmarks/bench_vllm_backend.py --smoke      (CPU, tiny shapes, ours vs a plain-torch SDPA reference)
    python benchmarks/bench_vllm_backend.py --smoke --interpret-triton   (+ TRITON_ATTN in Triton's CPU interpreter)

On the lent H200 (python-only vLLM, no network), from the repo root:
    source .device/env.sh && python3 benchmarks/bench_vllm_backend.py --out "$OUT"

No vLLM ``Attention`` layer and no compiled vLLM op is used: for each backend the script constructs the
metadata builder and the impl as vLLM's runner does (``FullAttentionSpec``; a ``VllmConfig`` whose model config
comes from a local Llama-shaped ``config.json``, or a stand-in exposing the head counts if that fails). vLLM 0.33
has no ``get_kv_cache_shape``: every backend sees the logical ``[blocks, kv_heads, block_size, 2*head_dim]``
(K then V in the last axis) over storage in the layout vLLM would resolve for it
(``supported_kv_cache_layouts``, NHD = ``LBNHC`` by default). Each backend gets its own cache, filled by a
plain torch copy from one random canonical cache outside the timing (same logical K/V for both, blocks
shuffled, block 0 left as vLLM's null block, finite junk past each sequence's end); no KV-write kernel runs
(vLLM writes the new tokens before the forward, and ``reshape_and_cache_flash`` is a compiled op). Only
``impl.forward`` is timed; metadata is built once per batch per backend, outside the timing. Batches put
decodes first, as vLLM's reorder does (checked against each builder's ``reorder_batch_threshold``).

Per row: both outputs are compared first (max abs difference), then each forward is timed with CUDA events
(median after warm-up): eagerly, and as CUDA-graph replays where both backends capture (a captured graph must
reproduce an eager call on a new query, else it counts as not capturable). The headline numbers (``ours_ms``,
``peers``, ``ratio`` = peer / ours, > 1 = ours faster) are graph replays when both captured, else eager for
both; ``timing_mode`` says which and ``eager_ms`` / ``graph_ms`` keep both. One JSON file per run, rewritten
after every row (a run cut short keeps what it measured), and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import random
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# the model config is a local file: never ask the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from bench_attention import capture_graph, eager_ms, git_commit  # noqa: E402

from musa_attn_backend.testing.numeric import max_error, tolerance  # noqa: E402

OURS = "TILELANG_MUSA"
TRITON = "TRITON_ATTN"
SDPA_REF = "sdpa_reference"
LAYER_NAME = "model.layers.0.self_attn.attn"
MAX_DECODE_TOKENS = 2_000_000  # decode rows with batch * context above this are skipped


# ---------------------------------------------------------------------------------------------- batches
@dataclass
class Case:
    op: str  # decode | prefill | mixed
    desc: str
    reqs: list  # (new tokens, cached prefix) per request, decodes first


def gpu_cases(ops, quick=False, max_decode_tokens=MAX_DECODE_TOKENS) -> list[Case]:
    cases = []
    if "decode" in ops:
        for b in ((1, 32, 128) if quick else (1, 8, 32, 128)):
            for ctx in ((4096, 16384) if quick else (1024, 4096, 16384)):
                if b * ctx > max_decode_tokens:
                    print(f"skip decode {b}x{ctx}: {b * ctx} context tokens > {max_decode_tokens}")
                    continue
                cases.append(Case("decode", f"{b} decodes @ctx {ctx}", [(1, ctx - 1)] * b))
    if "prefill" in ops:
        cases.append(Case("prefill", "1 x 4096 new", [(4096, 0)]))
        cases.append(Case("prefill", "4 x 1024 new", [(1024, 0)] * 4))
    if "mixed" in ops:
        cases.append(Case("mixed", "16 decodes @ctx 4096 + 2 x 512 new on 1024 prefix",
                          [(1, 4095)] * 16 + [(512, 1024)] * 2))
    return cases


def smoke_cases(ops) -> list[Case]:
    cases = []
    if "decode" in ops:
        cases.append(Case("decode", "3 ragged decodes", [(1, 39), (1, 70), (1, 4)]))
    if "prefill" in ops:
        cases.append(Case("prefill", "2 prefills", [(24, 0), (9, 0)]))
    if "mixed" in ops:
        cases.append(Case("mixed", "2 decodes + extend + prefill", [(1, 33), (1, 60), (13, 17), (20, 0)]))
    return cases


@dataclass
class Batch:
    q_lens: list
    prefix_lens: list
    block_size: int
    num_blocks: int
    block_table: torch.Tensor  # [B, max_blocks] int32, CPU; 0 past each request's blocks
    slot_mapping: torch.Tensor  # [T] int64, CPU: the new tokens' slots

    @property
    def seq_lens(self) -> list:
        return [p + q for p, q in zip(self.prefix_lens, self.q_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def layout_batch(case: Case, block_size: int, seed: int, spare_blocks: int = 4) -> Batch:
    """Blocks of every request drawn at random from a shuffled pool (block 0 = vLLM's null block, unused)."""
    q_lens = [n for n, _ in case.reqs]
    prefix = [p for _, p in case.reqs]
    # vLLM reorders decodes (q_len 1 here) to the front; the cases are written that way
    is_dec = [q == 1 for q in q_lens]
    assert is_dec == sorted(is_dec, reverse=True), f"{case.desc}: decodes must come first"
    seq = [p + q for p, q in zip(prefix, q_lens)]
    nblk = [math.ceil(s / block_size) for s in seq]
    num_blocks = 1 + sum(nblk) + spare_blocks
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    table = torch.zeros(len(seq), max(nblk), dtype=torch.int32)
    slots = []
    used = 0
    for b, (p, q) in enumerate(zip(prefix, q_lens)):
        table[b, : nblk[b]] = torch.tensor(ids[used: used + nblk[b]], dtype=torch.int32)
        used += nblk[b]
        pos = torch.arange(p, p + q)
        slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
    return Batch(q_lens, prefix, block_size, num_blocks, table, torch.cat(slots))


def common_metadata(batch: Batch, device):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor(batch.q_lens, dtype=torch.int32)
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    seq = torch.tensor(batch.seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
        num_reqs=len(q), num_actual_tokens=batch.num_tokens, max_query_len=max(batch.q_lens),
        max_seq_len=max(batch.seq_lens), block_table_tensor=batch.block_table.to(device),
        slot_mapping=batch.slot_mapping.to(device), causal=True, seq_lens_cpu_upper_bound=seq.clone(),
        is_prefilling=(q > 1).to(device))


def shape_of(case: Case, block_size, hq, hkv, d, dtype) -> dict:
    """The row's shape: batch = requests, seqlen_q = most new tokens, seqlen_k = longest context (with them)."""
    return {"batch": len(case.reqs), "seqlen_q": max(n for n, _ in case.reqs),
            "seqlen_k": max(n + p for n, p in case.reqs), "heads_q": hq, "heads_kv": hkv, "head_dim": d,
            "page_size": block_size, "dtype": str(dtype).replace("torch.", "")}


def check_reorder(builder, batch: Batch) -> None:
    """A builder that asks for reordering (``reorder_batch_threshold``) gets decodes first, as vLLM does."""
    thr = getattr(builder, "reorder_batch_threshold", None)
    if thr is None:
        return
    dec = [q <= thr for q in batch.q_lens]
    if dec != sorted(dec, reverse=True):
        raise ValueError(f"batch not in vLLM's reordered form for threshold {thr}: {batch.q_lens}")


# ---------------------------------------------------------------------------------------------- vLLM objects
class _ModelConfigStandIn:
    """What the builders read from ``model_config``, for when a real ``ModelConfig`` cannot be made."""

    rswa_window = None

    def __init__(self, hq, hkv, d, dtype):
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype

    def get_num_attention_heads(self, parallel_config=None):
        return self.hq

    def get_num_kv_heads(self, parallel_config=None):
        return self.hkv

    def get_head_size(self):
        return self.d


def make_vllm_config(hq, hkv, d, dtype, max_len, workdir: Path):
    """``VllmConfig`` with a model config from a local Llama-shaped ``config.json`` (no network), or a stand-in."""
    from vllm.config import ModelConfig, VllmConfig

    dname = str(dtype).replace("torch.", "")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hq * d,
           "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d, "num_hidden_layers": 1,
           "intermediate_size": 4 * hq * d, "vocab_size": 32000, "max_position_embeddings": max_len,
           "torch_dtype": dname, "rms_norm_eps": 1e-5}
    try:
        mdir = workdir / "model"
        mdir.mkdir(parents=True, exist_ok=True)
        (mdir / "config.json").write_text(json.dumps(cfg))
        mc = ModelConfig(model=str(mdir), skip_tokenizer_init=True, dtype=dname, max_model_len=max_len)
        vc, how = VllmConfig(model_config=mc), "ModelConfig(local config.json)"
    except Exception as e:  # keep going with what the builders need
        print(f"ModelConfig failed ({type(e).__name__}: {str(e)[:300]}); using a stand-in model config")
        vc, how = VllmConfig(), f"stand-in ({type(e).__name__})"
        vc.model_config = _ModelConfigStandIn(hq, hkv, d, dtype)
    cc = vc.compilation_config
    if not getattr(cc, "cudagraph_capture_sizes", None):
        # an engine fills these in at start-up (TRITON_ATTN's builder picks its 2D/3D decode threshold from
        # them when decode graphs are on); use vLLM's default ladder
        cc.cudagraph_capture_sizes = [1, 2, 4] + list(range(8, 513, 8))
    return vc, how


class FakeLayer(torch.nn.Module):
    """The attributes of vLLM's ``Attention`` layer that the impls read (unit KV scales)."""

    def __init__(self, device):
        super().__init__()
        for n in ("q", "k", "v"):
            setattr(self, f"_{n}_scale", torch.ones((), dtype=torch.float32, device=device))
            setattr(self, f"_{n}_scale_float", 1.0)
        self.layer_name = LAYER_NAME


def backend_classes(peer_names) -> dict:
    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    out = {OURS: TileLangMusaBackend}
    if TRITON in peer_names:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        out[TRITON] = AttentionBackendEnum.TRITON_ATTN.get_class()
    return out


def kv_layout(backend_cls):
    """The layout vLLM would pick for a model whose only backend is ``backend_cls``."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    return get_supported_kv_cache_layouts([backend_cls])[0]


def alloc_kv_cache(layout, num_blocks, hkv, block_size, d, dtype, device) -> torch.Tensor:
    """Logical ``[blocks, kv_heads, block_size, 2*d]`` over storage in ``layout``'s physical order."""
    logical = (num_blocks, hkv, block_size, 2 * d)
    order = layout.layer_view_order  # physical position -> logical axis
    phys = torch.empty([logical[i] for i in order], dtype=dtype, device=device)
    return phys.permute([order.index(i) for i in range(4)])


@dataclass
class BackendSetup:
    name: str
    cls: type
    builder: object
    impl: object
    layout: object


def setup_backend(name, cls, block_size, hq, hkv, d, dtype, vllm_config, device) -> BackendSetup:
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not cls.supports_block_size(block_size):
        raise ValueError(f"{name} does not support block size {block_size} "
                         f"(kernel block sizes {cls.get_supported_kernel_block_sizes()})")
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=hkv, head_size=d, dtype=dtype)
    with set_current_vllm_config(vllm_config):
        builder = cls.get_builder_cls()(spec, [LAYER_NAME], vllm_config, device)
        impl = cls.get_impl_cls()(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv, alibi_slopes=None,
                                  sliding_window=None, kv_cache_dtype="auto")
    return BackendSetup(name, cls, builder, impl, kv_layout(cls))


# ---------------------------------------------------------------------------------------------- reference
def sdpa_reference(query, canon, batch: Batch, d, scale, out):
    """Plain-torch causal attention per request, K/V gathered from the canonical cache."""
    hq, hkv = query.shape[1], canon.shape[2]
    kc, vc = canon[..., :d], canon[..., d:]
    cu = 0
    for b, (p, n) in enumerate(zip(batch.prefix_lens, batch.q_lens)):
        L = p + n
        blocks = batch.block_table[b, : math.ceil(L / batch.block_size)].long().to(canon.device)
        k = kc[blocks].reshape(-1, hkv, d)[:L].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        v = vc[blocks].reshape(-1, hkv, d)[:L].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        q = query[cu: cu + n].transpose(0, 1)
        mask = torch.arange(L, device=q.device)[None, :] <= (p + torch.arange(n, device=q.device))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[cu: cu + n] = o.transpose(0, 1)
        cu += n
    return out


# ---------------------------------------------------------------------------------------------- timing
def graph_follows_inputs(g, fn, out, query):
    """Replay ``g`` on a new query into a NaN-poisoned output and compare with an eager call on the same
    input: catches graphs that missed a kernel (launched off the capture stream) or baked in host values."""
    query.copy_(torch.randn_like(query))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    fn()
    torch.cuda.synchronize()
    diff = max_abs_diff(replayed, out)
    scale = float(out.float().abs().max()) if out.numel() else 0.0
    return diff is not None and diff <= 0.02 * scale + 1e-6, diff


def max_abs_diff(a: torch.Tensor, b: torch.Tensor):
    """Largest |a - b| (None with a NaN/inf in either)."""
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    return float((a - b).abs().max()) if a.numel() else 0.0


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:500]}"


# ---------------------------------------------------------------------------------------------- one row
def run_row(case: Case, block_size: int, setups: dict, peer_names: list, args, hq, hkv, d, dtype, device,
            seed: int) -> dict:
    batch = layout_batch(case, block_size, seed)
    row = {
        "op": case.op, "desc": case.desc,
        "shape": shape_of(case, block_size, hq, hkv, d, dtype),
        "num_tokens": batch.num_tokens, "ours_ms": None, "peers": {}, "ratio": None, "max_abs_diff": None,
        "timing_mode": None, "eager_ms": {}, "graph_ms": {}, "errors": {},
    }
    scale = d ** -0.5
    gen = torch.Generator(device=device).manual_seed(seed)
    # one canonical cache [blocks, block_size, kv_heads, K|V]: random everywhere (slots past a sequence's end
    # hold finite junk, as in an engine), copied into every backend's own layout
    canon = torch.randn(batch.num_blocks, block_size, hkv, 2 * d, generator=gen, device=device, dtype=dtype)
    query = torch.randn(batch.num_tokens, hq, d, generator=gen, device=device, dtype=dtype)
    slots = batch.slot_mapping.to(device)
    new_kv = canon.view(-1, hkv, 2 * d)[slots]
    key, value = new_kv[..., :d].contiguous(), new_kv[..., d:].contiguous()
    cm = common_metadata(batch, device)
    layer = FakeLayer(device)

    fns, outs = {}, {}
    for name in [OURS] + peer_names:
        try:
            if name == SDPA_REF:
                out = torch.empty(batch.num_tokens, hq, d, device=device, dtype=dtype)
                fns[name] = (lambda out=out: sdpa_reference(query, canon, batch, d, scale, out))
            else:
                st = setups[name]
                if isinstance(st, str):
                    raise RuntimeError(f"setup failed: {st}")
                check_reorder(st.builder, batch)
                kv_cache = alloc_kv_cache(st.layout, batch.num_blocks, hkv, block_size, d, dtype, device)
                kv_cache.copy_(canon.transpose(1, 2))
                md = st.builder.build(0, cm)  # once per batch, not timed
                out = torch.full((batch.num_tokens, hq, d), float("nan"), device=device, dtype=dtype)
                fns[name] = (lambda st=st, kv=kv_cache, md=md, out=out:
                             st.impl.forward(layer, query, key, value, kv, md, out))
                row.setdefault("kv_layout", {})[name] = st.layout.name
            fns[name]()  # first call: compiles (TileLang / Triton JIT)
            if device.type == "cuda":
                torch.cuda.synchronize()
            outs[name] = out
        except Exception as e:
            row["errors"][name] = _err(e)
            traceback.print_exc(limit=4)
            fns.pop(name, None)

    # correctness before timing: ours vs every peer; max_abs_diff is against the first peer
    if OURS in outs:
        for p in peer_names:
            if p in outs:
                diff = row.setdefault("max_abs_diff_by_peer", {})[p] = max_abs_diff(outs[OURS], outs[p])
                if diff is None:
                    row["errors"][f"compare/{p}"] = "NaN/inf in an output"
        row["max_abs_diff"] = row.get("max_abs_diff_by_peer", {}).get(peer_names[0])
        # close: the tests' criterion, max |ours - peer| / (1 + |peer|) within the kernel bound of the dtype
        # (musa_attn_backend.testing.numeric), the first peer standing in for the reference
        tol = tolerance(dtype)
        if row["max_abs_diff"] is not None:
            row["max_error"] = max_error(outs[OURS], outs[peer_names[0]])
            row["close"] = row["max_error"] <= tol
            row["tol"] = tol

    for name, fn in fns.items():
        try:
            row["eager_ms"][name] = eager_ms(fn, args.warmup, args.rep, cuda=device.type == "cuda")
        except Exception as e:
            row["errors"][f"{name}/eager"] = _err(e)

    graphs_ok = device.type == "cuda" and not args.no_graph and len(fns) == 1 + len(peer_names)
    if graphs_ok:
        for name, fn in fns.items():
            try:
                g = capture_graph(fn)
                ok, diff = graph_follows_inputs(g, fn, outs[name], query)
                row.setdefault("graph_vs_eager_max_abs_diff", {})[name] = diff
                if not ok:
                    raise RuntimeError(f"graph replay does not match an eager call on new inputs (max diff {diff})")
                row["graph_ms"][name] = eager_ms(g.replay, args.warmup, args.rep)
                del g
            except Exception as e:
                row["errors"][f"{name}/graph"] = _err(e)
                graphs_ok = False
    names = [OURS] + peer_names
    if graphs_ok and all(n in row["graph_ms"] for n in names):
        row["timing_mode"], src = "cuda_graph", row["graph_ms"]
    else:
        row["timing_mode"], src = "eager", row["eager_ms"]
    row["ours_ms"] = src.get(OURS)
    row["peers"] = {p: src[p] for p in peer_names if p in src}
    if row["ours_ms"] and peer_names and peer_names[0] in row["peers"]:
        row["ratio"] = row["peers"][peer_names[0]] / row["ours_ms"]  # > 1: ours faster
    if not row["errors"]:
        del row["errors"]
    return row


# ---------------------------------------------------------------------------------------------- output
def versions() -> dict:
    out = {"torch": torch.__version__}
    for mod in ("tilelang", "vllm"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:
            out[mod] = f"unavailable ({type(e).__name__})"
    return out


def print_table(rows, peer):
    print(f"\n{'op':8s} {'batch':48s} {'pg':>3s} {'ours ms':>9s} {peer + ' ms':>18s} {'ratio':>6s} "
          f"{'max|diff|':>9s} {'timing':>10s}")
    fmt = lambda x, f: format(x, f) if isinstance(x, (int, float)) else "-"
    for r in rows:
        print(f"{r['op']:8s} {r['desc'][:48]:48s} {r['shape']['page_size']:3d} {fmt(r['ours_ms'], '9.4f')} "
              f"{fmt(r['peers'].get(peer), '18.4f')} {fmt(r['ratio'], '6.2f')} {fmt(r['max_abs_diff'], '9.2e')} "
              f"{r['timing_mode'] or '-':>10s}" + ("  ERR " + "; ".join(r["errors"]) if r.get("errors") else ""))


def triton_construct_check(hq, hkv, d, dtype, block_size, vllm_config, batch: Batch) -> str:
    """On a CPU: construct TRITON_ATTN's builder and impl and build metadata (its forward needs a GPU)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        st = setup_backend(TRITON, AttentionBackendEnum.TRITON_ATTN.get_class(), block_size, hq, hkv, d, dtype,
                           vllm_config, torch.device("cpu"))
        md = st.builder.build(0, common_metadata(batch, "cpu"))
        assert md.num_actual_tokens == batch.num_tokens and md.block_table.shape[0] == len(batch.q_lens)
        return f"ok (layout {st.layout.name}, seq_threshold_3D {md.seq_threshold_3D})"
    except Exception as e:
        return _err(e)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny shapes, ours vs a plain-torch SDPA reference (proves the vLLM plumbing)")
    ap.add_argument("--quick", action="store_true", help="fewer decode shapes")
    ap.add_argument("--ops", default="decode,prefill,mixed")
    ap.add_argument("--page-sizes", default=None, help="comma list (default 16,64)")
    ap.add_argument("--max-decode-tokens", type=int, default=MAX_DECODE_TOKENS)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rep", type=int, default=None)
    ap.add_argument("--no-graph", action="store_true", help="eager timing only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--interpret-triton", action="store_true",
                    help="with --smoke: also run TRITON_ATTN's kernels in Triton's CPU interpreter (slow; checks "
                         "its numerics against ours; needs a fresh process, as it sets TRITON_INTERPRET=1 and "
                         "CUDA_VISIBLE_DEVICES='' before vLLM is imported)")
    args = ap.parse_args(argv)
    if args.interpret_triton:
        if not args.smoke:
            ap.error("--interpret-triton goes with --smoke")
        if "vllm" in sys.modules:
            ap.error("--interpret-triton must start before vLLM is imported (run it as its own process)")
        os.environ["TRITON_INTERPRET"] = "1"
        # no GPU: vLLM keeps Triton enabled only with no visible devices declared (its lenient branch)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    page_sizes = [int(x) for x in (args.page_sizes or "16,64").split(",")]

    if args.smoke:
        device = torch.device("cpu")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM resolves its platform
        hq, hkv, d, dtype = 8, 2, 64, torch.float32
        cases, peer_names = smoke_cases(ops), ([TRITON, SDPA_REF] if args.interpret_triton else [SDPA_REF])
        args.warmup = 1 if args.warmup is None else args.warmup
        args.rep = 3 if args.rep is None else args.rep
    else:
        if not torch.cuda.is_available():
            print("bench_vllm_backend: needs a CUDA GPU (use --smoke on a CPU)", file=sys.stderr)
            return 2
        if os.environ.get("VLLM_TARGET_DEVICE", "cuda") != "cuda":
            print(f"warning: VLLM_TARGET_DEVICE={os.environ['VLLM_TARGET_DEVICE']}", file=sys.stderr)
        device = torch.device("cuda")
        hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
        cases, peer_names = gpu_cases(ops, args.quick, args.max_decode_tokens), [TRITON]
        args.warmup = 5 if args.warmup is None else args.warmup
        args.rep = 30 if args.rep is None else args.rep

    import vllm  # noqa: F401  (after VLLM_TARGET_DEVICE)

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-backend-{stamp}.json"
    max_len = max(1024, max(p + n for c in cases for n, p in c.reqs)) if cases else 1024
    max_len = 1 << (max_len - 1).bit_length()
    tmp = tempfile.TemporaryDirectory(prefix="bench_vllm_")
    vllm_config, model_config_kind = make_vllm_config(hq, hkv, d, dtype, max_len, Path(tmp.name))

    classes = backend_classes(peer_names)
    setups = {}  # (name, page size) -> BackendSetup or error string
    for ps in page_sizes:
        for name, cls in classes.items():
            try:
                setups[(name, ps)] = setup_backend(name, cls, ps, hq, hkv, d, dtype, vllm_config, device)
            except Exception as e:
                setups[(name, ps)] = _err(e)
                print(f"{name} setup (page {ps}) failed: {setups[(name, ps)]}")

    def describe(name):
        st = next((s for (n, _), s in setups.items() if n == name and not isinstance(s, str)), None)
        if st is None:
            return {"error": next((s for (n, _), s in setups.items() if n == name), None)}
        return {"class": f"{st.cls.__module__}.{st.cls.__qualname__}", "kv_layout": st.layout.name,
                "reorder_batch_threshold": getattr(st.builder, "reorder_batch_threshold", None),
                "cudagraph_support": st.builder.get_cudagraph_support(vllm_config, st.builder.kv_cache_spec).name}

    doc = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "commit": git_commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(), **versions(),
        "timing": {"method": "CUDA events" if device.type == "cuda" else "time.perf_counter",
                   "statistic": "median", "warmup": args.warmup, "rep": args.rep,
                   "unit": "ms per impl.forward call (one layer), metadata built once per batch outside",
                   "cuda_graph": "tried" if device.type == "cuda" and not args.no_graph else "off",
                   "headline": "graph replays where both backends captured, else eager for both (row timing_mode)"},
        "mode": "smoke" if args.smoke else "gpu",
        "config": {"heads_q": hq, "heads_kv": hkv, "head_dim": d, "dtype": str(dtype).replace("torch.", ""),
                   "page_sizes": page_sizes, "model_config": model_config_kind, "peers": peer_names,
                   "backends": {n: describe(n) for n in classes}},
        "rows": [],
    }
    if args.interpret_triton:
        doc["mode"] = "smoke+triton_interpreter"
    if args.smoke and cases:
        doc["checks"] = {"TRITON_ATTN_cpu_construct": triton_construct_check(
            hq, hkv, d, dtype, page_sizes[0], vllm_config, layout_batch(cases[-1], page_sizes[0], args.seed))}
        print(f"TRITON_ATTN on CPU (builder, impl, build): {doc['checks']['TRITON_ATTN_cpu_construct']}")

    def save():
        path.write_text(json.dumps(doc, indent=1))

    save()
    for ps in page_sizes:
        row_setups = {name: setups[(name, ps)] for name in classes}
        for i, case in enumerate(cases):
            print(f"[page {ps}] {case.op}: {case.desc}", flush=True)
            try:
                row = run_row(case, ps, row_setups, peer_names, args, hq, hkv, d, dtype, device, args.seed + i)
            except Exception as e:
                traceback.print_exc(limit=6)
                row = {"op": case.op, "desc": case.desc,
                       "shape": shape_of(case, ps, hq, hkv, d, dtype),
                       "ours_ms": None, "peers": {}, "ratio": None, "max_abs_diff": None, "timing_mode": None,
                       "errors": {"row": _err(e)}}
            doc["rows"].append(row)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(doc["rows"], peer_names[0])
    print(f"wrote {path}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
