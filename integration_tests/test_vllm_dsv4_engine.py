"""A full vLLM ``LLM(...)`` run of the tiny DeepSeek-V4 (``tiny_dsv4.py``: 4 layers, compress ratios 0, 4, 128, 4,
random bf16 weights under DeepSeek's names, built locally) with ``attention_backend="tilelang_musa"``: our V4 layer,
compressors and indexer inside vLLM's engine, greedy, checked against ``dsv4_reference.Reference`` (the independent
float32 V4 forward the SGLang server test uses) by teacher forcing (``dsv4_reference.agreement``) on every prompt
and output log-probability vLLM reports.

Needs a GPU and the torch vLLM 0.33.0 pins (2.14): it skips, saying why, on the CPU (vLLM's V4 model on a CPU is
its own class, ``DeepseekV4ForCausalLM`` in ``models/deepseek_v4/cpu``, which our layer does not replace, and its
engine needs vLLM's compiled CPU ops) and on the lent GPU (torch 2.11, no compiled vLLM ops) unless
``vllm_gpu_harness/`` is first on PYTHONPATH (``scripts/device_engines_gpu.sh``: the MUSA situation, every compiled
vLLM op the path reaches stood in for by torch); the same layer is checked on vLLM's own structures by ``tests/vllm/test_vllm_dsv4_layer.py`` (CPU)
and ``tests/vllm/test_gpu_vllm_dsv4.py`` (H200)."""

import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dsv4_reference import Reference, agreement, load  # noqa: E402
from engines import why_no_vllm_engine  # noqa: E402
from tiny_dsv4 import build, prompts  # noqa: E402

MAX_NEW = 32


def _harness() -> bool:
    """Whether ``vllm_gpu_harness/sitecustomize.py`` was loaded (first on PYTHONPATH): the MUSA situation on a CUDA
    GPU, vLLM's compiled ops stood in for by torch."""
    return bool(getattr(sys.modules.get("sitecustomize"), "MUSA_VLLM_HARNESS", False))


def _why_not() -> str:
    if _harness() and torch.cuda.is_available():
        return ""
    return why_no_vllm_engine("needs a CUDA GPU: vLLM's V4 model on a CPU is vLLM's own CPU class (not our layer) "
                              "and its engine needs vLLM's compiled CPU ops", "vllm._C")


def _logprobs(out) -> list:
    """vLLM's log-probability of each prompt token after the ones before it (``None`` for the first), then of each
    output token, in sequence order (``prompt_logprobs=0``, ``logprobs=0``: the chosen token's only)."""
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    rows = list(out.prompt_logprobs) + list(out.outputs[0].logprobs)
    return [None if row is None else row[tok].logprob for tok, row in zip(ids, rows)]


# eager; then the CUDA graphs Moore Threads' V4 recipe serves with (FULL_DECODE_ONLY: decode steps replayed, prefill
# eager), at vLLM's V4 block of 256 and at the 64 MUSA's vLLM forces for V4-style models
# eager, tensor parallel over two GPUs (V4 is served TP8 on S5000s; NCCL, not vLLM's compiled custom all-reduce)
MODES = {"eager": (True, None, 256, 1), "graphs": (False, "FULL_DECODE_ONLY", 256, 1),
         "graphs-block64": (False, "FULL_DECODE_ONLY", 64, 1), "tp2": (True, None, 256, 2)}


@pytest.mark.gpu
@pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "runs")
@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_deepseek_v4_through_vllm_agrees_with_the_reference(tmp_path, mode):
    eager, graphs, block, tp = MODES[mode]
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = build(tmp_path / "tiny-v4", weights=True)
    import json

    config = json.loads((model / "config.json").read_text())
    ref = Reference(config, load(model))
    asks = prompts(config["vocab_size"], medium=True)
    # transformers' V4 config reads the dense intermediate_size as the experts' width: the experts' own, as built
    overrides = {"moe_intermediate_size": config["moe_intermediate_size"]}
    compilation = {"custom_ops": ["none"]}
    if graphs:
        # full graphs need no torch.compile (mode 0: none; vLLM captures the whole forward around the model)
        compilation.update(mode=0, cudagraph_mode=graphs, cudagraph_capture_sizes=[1, 2, 4])
    llm = LLM(model=str(model), tokenizer=None, skip_tokenizer_init=True, attention_backend="tilelang_musa",
              dtype="bfloat16", kv_cache_dtype="fp8", block_size=block, gpu_memory_utilization=0.3,
              max_model_len=4096, enforce_eager=eager, seed=0, hf_overrides=overrides,
              compilation_config=compilation, tensor_parallel_size=tp, disable_custom_all_reduce=True,
              # vLLM's JIT warmup of its own V4 kernels (CuTe DSL on CUDA) warms kernels this backend replaces
              kernel_config={"enable_jit_warmup": False})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0,
                            detokenize=False)
    names = ["short", "medium", "long"]
    outs = llm.generate([TokensPrompt(prompt_token_ids=asks[n]) for n in names], params)
    for name, out in zip(names, outs):
        ids = asks[name] + list(out.outputs[0].token_ids)
        assert len(out.outputs[0].token_ids) == MAX_NEW, name
        res = agreement(ref, ids, _logprobs(out), len(asks[name]))
        assert not res["failures"], f"{name} disagrees with the reference V4 forward: {res}"
    del llm  # the next mode's engine sizes its KV cache from the memory it finds free
    import gc

    gc.collect()
    torch.cuda.empty_cache()
