"""A pytest plugin (``-p musa_attn_backend.testing.trace_plugin``) for the warmup completeness tests, which run the
engines' own V4 test cases through it in a subprocess. It writes JSON to ``$KERNEL_TRACE_OUT``:

- on a CPU (``$KERNEL_TRACE_TARGETS``: comma-separated compile targets, default ``sm_90a``): the session runs under
  :func:`.kernel_trace.tracing`; ``{target: [repr(compile key), ...]}``, the kernels the tests' op calls asked for;
- with ``$KERNEL_TRACE_TARGETS`` set to ``cold`` (on a GPU): ``{"cold": [...]}``, the kernels the session compiled
  that the kernel cache did not hold (``_tilelang.cold_compiles``; after a complete warmup, none)."""

from __future__ import annotations

import json
import os

_state: dict = {}


def pytest_sessionstart(session):
    from .kernel_trace import tracing

    targets = os.environ.get("KERNEL_TRACE_TARGETS", "sm_90a").split(",")
    if targets != ["cold"]:
        _state["ctx"] = tracing(targets)
        _state["trace"] = _state["ctx"].__enter__()


def pytest_sessionfinish(session, exitstatus):
    from .. import _tilelang

    if "ctx" not in _state:
        result = {"cold": [repr(k) for k in _tilelang.cold_compiles]}
    else:
        trace = _state["trace"]
        _state["ctx"].__exit__(None, None, None)
        result = {t: [repr(k) for k in trace.unique(t)] for t in trace.keys}
    with open(os.environ["KERNEL_TRACE_OUT"], "w") as f:
        json.dump(result, f, indent=1)
