"""The README's performance table, generated from the newest benchmark results.

    python benchmarks/perf_table.py            # print the table
    python scripts/update_readme.py [--check]  # write it into the README (check: fail if the README is stale)

The newest ``benchmarks/results/attention-*.json`` with prefill rows gives the prefill lines, the newest with
decode rows the decode lines (a run may hold one kind only). Each line: our time, the fastest peer measured in
the same run and the ratio (peer time / ours: above 1 means faster than that peer), and the fraction of the
roofline that run measured (its bf16 matmul rate for prefill, its copy bandwidth for decode). CI checks that
the README holds exactly this table, so it cannot drift from the results it cites.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# (label, shape filter, which time): the lines of the table, in order. "fresh" is the default path of a prefill
# without cached prefixes (keys from the batch's new K/V, whatever the page size): the bench times it once per
# page-size row, and the line takes the median of those timings of the one kernel. "page N" reads a paged
# cache with shuffled pages, as an extend with a cached prefix does.
PREFILL_LINES = [
    ("causal 4k, fresh", dict(seqlen_q=4096, causal=True), "ours_new_kv_ms"),
    ("causal 8k, fresh", dict(seqlen_q=8192, causal=True), "ours_new_kv_ms"),
    ("causal 16k, fresh", dict(seqlen_q=16384, causal=True), "ours_new_kv_ms"),
    ("causal 16k, page 1", dict(seqlen_q=16384, causal=True, page_size=1), "ours_ms"),
    ("causal 16k, page 64", dict(seqlen_q=16384, causal=True, page_size=64), "ours_ms"),
    ("non-causal 16k, fresh", dict(seqlen_q=16384, causal=False), "ours_new_kv_ms"),
]
DECODE_LINES = [
    ("batch 1, 4k keys, page 1", dict(batch=1, seqlen_k=4096, page_size=1)),
    ("batch 1, 32k keys, page 1", dict(batch=1, seqlen_k=32768, page_size=1)),
    ("batch 8, 32k keys, page 1", dict(batch=8, seqlen_k=32768, page_size=1)),
    ("batch 32, 16k keys, page 1", dict(batch=32, seqlen_k=16384, page_size=1)),
    ("batch 128, 32k keys, page 64", dict(batch=128, seqlen_k=32768, page_size=64)),
    ("batch 256, 4k keys, page 1", dict(batch=256, seqlen_k=4096, page_size=1)),
]


def newest(op: str, results: Path = RESULTS) -> Optional[tuple[Path, dict]]:
    """The newest attention run (by the UTC stamp in its name) with rows of ``op``."""
    for path in sorted(results.glob("attention-*.json"), reverse=True):
        doc = json.loads(path.read_text())
        if any(r.get("op") == op for r in doc.get("rows", [])):
            return path, doc
    return None


def _rows(doc: dict, op: str, want: dict) -> list[dict]:
    return [r for r in doc["rows"] if r.get("op") == op and all(r["shape"].get(k) == v for k, v in want.items())]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _flops(shape: dict) -> float:
    """Matmul FLOPs of one prefill (Q K^T and P V), halved for a causal square one (as the bench counts)."""
    f = 4.0 * shape["batch"] * shape["heads_q"] * shape["seqlen_q"] * shape["seqlen_k"] * shape["head_dim"]
    return f / 2 if shape["causal"] and shape["seqlen_q"] == shape["seqlen_k"] else f


def _fmt_ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} µs" if ms < 0.1 else f"{ms:.3f} ms"


def _line(label: str, ours_ms: float, peers: dict, rate: str, roofline: float) -> str:
    name, peer_ms = min(peers.items(), key=lambda kv: kv[1])
    return (f"| {label} | {_fmt_ms(ours_ms)} ({rate}) | {name} {_fmt_ms(peer_ms)} | {peer_ms / ours_ms:.2f}x | "
            f"{roofline:.0%} |")


def table(results: Path = RESULTS) -> str:
    """The markdown table (with the runs it comes from) for the README."""
    lines, sources = [], []
    head = ["| op, shape | ours | fastest peer, same run | peer / ours | of roofline |", "|---|---|---|---|---|"]
    found = newest("prefill", results)
    if found:
        path, doc = found
        sources.append(f"prefill `{path.relative_to(ROOT)}` (commit {doc['commit'][:7]}, {doc['date'][:10]})")
        ceiling = doc["ceilings"]["bf16_matmul_tflops"]
        for label, want, key in PREFILL_LINES:
            rows = [r for r in _rows(doc, "prefill", want) if r.get(key) is not None]
            if not rows:
                continue
            ms = _median([r[key] for r in rows])
            tflops = _flops(rows[0]["shape"]) / (ms * 1e-3) / 1e12
            # peers on contiguous K/V, the same in every page-size row (flex_paged reads our paged pool)
            peers = {k: v for k, v in rows[0]["peers"].items() if k != "flex_paged"}
            lines.append(_line(f"prefill {label}", ms, peers, f"{tflops:.0f} TFLOP/s", tflops / ceiling))
    found = newest("decode", results)
    if found:
        path, doc = found
        sources.append(f"decode `{path.relative_to(ROOT)}` (commit {doc['commit'][:7]}, {doc['date'][:10]})")
        ceiling = doc["ceilings"]["copy_tbps"]
        for label, want in DECODE_LINES:
            rows = _rows(doc, "decode", want)
            if not rows:
                continue
            r = rows[0]
            tbps = r["gbps"] / 1e3
            lines.append(_line(f"decode {label}", r["ours_ms"], r["peers"], f"{tbps:.2f} TB/s K+V", tbps / ceiling))
    if not lines:
        return "No benchmark results yet (`benchmarks/results/attention-*.json`)."
    shape = "H200, bf16, 32 query / 8 KV heads, head dim 128, one sequence for prefill; from " + "; ".join(sources)
    return "\n".join([shape + ".", "", *head, *lines])


# DeepSeek-V4 and MoE against DeepSeek's own kernels (and tile-kernels for the model-side ops), each from the newest
# run of its bench that timed that peer: attention (label, row filter, op[, our time's key]), MoE (label, op, T, our
# key, peer), the indexer and model-side ops (label, op, row filter)
V4_ATTENTION_LINES = [
    ("V4 sparse decode, Flash, batch 1", dict(config="flash", tokens=1, s_q=1), "decode"),
    ("V4 sparse decode, Flash, batch 32", dict(config="flash", tokens=32, s_q=1), "decode"),
    ("V4 sparse decode, Flash, batch 128", dict(config="flash", tokens=128, s_q=1), "decode"),
    ("V4 sparse decode, Pro, batch 1", dict(config="pro", tokens=1, s_q=1), "decode"),
    ("V4 sparse decode, Pro, batch 64", dict(config="pro", tokens=64, s_q=1), "decode"),
    ("V4 sparse decode, Pro, batch 64, MTP 2", dict(config="pro", tokens=128, s_q=2), "decode"),
    ("V4 sparse prefill, Flash, 4k tokens", dict(config="flash", tokens=4096), "prefill"),
    ("V4 sparse prefill, Pro, 4k tokens", dict(config="pro", tokens=4096), "prefill"),
    # FlashMLA's prefill entry (our paired_ws program) on FlashMLA's own bf16 rows and lists: kernel against kernel
    ("V4 prefill on FlashMLA's bf16 rows, Flash, 4k", dict(config="flash", tokens=4096), "prefill",
     "paired_ws_on_flashmla_inputs_ms"),
    ("V4 prefill on FlashMLA's bf16 rows, Pro, 4k", dict(config="pro", tokens=4096), "prefill",
     "paired_ws_on_flashmla_inputs_ms"),
]
# scripts/ws_variants.py's runs: our kernels alone on FlashMLA's own bf16 rows and lists beside FlashMLA's call, both
# replayed from CUDA graphs (label, config, our key: "default" is paired_ws's default build); these lines replace
# the attention bench's lines of the same label, and take their roofline from its prefill row of that shape
WS_LINES = [
    ("V4 prefill on FlashMLA's bf16 rows, Flash, 4k", "flash", "default"),
    ("V4 prefill on FlashMLA's bf16 rows, Pro, 4k", "pro", "default"),
    # what MUSA runs (portable_ws in MUSA's form), on the same inputs
    ("V4 prefill, MUSA's form, Flash, 4k", "flash", "portable_ws_musa_kernel_ms"),
    ("V4 prefill, MUSA's form, Pro, 4k", "pro", "portable_ws_musa_kernel_ms"),
]
MOE_LINES = [  # (label, op, T, our key, DeepGEMM's peer)
    ("MoE gate_up, Flash, T 64, masked", "moe_gate_up", 64, "ours_masked_ms", "deepgemm_masked"),
    ("MoE gate_up, Flash, T 4096", "moe_gate_up", 4096, "ours_ms", "deepgemm"),
    ("MoE gate_up, Flash, T 16384", "moe_gate_up", 16384, "ours_ms", "deepgemm"),
    ("MoE down, Flash, T 16384", "moe_down", 16384, "ours_ms", "deepgemm"),
]
INDEXER_LINES = [
    ("V4 indexer, paged, batch 1, 2k keys", "logits_paged", dict(batch=1, keys=2048)),
    ("V4 indexer, paged, batch 128, 16k keys", "logits_paged", dict(batch=128, keys=16384)),
    ("V4 indexer, prefill causal, 4k x 16k", "logits_prefill", dict(tokens=4096, keys=16384, mode="causal")),
]
MODEL_LINES = [
    ("V4 RoPE inverse, 4k tokens x 64 heads", "rope_inverse", dict(T=4096, heads=64)),
    ("V4 mHC pre, 4k tokens, hidden 7168", "mhc_pre", dict(T=4096, hidden=7168)),
    ("V4 clamped SwiGLU, 4k tokens, I 3072", "swiglu_clamp", dict(T=4096, I=3072)),
]


def newest_with(pattern: str, peer: str, results: Path = RESULTS) -> Optional[tuple[Path, dict]]:
    """The newest run of ``pattern`` (by the UTC stamp in its name) with a row that timed ``peer``."""
    for path in sorted(results.glob(pattern), reverse=True):
        doc = json.loads(path.read_text())
        if any(isinstance(r.get("peers", {}).get(peer), (int, float)) or "ms" in (r.get("peers", {}).get(peer) or {})
               for r in doc.get("rows", [])):
            return path, doc
    return None


def _peer_ms(row: dict, peer: str) -> Optional[float]:
    v = row.get("peers", {}).get(peer)
    return v if isinstance(v, (int, float)) else (v or {}).get("ms")


def _match(row: dict, want: dict) -> bool:
    return all(row["shape"].get(k) == v for k, v in want.items())


def dsv4_table(results: Path = RESULTS) -> str:
    """The DeepSeek-V4 and MoE table: ours against FlashMLA, DeepGEMM and tile-kernels, each ratio within one run."""
    lines, sources = [], []
    head = ["| op, shape | ours | DeepSeek's kernel, same run | peer / ours | of roofline |", "|---|---|---|---|---|"]

    def add(label, ours_ms, peer_name, peer_ms, roofline_ms):
        if ours_ms and peer_ms:
            lines.append(f"| {label} | {_fmt_ms(ours_ms)} | {peer_name} {_fmt_ms(peer_ms)} | {peer_ms / ours_ms:.2f}x "
                         f"| {roofline_ms / ours_ms:.0%} |")

    def source(path, doc):
        sources.append(f"`{path.name}` ({doc['device'].replace('NVIDIA ', '')}, commit {doc['commit'][:7]}, "
                       f"{doc['date'][:10]})")

    def attention(doc):  # the scheduled program (the default on Hopper) where the run timed it beside its own; a
        # line naming a key: that time (the same work, so the same roofline)
        for label, want, op, *key in V4_ATTENTION_LINES:
            for r in (r for r in doc["rows"] if r.get("op") == op and _match(r, want)):
                ours = r.get(key[0]) if key else r.get("scheduled_ms") or r["ours_ms"]
                yield label, ours, _peer_ms(r, "flashmla"), r["roofline_frac"] * r["ours_ms"]

    def moe(doc):
        for label, op, T, key, peer in MOE_LINES:
            for r in (r for r in doc["rows"] if r.get("op") == op and r["shape"].get("T") == T):
                yield label, r.get(key), _peer_ms(r, peer), r["roofline_ms"]

    def rows_of(lines_spec, peer):
        def gen(doc):
            for label, op, want in lines_spec:
                for r in (r for r in doc["rows"] if r.get("op") == op and _match(r, want)):
                    yield label, r["ours_ms"], _peer_ms(r, peer), r["roofline_frac"] * r["ours_ms"]
        return gen

    families = [("dsv4-attention-*.json", "flashmla", "FlashMLA", attention, V4_ATTENTION_LINES),
                ("moe-*.json", "deepgemm", "DeepGEMM", moe, MOE_LINES),
                ("dsv4-indexer-*.json", "deepgemm", "DeepGEMM", rows_of(INDEXER_LINES, "deepgemm"), INDEXER_LINES),
                ("dsv4-model-*.json", "tile_kernels", "tile-kernels", rows_of(MODEL_LINES, "tile_kernels"),
                 MODEL_LINES)]
    for pattern, peer, peer_label, rows, spec in families:
        # each line from the newest run that timed it beside the peer (a quick run leaves the others' lines as
        # the last full run measured them; every run a line comes from is named)
        found = newest_lines(results, pattern, rows, len(spec), source)
        for label, *_ in spec:
            if label in found:
                add(label, found[label][0], peer_label, found[label][1], found[label][2])
    ws_lines(results, lines, add, source)
    if not lines:
        return "No DeepSeek-V4 results with DeepSeek's kernels beside ours yet."
    note = ("Kernel times (CUDA-graph replays), identical inputs for both sides, outputs compared in the same run; "
            "each line from the newest run that timed it: " + "; ".join(sources) + ".")
    return "\n".join([note, "", *head, *lines])


def newest_lines(results: Path, pattern: str, rows, count: int, source) -> dict:
    """``{label: (ours, peer, roofline ms)}``: each line from the newest run of ``pattern`` whose ``rows(doc)``
    (``(label, ours, peer, roofline)`` tuples) gives it with every value, runs read newest first until ``count``
    lines are found (a quick run leaves the others' lines as the last full run measured them); ``source(path,
    doc)`` is called for every run a line comes from."""
    found = {}
    for path in sorted(results.glob(pattern), reverse=True):
        doc = json.loads(path.read_text())
        fresh = {label: (ours, peer, roof) for label, ours, peer, roof in rows(doc)
                 if label not in found and ours and peer and roof}
        if fresh:
            found.update(fresh)
            source(path, doc)
        if len(found) == count:
            break
    return found


def ws_lines(results: Path, lines: list, add, source) -> None:
    """:data:`WS_LINES` from the newest ``ws-variants-*.json`` that has each (the line of the same label from the
    attention bench replaced), their rooflines from the newest attention bench's prefill row of the shape."""
    roofline = {}
    for path in sorted(results.glob("dsv4-attention-*.json"), reverse=True):
        for r in json.loads(path.read_text())["rows"]:
            if r.get("op") == "prefill" and r.get("roofline_frac"):
                roofline.setdefault((r["shape"]["config"], r["shape"]["tokens"]), r["roofline_frac"] * r["ours_ms"])

    def rows(doc):
        for label, config, key in WS_LINES:
            for r in (r for r in doc["rows"] if r["shape"].get("config") == config and r.get("flashmla_graph_ms")):
                k = f"{r.get('default_variant', r.get('first_variant'))}_kernel_ms" if key == "default" else key
                yield label, r.get(k), r["flashmla_graph_ms"], roofline.get((config, r["shape"]["tokens"]))

    found = newest_lines(results, "ws-variants-*.json", rows, len(WS_LINES), source)
    for label, *_ in WS_LINES:
        if label in found:
            add(label, found[label][0], "FlashMLA", found[label][1], found[label][2])
            line = lines.pop()
            at = [i for i, old in enumerate(lines) if old.startswith(f"| {label} |")]
            if at:  # in place of the attention bench's line
                lines[at[0]] = line
            else:  # after the V4 attention lines
                lines.insert(max(i for i, old in enumerate(lines) if old.startswith("| V4 sp") or
                                 old.startswith("| V4 prefill")) + 1, line)


