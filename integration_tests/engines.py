"""What the engine tests need of a machine, said once."""

from __future__ import annotations

import importlib

import torch


def why_no_vllm_engine(without_gpu: str, compiled: str = "vllm._C_stable_libtorch") -> str:
    """Why vLLM's engine cannot run here ('' when it can): ``without_gpu`` on a machine without a CUDA GPU, the
    torch version vLLM 0.33.0 pins, and its compiled ops (the module ``compiled``)."""
    if not torch.cuda.is_available():
        return without_gpu
    if not torch.__version__.startswith("2.14"):
        return f"vLLM 0.33.0 pins torch 2.14.0; this machine has torch {torch.__version__}"
    try:
        importlib.import_module(compiled)
    except Exception as e:  # noqa: BLE001 - any failure to load the extension means the engine cannot start
        return f"vLLM's compiled ops are missing ({type(e).__name__}); install the full vllm wheel"
    return ""
