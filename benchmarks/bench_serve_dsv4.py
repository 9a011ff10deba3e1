"""A DeepSeek-V4-Flash-sized model served end to end by vLLM's engine with ``attention_backend="tilelang_musa"``
(issue 40): what a user of the engine sees, on the lent GPU in the MUSA situation (every V4 kernel from this
package, vLLM's compiled ops stood in for by ``integration_tests/vllm_gpu_harness``).

    PYTHONPATH=integration_tests/vllm_gpu_harness:$PYTHONPATH python benchmarks/bench_serve_dsv4.py \\
        [--layers 2] [--batches 1,8,32,64] [--contexts 4096,16384,32768] [--budget-s 420] [--out DIR]
    python benchmarks/bench_serve_dsv4.py --config-only DIR      (write the model's config.json and stop; CPU)

The model: V4-Flash's real dimensions (hidden 4096, 64 query heads of 512, q / o LoRA 1024, 8 output groups, the
indexer's 64 heads of 128 choosing 512 rows, 256 routed experts of width 2048 with top-6 ``sqrtsoftplus`` routing
and one shared expert, mHC over 4 streams, vocabulary 129,280) in ``--layers`` layers cycling through
``--ratios`` (default 4 and 128: one CSA and one HCA layer, the two kinds 41 of Flash's 43 layers are), and the
FP8 block-scaled checkpoint format (``--quant fp8``: 128 x 128 weight blocks, experts FP8 as in V4-Flash-Base;
``none``: bf16). Weights are vLLM's dummy ones (random, made on the GPU; nothing is read or downloaded), so the
tokens mean nothing: this bench times, ``integration_tests/test_vllm_dsv4_engine.py`` checks agreement.

One engine (``LLM``, engine core in this process so that the profiler sees its kernels) serves one untimed
request (``first_request_s``: whatever compiles at a first use), then every case, in order of cost, until
``--budget-s`` would be passed (guessed from the last case's prefill rate): ``B`` requests of ``C`` random prompt
tokens each (no two alike; prefix caching off) are added at once and the engine is stepped:

- ``ttft_ms``: from adding the batch to the step that returned each request's first token (mean, max);
  ``prefill_tok_s``: the batch's prompt tokens over the time until every request has its first token.
- ``decode_step_ms``: the mean time of ``--decode-steps`` engine steps once every request decodes (each step one
  token a request; under ``FULL_DECODE_ONLY`` CUDA graphs by default, ``--eager`` for none); ``decode_tok_s`` =
  ``B`` / that.
- ``kernel_ms`` (the first context of each batch): the GPU time of the kernels and copies of ``--profile-steps``
  decode steps (``torch.profiler``, graph replays included) per step, and ``top_kernels`` by time: the step's
  time against the sum of its kernels' times.
- ``gpu_memory``: the engine's KV-cache blocks and tokens, torch's peak allocation and the device's used memory.

Results as JSON (``serve-dsv4-<stamp>.json``, written after every case) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE.parent), str(HERE)) if p not in sys.path]  # the package, bench_attention

VOCAB = 129_280
FIRST_TOKEN = 32  # prompts stay clear of the special tokens


def flash_config(layers: int = 2, ratios: tuple[int, ...] = (4, 128), quant: str = "fp8",
                 max_len: int = 65_536) -> dict:
    """A Hugging Face ``config.json`` with V4-Flash's dimensions in ``layers`` layers whose compress ratios cycle
    through ``ratios``; ``quant`` "fp8": DeepSeek's FP8 checkpoint format with FP8 experts, "none": bf16."""
    if layers < 1 or any(r not in (0, 4, 128) for r in ratios):
        raise ValueError(f"layers >= 1 and compress ratios from 0, 4, 128, not {layers}, {ratios}")
    if quant not in ("fp8", "none"):
        raise ValueError(f"quant is fp8 or none, not {quant!r}")
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448,
        "v_head_dim": 512, "kv_lora_rank": 512, "compress_ratios": [ratios[i % len(ratios)] for i in range(layers)],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "intermediate_size": 2048,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "vocab_size": VOCAB, "sliding_window": 128,
        "window_size": 128, "num_hash_layers": 0, "swiglu_limit": 10.0, "max_position_embeddings": max_len,
        "torch_dtype": "bfloat16", "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "bos_token_id": 0, "eos_token_id": 1,
        "topk_method": "noaux_tc", "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "moe_layer_freq": 1, "ep_size": 1,
        "attention_bias": False, "tie_word_embeddings": False, "q_head_norm": True,
    }
    if quant == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
        cfg["expert_dtype"] = "fp8"
    return cfg


