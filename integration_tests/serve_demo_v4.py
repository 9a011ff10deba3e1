"""The main job's DeepSeek-V4 demo: SGLang serves a tiny V4 (``tiny_dsv4.py``: 4 layers with compress ratios 0, 4,
128, 4, random bf16 weights, FP8 KV cache) with ``--attention-backend tilelang_musa`` over HTTP, answers a batch of
greedy requests (one of them 2,600 tokens long, one sharing half of it), and prints tokens/s and the agreement of
every served position with the independent V4 forward of ``dsv4_reference.py`` (teacher forcing; see
``dsv4_reference.agreement``). Exit code 1 on any disagreement.

    python integration_tests/serve_demo_v4.py [--max-new-tokens 64] [--out DIR]

``--out DIR`` writes the figures as ``DIR/serve-demo-v4-cpu-<UTC timestamp>.json``. The server runs SGLang's CPU
engine, where the backend runs this package's PyTorch reference ops.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4_reference import Reference, agreement, load, served_logprobs  # noqa: E402
from serve_demo import commit, versions  # noqa: E402
from sglang_server import post, sglang_server  # noqa: E402
from tiny_dsv4 import SERVER, build, prompts  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="directory for the results JSON")
    args = ap.parse_args(argv)
    greedy = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    with tempfile.TemporaryDirectory(prefix="musa_attn_v4_") as tmp:
        work = Path(tmp)
        model = build(work / "tiny-v4", tokenizer=True, weights=True)
        config = json.loads((model / "config.json").read_text())
        asks = prompts(config["vocab_size"], medium=True)
        print(f"serve demo V4: tiny DeepSeek-V4 (4 layers, ratios 0/4/128/4, bf16, FP8 KV) in {model}")
        t0 = time.perf_counter()
        with sglang_server(model, "tilelang_musa", log=work / "server.log", shim_log=work / "shim.log",
                           **SERVER) as base:
            print(f"serve demo V4: server up in {time.perf_counter() - t0:.0f}s")
            post(base + "/generate", {"input_ids": [asks["short"]], "sampling_params": {**greedy, "max_new_tokens": 4}})
            t1 = time.perf_counter()
            out = post(base + "/generate", {"input_ids": list(asks.values()), "sampling_params": greedy,
                                            "return_logprob": True, "logprob_start_len": 0}, timeout=900)
            secs = time.perf_counter() - t1
        generated = sum(len(o["output_ids"]) for o in out)
        prefilled = sum(len(p) for p in asks.values())
        print(f"serve demo V4: {len(asks)} requests, {prefilled} prompt tokens, {generated} generated in {secs:.1f}s: "
              f"{generated / secs:.1f} generated tokens/s, {(prefilled + generated) / secs:.0f} tokens/s in all")
        t2 = time.perf_counter()
        ref = Reference(config, load(model))
        rows, ok = [], True
        for (name, p), o in zip(asks.items(), out):
            res = agreement(ref, p + o["output_ids"], served_logprobs(o), len(p))
            good = not res["failures"]
            ok &= good
            rows.append({"request": name, "prompt_tokens": len(p), **res})
            print(f"  {name:<7} {len(p):5d} prompt tokens: {'agrees' if good else 'DISAGREES'}; |log p error| median "
                  f"{res['median_err']:.3f} over {res['positions']} positions ({res['excused']} router near ties "
                  f"excused); greedy = reference argmax at {res['greedy_exact']}/{res['steps']} steps"
                  + "".join(f"\n    {f}" for f in res["failures"][:5]))
        print(f"serve demo V4: the independent V4 forward checked every served position in "
              f"{time.perf_counter() - t2:.0f}s")
    if args.out is not None:
        stamp = datetime.now(timezone.utc)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"serve-demo-v4-cpu-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
        path.write_text(json.dumps({
            "kind": "serve-demo-v4", "device": "cpu", "commit": commit(), "date": stamp.isoformat(),
            "versions": versions(), "config": {"model": "tiny DeepSeek-V4, 4 layers, ratios 0/4/128/4, bf16, FP8 KV, "
                                                         "page 256", "max_new_tokens": args.max_new_tokens},
            "seconds": secs, "generated_tokens": generated, "prompt_tokens": prefilled,
            "rows": [{k: v for k, v in r.items() if k != "failures"} | {"failures": len(r["failures"])}
                     for r in rows]}, indent=2) + "\n")
        print(f"serve demo V4: results in {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
