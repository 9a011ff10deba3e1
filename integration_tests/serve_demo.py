"""The main job's serving demo: SGLang serves a tiny locally built Llama with ``--attention-backend
tilelang_musa`` and, side by side, the same model on SGLang's ``torch_native`` backend; both answer the same
batch of greedy requests over HTTP. Prints each backend's tokens/s (median of the rounds, with min..max), the
ratio tilelang_musa / torch_native (of the medians, and the median of the per-round ratios) and the token
agreement. Exit code 1 on any disagreement.

    python integration_tests/serve_demo.py [--requests 16] [--max-new-tokens 64] [--rounds 5] [--out DIR]

The measurement is made to survive a small, shared machine: both servers start once and run at the same time
(on different ports), each gets a warm-up batch, then the timed rounds alternate between them (A, B, B, A,
A, B, ...) so that load from elsewhere falls on both alike, and the median of the rounds is reported. Rounds
stop early once ``--time-budget`` seconds of measuring have passed (never fewer than ``--min-rounds``).
``--out DIR`` writes the figures as ``DIR/serve-demo-cpu-<UTC timestamp>.json``.

The servers run SGLang's CPU engine, where the backend runs the PyTorch reference ops (float32).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_server import post, sglang_servers  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

PROMPTS = ["The attention backend", "Paged KV caches store", "TileLang kernels run on", "A request arrives and",
           "Moore Threads GPUs", "The decode step reads", "Prefix caching saves", "Greedy decoding picks"]
BACKENDS = ("tilelang_musa", "torch_native")
DEVICE = "cpu"  # the server helper serves on the CPU engine
REPO = Path(__file__).resolve().parent.parent


def generate(base: str, prompts: list[str], max_new: int) -> tuple[list[list[int]], float, int]:
    """One batch: output ids per request, seconds, generated tokens."""
    t0 = time.perf_counter()
    out = post(base + "/generate", {"text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": max_new,
                                                                         "ignore_eos": True}})
    secs = time.perf_counter() - t0
    ids = [o["output_ids"] for o in out]
    return ids, secs, sum(len(i) for i in ids)


def measure(bases: dict[str, str], prompts: list[str], max_new: int, *, rounds: int, min_rounds: int,
            time_budget: float) -> tuple[dict, dict]:
    """Warm-up, then rounds alternating the backends' order; tokens/s per backend per round and the outputs."""
    for base in bases.values():  # first-batch costs (allocations, lazy imports) stay out of the timing
        generate(base, prompts, min(4, max_new))
    tps = {b: [] for b in bases}
    outputs = {b: [] for b in bases}
    order = list(bases)
    start = time.perf_counter()
    for r in range(rounds):
        if r >= min_rounds and time.perf_counter() - start > time_budget:
            break
        for b in (order if r % 2 == 0 else order[::-1]):
            ids, secs, tokens = generate(bases[b], prompts, max_new)
            tps[b].append(tokens / secs)
            outputs[b].append(ids)
    return tps, outputs


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "sglang", "musa_attn_backend"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # report what is there, whatever is missing
            out[mod] = f"unavailable ({type(e).__name__})"
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per backend at most")
    ap.add_argument("--min-rounds", type=int, default=3, help="timed rounds per backend at least")
    ap.add_argument("--time-budget", type=float, default=45.0,
                    help="seconds of timed rounds after which no new round starts")
    ap.add_argument("--out", type=Path, default=None, help="directory for the results JSON")
    args = ap.parse_args(argv)
    prompts = (PROMPTS * (args.requests // len(PROMPTS) + 1))[: args.requests]
    with tempfile.TemporaryDirectory(prefix="musa_attn_serve_") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "tiny_llama")
        print(f"serve demo: tiny Llama (2 layers, 4 q / 2 kv heads, float32) in {model}")
        t0 = time.perf_counter()
        with ExitStack() as stack:
            bases = stack.enter_context(sglang_servers(model, BACKENDS, work=work, shim_log=work / "shim.log"))
            print(f"serve demo: both servers up in {time.perf_counter() - t0:.0f}s; {args.requests} requests x "
                  f"{args.max_new_tokens} new tokens per round")
            tps, outputs = measure(bases, prompts, args.max_new_tokens, rounds=args.rounds,
                                   min_rounds=args.min_rounds, time_budget=args.time_budget)

    rows = []
    for b in BACKENDS:
        med = statistics.median(tps[b])
        rows.append({"backend": b, "tokens_per_s": tps[b], "median": med, "min": min(tps[b]), "max": max(tps[b])})
        print(f"  {b:<14}: {med:8.1f} tokens/s median of {len(tps[b])} rounds ({min(tps[b]):.1f} .. "
              f"{max(tps[b]):.1f})")
    ratio = rows[0]["median"] / rows[1]["median"]
    # Each round times the two backends back to back, so their ratio within a round sees nearly the same load.
    paired = statistics.median(a / b for a, b in zip(tps["tilelang_musa"], tps["torch_native"]))
    print(f"  tilelang_musa / torch_native: {ratio:.2f}x (ratio of medians), {paired:.2f}x (median of per-round "
          "ratios)")

    ref = outputs["torch_native"][0]
    tokens = sum(len(r) for r in ref)
    consistent = all(o == outputs[b][0] for b in BACKENDS for o in outputs[b])  # greedy: every round alike
    ours = outputs["tilelang_musa"][0]
    same = sum(a == b for a, b in zip(ours, ref))
    equal_tokens = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b))
    print(f"serve demo: agreement with torch_native: {same}/{len(ref)} requests identical, "
          f"{equal_tokens}/{tokens} tokens" + ("" if consistent else "; some round differed from the first"))
    ok = same == len(ref) and consistent

    if args.out is not None:
        stamp = datetime.now(timezone.utc)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"serve-demo-{DEVICE}-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
        path.write_text(json.dumps({
            "kind": "serve-demo", "device": DEVICE, "commit": commit(), "date": stamp.isoformat(),
            "versions": versions(), "host": {"machine": platform.machine(), "cpus": _cpus()},
            "config": {"model": "tiny Llama: 2 layers, hidden 64, 4 q / 2 kv heads, float32, page 16",
                       "requests": args.requests, "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
                       "rounds": len(tps[BACKENDS[0]]), "order": "alternating, both servers up at once"},
            "rows": rows, "ratio_tilelang_musa_over_torch_native": ratio, "median_round_ratio": paired,
            "agreement": {"requests_identical": same, "requests": len(ref), "tokens_equal": equal_tokens,
                          "tokens": tokens, "rounds_consistent": consistent},
        }, indent=2) + "\n")
        print(f"serve demo: results in {path}")
    return 0 if ok else 1


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
