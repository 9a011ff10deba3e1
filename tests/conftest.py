import os

import pytest
import torch

# vLLM resolves its platform once per process; without a GPU, vLLM's builder/impl tests need the CPU platform.
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def gpu_available() -> bool:
    if torch.cuda.is_available():
        return True
    musa = getattr(torch, "musa", None)
    return bool(musa is not None and musa.is_available())


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or MUSA GPU (none visible to torch on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu_device() -> str:
    return "cuda" if torch.cuda.is_available() else "musa"


@pytest.fixture(autouse=True)
def _fresh_platform(monkeypatch):
    """Each test sees the platform detected under its own environment."""
    from musa_attn_backend import platform

    platform.reset()
    yield
    platform.reset()
