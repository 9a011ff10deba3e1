"""Start and stop a real ``python -m sglang.launch_server`` on the CPU for the integration tests.

The server finds ``tilelang_musa`` only through our installed entry point. CPU serving needs
``SGLANG_USE_CPU_ENGINE=1 --device cpu``, an explicit ``--max-total-tokens`` (else the KV pool is sized from
host RAM) and the import-only ``sgl_kernel`` shim in ``sgl_kernel_shim/`` (see its docstring). Servers run
with ``--sleep-on-idle``: an idle scheduler otherwise polls and keeps a core busy, which on a small machine
slows whatever runs beside it (another server, the tests). The whole process tree runs in its own session and
is killed on exit, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

SHIM = Path(__file__).resolve().parent / "sgl_kernel_shim"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, payload: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _start(model: Path, backend: str, *, log: Path, shim_log: Path, page_size: int, max_total_tokens: int,
           extra=(), device: str = "cpu", shim: Optional[Path] = SHIM) -> tuple[subprocess.Popen, str]:
    """Launch one server in its own session; returns the process and its base URL (not yet ready). ``device``
    ``cuda``: SGLang's CUDA engine (no CPU-engine variable, no forced CUDA-graph or dtype flags: ``extra`` says),
    with ``shim`` first on the path (None: the ``sgl_kernel`` installed, e.g. the device's import-only stub)."""
    port = free_port()
    env = dict(os.environ, SGL_KERNEL_SHIM_LOG=str(shim_log),
               PYTHONPATH=os.pathsep.join(([str(shim)] if shim else []) + [p for p in os.environ.get("PYTHONPATH",
                                                                                                    "").split(os.pathsep)
                                                                          if p]))
    cpu = device == "cpu"
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", device,
           "--attention-backend", backend, "--max-total-tokens", str(max_total_tokens), "--page-size",
           str(page_size), *(("--dtype", "float32", "--disable-cuda-graph") if cpu else ()), "--host", "127.0.0.1",
           "--port", str(port), "--skip-server-warmup", "--random-seed", "0", "--sleep-on-idle", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen, base: str, backend: str, log: Path, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{backend} server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"{backend} server not ready in time:\n{_tail(log)}")
        time.sleep(1.0)


@contextmanager
def sglang_server(model: Path, backend: str, *, log: Path, shim_log: Path, page_size: int = 16,
                  max_total_tokens: int = 8192, startup_timeout: float = 300.0, extra=(), **where):
    """One server, up; yields its base URL."""
    with sglang_server_process(model, backend, log=log, shim_log=shim_log, page_size=page_size,
                               max_total_tokens=max_total_tokens, startup_timeout=startup_timeout,
                               extra=extra, **where) as (base, _):
        yield base


@contextmanager
def sglang_server_process(model: Path, backend: str, *, log: Path, shim_log: Path, page_size: int = 16,
                          max_total_tokens: int = 8192, startup_timeout: float = 300.0, extra=(), **where):
    """As ``sglang_server``, but yields ``(base URL, process)``: the ``subprocess.Popen`` of the launcher, the
    leader of its own process group (scheduler and detokenizer included; see ``process_group_rss``). ``where``:
    ``device`` and ``shim`` (see ``_start``)."""
    proc, base = _start(model, backend, log=log, shim_log=shim_log, page_size=page_size,
                        max_total_tokens=max_total_tokens, extra=extra, **where)
    try:
        _wait_ready(proc, base, backend, log, time.time() + startup_timeout)
        yield base, proc
    finally:
        _kill_tree(proc)


def process_group_rss(proc: subprocess.Popen) -> dict[int, int]:
    """Resident memory in bytes (``VmRSS`` of ``/proc/<pid>/status``) of every live process in ``proc``'s process
    group (the server's launcher, scheduler, detokenizer and helpers), by PID; Linux only."""
    pgid = os.getpgid(proc.pid)
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the fields after the parenthesised command name: state, ppid, pgrp, ...
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[int(entry.name)] = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or a kernel thread without VmRSS
    return out


@contextmanager
def sglang_servers(model: Path, backends, *, work: Path, shim_log: Path, page_size: int = 16,
                   max_total_tokens: int = 8192, startup_timeout: float = 300.0):
    """One server per backend, all started at once (they load side by side) and all up together; yields
    ``{backend: base URL}``. Logs go to ``work/<backend>.log``."""
    procs = {}
    try:
        for b in backends:
            procs[b] = _start(model, b, log=work / f"{b}.log", shim_log=shim_log, page_size=page_size,
                              max_total_tokens=max_total_tokens)
        deadline = time.time() + startup_timeout
        for b, (proc, base) in procs.items():
            _wait_ready(proc, base, b, work / f"{b}.log", deadline)
        yield {b: base for b, (_, base) in procs.items()}
    finally:
        for proc, _ in procs.values():
            _kill_tree(proc)


def _tail(path: Path, n: int = 40) -> str:
    lines = path.read_bytes().decode(errors="replace").splitlines()
    return "\n".join(l[:400] for l in lines[-n:] if "server_args=" not in l)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left of it."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)  # scheduler / detokenizer children that outlived the leader
    except ProcessLookupError:
        pass
    proc.wait()