def write_model(out: Path, **kw) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(flash_config(**kw), indent=1))
    return out


def cases(batches: list[int], contexts: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """(batch, context) pairs cheapest first (prompt tokens, then batch), those above ``max_tokens`` prompt tokens
    left out."""
    out = [(b, c) for b in batches for c in contexts if b * c <= max_tokens]
    return sorted(out, key=lambda bc: (bc[0] * bc[1], bc[0]))


def _prompts(batch: int, context: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(context)] for _ in range(batch)]


def _sync():
    import torch

    torch.cuda.synchronize()


def _kernel_profile(engine, steps: int) -> dict:
    """GPU time per step of ``steps`` engine steps (kernels, copies, graph replays' kernels), and the top 15."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0)
        if t and t > 0:
            rows.append((evt.key, t / 1000.0, evt.count))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"kernel_ms": total / steps, "top_kernels": [
        {"name": n[:120], "ms_per_step": t / steps, "calls_per_step": c / steps} for n, t, c in rows[:15]]}


def run_case(engine, batch: int, context: int, decode_steps: int, profile_steps: int, rng) -> dict:
    from vllm import SamplingParams

    warm = 2  # decode steps left untimed after the prefill (the first replays, the scheduler's settling)
    params = SamplingParams(temperature=0.0, max_tokens=warm + decode_steps + profile_steps + 2, ignore_eos=True,
                            detokenize=False)
    prompts = _prompts(batch, context, rng)
    _sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{batch}c{context}r{i}", {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    steps = 0
    while len(first) < batch:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
        steps += 1
    t_prefill = max(first.values())
    for _ in range(warm):
        engine.step()
    _sync()
    t1 = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    _sync()
    step_s = (time.perf_counter() - t1) / decode_steps
    row = {"batch": batch, "context": context, "ttft_ms": 1e3 * sum(first.values()) / batch,
           "ttft_max_ms": 1e3 * t_prefill, "prefill_steps": steps, "prefill_tok_s": batch * context / t_prefill,
           "decode_step_ms": 1e3 * step_s, "decode_tok_s": batch / step_s}
    if profile_steps:
        row.update(_kernel_profile(engine, profile_steps))
        row["step_over_kernels"] = row["decode_step_ms"] / row["kernel_ms"] if row["kernel_ms"] else None
    while engine.has_unfinished_requests():
        engine.step()
    return row


def gpu_memory(llm) -> dict:
    import torch

    free, total = torch.cuda.mem_get_info()
    cache = llm.llm_engine.vllm_config.cache_config
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30, "device_used_gib": (total - free) / 2**30,
            "kv_blocks": getattr(cache, "num_gpu_blocks", None), "block_size": cache.block_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ratios", default="4,128")
    ap.add_argument("--quant", default="fp8", choices=("fp8", "none"))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--max-prompt-tokens", type=int, default=1 << 21, help="leave out cases with more")
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (NCCL; kernel_ms only at 1: the "
                                                      "workers run in processes of their own)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop before a case that would pass this")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--config-only", metavar="DIR", help="write the model's config.json into DIR and stop")
    args = ap.parse_args(argv)
    ratios = tuple(int(r) for r in args.ratios.split(","))
    if args.config_only:
        print(write_model(Path(args.config_only), layers=args.layers, ratios=ratios, quant=args.quant))
        return 0
    start = time.perf_counter()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here: the profiler sees it
    os.environ.setdefault("MUSA_ATTN_MOE", "on")
    import tempfile

    import torch
    from vllm import LLM

    from bench_attention import git_commit, package_versions

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    todo = cases(batches, contexts, args.max_prompt_tokens)
    max_len = max(contexts) + args.decode_steps + args.profile_steps + 64
    model = write_model(Path(tempfile.mkdtemp()) / "v4-flash-sized", layers=args.layers, ratios=ratios,
                        quant=args.quant, max_len=max(65_536, max_len))
    compilation = {"custom_ops": ["none"]}
    if not args.eager:
        compilation.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY",
                           cudagraph_capture_sizes=sorted({b for b in batches if b <= 512}))
    t_load = time.perf_counter()
    llm = LLM(model=str(model), skip_tokenizer_init=True, attention_backend="tilelang_musa", dtype="bfloat16",
              kv_cache_dtype="fp8", block_size=args.block_size, load_format="dummy",
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_len,
              max_num_seqs=max(64, max(batches)), enable_prefix_caching=False, enforce_eager=args.eager, seed=0,
              compilation_config=compilation, tensor_parallel_size=args.tp, disable_custom_all_reduce=True,
              # vLLM's JIT warmup of its own V4 kernels (CuTe DSL on CUDA) warms kernels this backend replaces
              kernel_config={"enable_jit_warmup": False})
    load_s = time.perf_counter() - t_load
    engine = llm.llm_engine
    stamp = datetime.now(timezone.utc)
    path = Path(args.out) / f"serve-dsv4-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "date": stamp.isoformat(),
           "versions": package_versions("tilelang", "vllm"), "engine": "vllm",
           "model": {"layers": args.layers, "compress_ratios": list(flash_config(args.layers, ratios)["compress_ratios"]),
                     "quant": args.quant, "weights": "dummy (random, on the GPU)"},
           "graphs": None if args.eager else "FULL_DECODE_ONLY", "tp": args.tp, "engine_start_s": load_s,
           "gpu_memory": gpu_memory(llm), "rows": [], "left_out": []}
    rng = random.Random(0)
    # one untimed request first: what compiles at a first use (kernels the warmup did not build, vLLM's own) would
    # otherwise land in the first row's TTFT and in the rate the budget guesses from, leaving out rows that fit
    t_warm = time.perf_counter()
    run_case(engine, 1, min(contexts), 2, 0, rng)
    doc["first_request_s"] = time.perf_counter() - t_warm
    profiled: set[int] = set()
    rate = None  # prompt tokens a second, from the last case (longer contexts prefill slower)
    for batch, context in todo:
        left = args.budget_s - (time.perf_counter() - start)
        guess = (batch * context / rate if rate else 30.0) + 5.0
        if guess > left:
            doc["left_out"].append({"batch": batch, "context": context, "why": f"budget: ~{guess:.0f} s, {left:.0f} left"})
            continue
        prof = args.profile_steps if batch not in profiled and args.tp == 1 else 0
        try:
            row = run_case(engine, batch, context, args.decode_steps, prof, rng)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on to write what it has
            row = {"batch": batch, "context": context, "errors": f"{type(e).__name__}: {e}"[:800]}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            break
        profiled.add(batch)
        rate = row["prefill_tok_s"]
        doc["rows"].append(row)
        doc["gpu_memory"] = gpu_memory(llm)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"B {batch:3d} C {context:6d}: ttft {row['ttft_ms']:9.1f} ms  prefill {row['prefill_tok_s']:9.0f} tok/s  "
              f"decode step {row['decode_step_ms']:7.2f} ms ({row['decode_tok_s']:8.1f} tok/s)"
              + (f"  kernels {row['kernel_ms']:.2f} ms/step" if "kernel_ms" in row else ""), flush=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results in {path}")
    return 0 if doc["rows"] and all("errors" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
