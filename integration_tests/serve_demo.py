"""The main job's serving demo: SGLang serves a tiny locally built Llama with ``--attention-backend
tilelang_musa``, answers a few requests over HTTP, and is compared token for token with the same server on
SGLang's ``torch_native`` backend. Prints tokens/s and the agreement. Exit code 1 on any disagreement.

    python integration_tests/serve_demo.py [--requests 8] [--max-new-tokens 32]

On a CPU the backend runs the PyTorch reference ops (float32); on a GPU machine the same command runs the
TileLang kernels.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_server import post, sglang_server  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

PROMPTS = ["The attention backend", "Paged KV caches store", "TileLang kernels run on", "A request arrives and",
           "Moore Threads GPUs", "The decode step reads", "Prefix caching saves", "Greedy decoding picks"]


def run(backend: str, model: Path, work: Path, prompts: list[str], max_new: int):
    with sglang_server(model, backend, log=work / f"{backend}.log", shim_log=work / "shim.log") as base:
        post(base + "/generate", {"text": "warm up", "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
        t0 = time.perf_counter()
        out = post(base + "/generate", {"text": prompts, "sampling_params": {"temperature": 0,
                                                                             "max_new_tokens": max_new}})
        secs = time.perf_counter() - t0
    ids = [o["output_ids"] for o in out]
    return ids, sum(len(i) for i in ids) / secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    prompts = (PROMPTS * (args.requests // len(PROMPTS) + 1))[: args.requests]
    with tempfile.TemporaryDirectory(prefix="musa_attn_serve_") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "tiny_llama")
        print(f"serve demo: tiny Llama (2 layers, 4 q / 2 kv heads, float32) in {model}")
        ours, tps = run("tilelang_musa", model, work, prompts, args.max_new_tokens)
        print(f"  tilelang_musa: {len(prompts)} requests x {args.max_new_tokens} tokens, {tps:.1f} tokens/s")
        ref, ref_tps = run("torch_native", model, work, prompts, args.max_new_tokens)
        print(f"  torch_native : {ref_tps:.1f} tokens/s")
    same = sum(a == b for a, b in zip(ours, ref))
    tokens = sum(len(r) for r in ref)
    equal_tokens = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b))
    print(f"serve demo: agreement with torch_native: {same}/{len(ref)} requests identical, "
          f"{equal_tokens}/{tokens} tokens")
    return 0 if same == len(ref) else 1


if __name__ == "__main__":
    sys.exit(main())