def serve_table(results: Path = RESULTS) -> str:
    """The V4-Flash-sized serving run (``bench_serve_dsv4.py``), the newest: one line a batch, its contexts side by
    side (each cell ``4k / 16k / 32k`` where the run has those contexts)."""
    runs = sorted(results.glob("serve-dsv4-*.json"), reverse=True)
    if not runs:
        return "No V4 serving run yet."
    doc = json.loads(runs[0].read_text())
    m = doc["model"]
    lines = [f"`{runs[0].name}` ({doc['device'].replace('NVIDIA ', '')}, commit {doc['commit'][:7]}, "
             f"{doc['date'][:10]}): {doc['engine']}, V4-Flash dimensions, {m['layers']} layers (compress ratios "
             f"{', '.join(map(str, m['compress_ratios']))}), {m['quant']} weights, graphs {doc['graphs']}, TP "
             f"{doc['tp']}; attention, indexer, compressors, writers and MoE experts ours, vLLM's linear layers and "
             f"mHC; a decode step's kernels summed by the profiler. "
             + (f"Rows after one untimed request ({doc['first_request_s']:.1f} s)." if "first_request_s" in doc
                else "The first row includes compiling what the warmup missed."), "",
    ]
    contexts = sorted({r["context"] for r in doc["rows"]})
    by = {(r["batch"], r["context"]): r for r in doc["rows"]}
    ctx = " / ".join(f"{c // 1024}k" for c in contexts)
    lines += [f"| batch | TTFT, ms ({ctx}) | decode step, ms | decode tok/s | kernels a step, ms |",
              "|---|---|---|---|---|"]

    def cells(batch, fmt, key):
        return " / ".join(fmt.format(by[(batch, c)][key]) if (batch, c) in by and by[(batch, c)].get(key) else "-"
                          for c in contexts)

    for b in sorted({r["batch"] for r in doc["rows"]}):
        lines.append(f"| {b} | {cells(b, '{:.0f}', 'ttft_ms')} | {cells(b, '{:.2f}', 'decode_step_ms')} | "
                     f"{cells(b, '{:,.0f}', 'decode_tok_s')} | {cells(b, '{:.2f}', 'kernel_ms')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    results = ap.parse_args(argv).results
    print(table(results) + "\n\n" + dsv4_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
