"""Our vLLM DeepSeek-V4 layer (:class:`musa_attn_backend.vllm.dsv4.MusaDeepseekV4Attention`) against the independent
float32 V4 forward (``integration_tests/dsv4_reference.py``), run as ``python -m
musa_attn_backend.testing.vllm_dsv4_layer OUT.json [cpu|cuda]`` in a fresh interpreter.

The tiny V4 (ratios 0/4/128/4, 8 heads) with ``index_topk`` 16, so the indexer scores from 68 tokens on. Each
layer is built by vLLM's own constructor path, its weights are the reference checkpoint's (DeepSeek's names
mapped as vLLM's loader maps them), its caches are planned, allocated and bound by vLLM's functions into one
buffer of random bytes (every row nobody should read is noise, NaN included). Three requests (150, 333 and 37
tokens) go through five steps: chunked prefills, a mixed prefill and decode step, decode steps, one request
running two query tokens (a speculative-decoding verify step). The attention input is random.

Reported, per layer: the output of every query token against the reference's ``_attention`` over the whole
sequence (the reference fed the indexer choices our layer made, recorded from the shared top-k buffer, so the
comparison is of attention alone), and the indexer's choices against the reference's own (the Hadamard rotation
left out of the reference, as vLLM leaves it out: it changes only the FP8 rounding).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = [  # (requests, start positions, query lengths)
    ([0, 1, 2], [0, 0, 0], [60, 200, 37]),
    ([0, 1], [60, 200], [90, 133]),
    ([2, 0, 1], [37, 150, 333], [1, 1, 1]),
    ([0, 1, 2], [151, 334, 38], [1, 2, 1]),
    ([1, 2], [336, 39], [1, 1]),
]
TOPK = 16


def main(out_path: str, device: str = "cpu", trace: str = "", block_size: str = "", graphs: str = "") -> None:
    """``trace``: comma-separated compile targets (a CPU run only): the kernels the layer's TileLang paths ask for on
    each (:func:`musa_attn_backend.testing.kernel_trace.tracing`) go into the report's ``kernels``. ``block_size``:
    ``cache_config.block_size`` forced to this after the engine config is made (MUSA's vLLM forces 64 for V4 models
    in its platform's config check, after the backend is chosen); the report gets the bound caches' views.
    ``graphs`` (a GPU run): after the steps, decode rounds of the three requests captured once in a CUDA graph and
    replayed over new positions, lengths and block tables, each against an eager run from the same cache state
    (:func:`graph_rounds`; the report's ``graph_rounds``)."""
    if device == "cpu":
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT / "integration_tests"))
    import torch

    from musa_attn_backend.testing import vllm_dsv4 as fx
    from musa_attn_backend.testing.kernel_trace import tracing

    if device != "cpu":
        fx.skip_v4_package_init()

    import dsv4_reference as ref_mod
    from tiny_dsv4 import CONFIG
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from musa_attn_backend.vllm.dsv4 import MusaDeepseekV4Attention, MusaV4MetadataBuilder

    config = dict(CONFIG, index_topk=TOPK)
    weights = ref_mod.checkpoint(config, seed=3)
    vc = fx.engine_config(config)
    if block_size:
        vc.cache_config.block_size = int(block_size)
    dev = torch.device(device)
    n_layers = config["num_hidden_layers"]
    with set_current_vllm_config(vc):
        fx.init_distributed()
        topk_buf = torch.full((vc.scheduler_config.max_num_batched_tokens, TOPK), -7, dtype=torch.int32, device=dev)
        layers = {}
        with torch.device(dev), set_default_torch_dtype(vc.model_config.dtype):
            for i in range(n_layers):
                layers[i] = MusaDeepseekV4Attention(vc, prefix=f"model.layers.{i}.attn", topk_indices_buffer=topk_buf)
        for i, layer in layers.items():
            load(layer, weights, i, dev)
        named = {}
        for i, layer in layers.items():
            for m in layer.modules():  # the layer and its SWA, indexer-key and compressor-state caches
                if hasattr(m, "get_kv_cache_spec") and hasattr(m, "get_attn_backend"):
                    named[m.prefix] = m
        caches = fx.allocate(vc, named, device)
        views = {n: [list(m.kv_cache.shape), list(m.kv_cache.stride())] for n, m in named.items()}
        groups = [[spec.block_size, names] for spec, names, _ in caches.groups]
        g = torch.Generator().manual_seed(0)
        caches.buffer.copy_(torch.randint(0, 256, caches.buffer.shape, dtype=torch.uint8, generator=g))
        builders = [MusaV4MetadataBuilder(spec, names, vc, dev) for spec, names, _ in caches.groups]
        sched = fx.Scheduler(caches, max_blocks=vc.model_config.max_model_len // 4 + 1, seed=1)

        lens = {r: max(s + n for rs, ss, ns in STEPS for rr, s, n in zip(rs, ss, ns) if rr == r) for r in range(3)}
        xs = {r: (torch.randn(n, config["hidden_size"], generator=g) * 0.5).to(torch.bfloat16) for r, n in lens.items()}
        outs = {i: {r: torch.full((n, config["hidden_size"]), float("nan")) for r, n in lens.items()}
                for i in layers}
        chosen = {i: {r: torch.full((n, TOPK), -9, dtype=torch.int32) for r, n in lens.items()} for i in layers}
        traced = tracing(trace.split(",")) if trace else contextlib.nullcontext()
        with traced as kernels:
            ptrs = run_steps(sched, caches, builders, layers, vc, xs, outs, chosen, topk_buf, dev)
        rounds = graph_rounds(sched, caches, builders, layers, vc, config, dev) if graphs else None

    ref_mod.hadamard = lambda x: x  # vLLM's indexer rotates neither queries nor keys
    report = {"device": device, "layers": {}, "block_size": vc.cache_config.block_size, "views": views,
              "groups": groups,
              # the builders' CUDA-graph declarations, and whether every step's metadata tensors the builders make
              # (requests, positions, compressed write slots) lived at the same addresses
              "cudagraph_support": [type(b).get_cudagraph_support(vc, spec).name
                                    for b, (spec, _, _) in zip(builders, caches.groups)],
              "persistent_metadata": all(len(set(p)) == 1 for p in ptrs.values())}
    if trace:
        report["kernels"] = {t: [repr(k) for k in kernels.unique(t)] for t in kernels.keys}
    if rounds is not None:
        report["graph_rounds"] = rounds
    from musa_attn_backend import _tilelang

    # on a GPU: the kernels this run compiled that the kernel cache did not hold (after a warmup: none)
    report["cold_compiles"] = [repr(k) for k in _tilelang.cold_compiles]
    for i in layers:
        rows = []
        for r in lens:
            x = xs[r].float()
            reference = ref_mod.Reference(config, weights)
            own = reference._indexer
            picked = {}

            def indexer(xx, qr, ang, prefix, _r=r, _i=i):
                theirs = own(xx, qr, ang, prefix)
                picked["theirs"] = theirs
                mine = chosen[_i][_r].long()
                return torch.where(mine >= 0, mine, -1)

            reference._indexer = indexer
            want = reference._attention(x, i)
            got = outs[i][r]
            err = (got - want).abs()
            scale = want.abs().mean().item()
            row = {"request": r, "tokens": x.shape[0], "finite": bool(torch.isfinite(got).all()),
                   "max_err": err.max().item() / scale, "mean_err": err.mean().item() / scale}
            if "theirs" in picked:
                overlap = []
                for t in range(x.shape[0]):
                    a = set(picked["theirs"][t][picked["theirs"][t] >= 0].tolist())
                    b = set(chosen[i][r][t][chosen[i][r][t] >= 0].tolist())
                    overlap.append(1.0 if not a and not b else len(a & b) / max(len(a), 1))
                    if len(b) != len(a):
                        overlap[-1] = 0.0
                row["topk_overlap_mean"] = sum(overlap) / len(overlap)
                row["topk_overlap_min"] = min(overlap)
                row["scored_tokens"] = sum(1 for t in range(x.shape[0]) if (t + 1) // 4 > TOPK)
            rows.append(row)
        report["layers"][str(i)] = rows
    Path(out_path).write_text(json.dumps(report, indent=1))


GRAPH_ROUNDS = 4  # decode rounds replayed on one captured graph


def graph_rounds(sched, caches, builders, layers, vc, config, dev) -> list:
    """Decode rounds of requests 0-2 (one query token each, continuing where :data:`STEPS` left them) run through
    every layer from one CUDA graph, as vLLM's full decode graphs run them: the common metadata in tensors made once
    (query starts, lengths, each group's block table and slot mapping, positions), the builders writing their
    metadata into their own buffers, ``max_seq_len`` = ``max_model_len`` at capture. Each round's replay output
    is compared with an eager run of the same round from the same cache bytes (the cache is restored between the
    two). Returns per round the largest |replay - eager| over the mean |eager|, and whether both are finite."""
    import torch
    from vllm.forward_context import set_forward_context

    reqs = [0, 1, 2]
    ends = {r: max(s + n for rs, ss, ns in STEPS for rr, s, n in zip(rs, ss, ns) if rr == r) for r in reqs}
    B = T = len(reqs)
    g = torch.Generator().manual_seed(11)

    def common(starts, cms_src, max_seq_len, static=None):
        """The step's common metadata per group; with ``static``, copied into its tensors (a replay's inputs)."""
        if static is None:
            return [dataclass_replace(cm, max_seq_len=max_seq_len) for cm in cms_src]
        for st, cm in zip(static, cms_src):
            for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions"):
                getattr(st, name).copy_(getattr(cm, name))
        return static

    def metadata(cms):
        md = {}
        for (spec, names, _), b, cm in zip(caches.groups, builders, cms):
            built = b.build(0, cm)
            md.update({n: built for n in names})
        return md

    def forward(md, h, pos):
        outs = []
        for _, layer in sorted(layers.items()):
            with set_forward_context(md, vc):
                outs.append(layer(pos, h).float())
        return torch.stack(outs)

    starts = [ends[r] for r in reqs]
    cms, pos = sched.step(reqs, starts, [1] * B, dev)
    static = [dataclass_replace(cm, max_seq_len=vc.model_config.max_model_len, query_start_loc=cm.query_start_loc.clone(),
                                seq_lens=cm.seq_lens.clone(), block_table_tensor=cm.block_table_tensor.clone(),
                                slot_mapping=cm.slot_mapping.clone(), positions=cm.positions.clone())
              for cm in cms]
    h_static = torch.zeros(T, config["hidden_size"], dtype=torch.bfloat16, device=dev)
    pos_static = static[0].positions
    md = metadata(static)
    saved = caches.buffer.clone()
    forward(md, h_static, pos_static)  # warm-up: every kernel compiled, lazily made tables in place
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = forward(md, h_static, pos_static)
    caches.buffer.copy_(saved)
    rounds = []
    for k in range(GRAPH_ROUNDS):
        if k:
            starts = [s + 1 for s in starts]
            cms, pos = sched.step(reqs, starts, [1] * B, dev)  # new lengths, positions, perhaps new blocks
        h = (torch.randn(T, config["hidden_size"], generator=g) * 0.5).to(torch.bfloat16).to(dev)
        before = caches.buffer.clone()
        common(starts, cms, None, static)
        metadata(static)  # the builders write this round's metadata into the buffers the graph reads
        h_static.copy_(h)
        graph.replay()
        replayed = out_static.clone()
        after_replay = caches.buffer.clone()
        caches.buffer.copy_(before)
        eager = forward(metadata(common(starts, cms, int(cms[0].seq_lens.max()))), h, pos)
        same_cache = bool(torch.equal(caches.buffer, after_replay))
        scale = eager.abs().mean().item()
        rounds.append({"round": k, "finite": bool(torch.isfinite(replayed).all() and torch.isfinite(eager).all()),
                       "max_rel_diff": (replayed - eager).abs().max().item() / scale, "cache_bytes_same": same_cache})
    return rounds


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def run_steps(sched, caches, builders, layers, vc, xs, outs, chosen, topk_buf, dev) -> None:
    """The :data:`STEPS` through every layer: each layer's output rows into ``outs``, the C4 layers' top-k choices
    into ``chosen``."""
    import torch
    from vllm.forward_context import set_forward_context

    ptrs = {}
    for reqs, starts, qlens in STEPS:
        cms, pos = sched.step(reqs, starts, qlens, dev)
        md = {}
        for gi, ((spec, names, _), b, cm) in enumerate(zip(caches.groups, builders, cms)):
            built = b.build(0, cm)
            md.update({n: built for n in names})
            for field in ("token_to_req_indices", "positions") + (("slot_mapping",) if b.compress_ratio > 1 else ()):
                ptrs.setdefault((gi, field), []).append(getattr(built, field).data_ptr())
        h = torch.cat([xs[r][s:s + n] for r, s, n in zip(reqs, starts, qlens)]).to(dev)
        for i, layer in layers.items():
            with set_forward_context(md, vc):
                y = layer(pos, h).float().cpu()
            at = 0
            for r, s, n in zip(reqs, starts, qlens):
                outs[i][r][s:s + n] = y[at:at + n]
                if layer.compress_ratio == 4:
                    chosen[i][r][s:s + n] = topk_buf[at:at + n].cpu()
                at += n
    return ptrs


def load(layer, w: dict, i: int, dev) -> None:
    """The reference checkpoint's tensors of layer ``i`` into our vLLM layer, as vLLM's loader maps them."""
    import torch

    a = f"layers.{i}.attn."

    def put(param, value):
        param.data.copy_(value.to(param.dtype).to(dev))

    put(layer.fused_wqa_wkv.weight, torch.cat([w[a + "wq_a.weight"], w[a + "wkv.weight"]]))
    put(layer.q_norm.weight, w[a + "q_norm.weight"])
    put(layer.kv_norm.weight, w[a + "kv_norm.weight"])
    put(layer.wq_b.weight, w[a + "wq_b.weight"])
    put(layer.wo_a.weight, w[a + "wo_a.weight"])
    put(layer.wo_b.weight, w[a + "wo_b.weight"])
    layer.attn_sink.data[:layer.n_local_heads] = w[a + "attn_sink"].to(dev)
    comps = [(layer.compressor, a + "compressor.")] if layer.compressor is not None else []
    if layer.indexer is not None:
        comps.append((layer.indexer.compressor, a + "indexer.compressor."))
        put(layer.indexer.wq_b.weight, w[a + "indexer.wq_b.weight"])
        put(layer.indexer.weights_proj.weight, w[a + "indexer.weights_proj.weight"])
    for c, p in comps:
        put(c.ape, w[p + "ape"])
        put(c.fused_wkv_wgate.weight, torch.cat([w[p + "wkv.weight"], w[p + "wgate.weight"]]))
        put(c.norm.weight, w[p + "norm.weight"])
    for m in layer.modules():  # as the loader finishes every quantisable module
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    layer.process_weights_after_loading(torch.bfloat16)


if __name__ == "__main__":
    main(*sys.argv[1:])
