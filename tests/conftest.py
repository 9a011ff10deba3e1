import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

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


def _load_module(folder: str, name: str):
    """``<repo>/<folder>/<name>.py`` as the module ``name``, put in ``sys.modules`` before it runs (its dataclasses
    look their module up while the class is made)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_bench():
    """``load_bench(name)``: ``benchmarks/<name>.py`` as a module."""
    return lambda name: _load_module("benchmarks", name)


@pytest.fixture
def smoke_doc(tmp_path, load_bench):
    """``smoke_doc(bench, prefix, keys=...)``: ``benchmarks/<bench>.py --smoke`` run into a temporary folder
    (``bench``: the module or its name); the one results document it wrote (``<prefix>-*.json``), which must hold
    ``keys`` (default: the keys every run records)."""
    def run(bench, prefix, keys=("device", "commit", "date", "versions", "rows")):
        bench = load_bench(bench) if isinstance(bench, str) else bench
        assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
        (path,) = tmp_path.glob(f"{prefix}-*.json")
        doc = json.loads(path.read_text())
        assert set(keys) <= set(doc), sorted(doc)
        return doc
    return run


@pytest.fixture(scope="session")
def load_script():
    """``load_script(name)``: ``scripts/<name>.py`` as a module."""
    return lambda name: _load_module("scripts", name)


@pytest.fixture
def gpu_device() -> str:
    return "cuda" if torch.cuda.is_available() else "musa"


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch):
    """Each test starts from the settings of the environment, read again, and the platform detected under
    them (settings are read once per process: a test changes them with ``use_settings``, not the
    environment)."""
    from musa_attn_backend import config

    config.refresh()
    yield
    config.clear_derived_caches()


@pytest.fixture
def use_settings():
    """``use_settings(pdl=False, target="sm_90a", ...)``: those settings (``config.override``) from this call
    to the end of the test; later calls change more of them."""
    from musa_attn_backend import config

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(config.override(**fields))
