"""Persisted tile-configuration choices (``musa-attn tune`` writes them, the kernel launchers read them).

A tuning table is one JSON file per device and TileLang version in the kernel cache directory
(``<cache>/tuning/<device>--<target>--tilelang-<version>.json``), so a serving image ships its tuned choices
next to its compiled kernels and a different GPU or TileLang never reads another's. Each entry maps an
operation and a *shape class* (the things a tile choice depends on: head dims, cache dtype, page class, ...)
to the winning configuration and its measured time. Writers take a file lock and replace the file
atomically, so processes tuning or starting at once never see a half-written table; readers load it once per
process.

:func:`search` is the tuner itself: every candidate is checked for correctness first (a candidate whose result
is wrong is never recorded), then timed; the fastest correct one is recorded.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from filelock import FileLock

from .cache import cache_dir
from .config import clear_derived_caches

_lock = threading.Lock()
_loaded: dict[Path, dict] = {}


@functools.lru_cache(maxsize=1)
def _tilelang_version() -> str:
    try:
        from importlib.metadata import version

        return version("tilelang")
    except Exception:
        return "none"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


def table_path(platform=None, tilelang_version: Optional[str] = None) -> Path:
    """The table of this device (name + TileLang target) and TileLang version."""
    if platform is None:
        from .platform import get_platform

        platform = get_platform()
    return cache_dir() / "tuning" / _table_name(platform, tilelang_version or _tilelang_version())


@functools.lru_cache(maxsize=16)
def _table_name(platform, tilelang_version: str) -> str:
    # cached: every shape class a launcher plans looks its table up
    target = platform.tilelang_target() if platform.target_kind else "none"
    return f"{_slug(platform.device_name)}--{_slug(repr(target))}--tilelang-{_slug(tilelang_version)}.json"


def shape_key(**fields: Any) -> str:
    """A stable text key for a shape class (sorted ``name=value`` pairs)."""
    return ",".join(f"{k}={fields[k]}" for k in sorted(fields))


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # unreadable table: defaults, never a crash on the serving path
    return data if isinstance(data, dict) else {}


def load(path: Optional[Path] = None, *, refresh: bool = False) -> dict:
    """The table as ``{op: {shape_key: entry}}``, read once per process (``refresh`` re-reads it, and empties
    the tiling plans made from the old contents)."""
    path = path or table_path()
    with _lock:
        if refresh or path not in _loaded:
            _loaded[path] = _read(path).get("entries", {})
        table = _loaded[path]
    if refresh:
        clear_derived_caches()
    return table


def lookup(op: str, key: str, path: Optional[Path] = None) -> Optional[dict]:
    """The recorded configuration for ``op`` on shape class ``key``, or None."""
    entry = load(path).get(op, {}).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("config"), dict):
        return entry["config"]
    return None


def record(op: str, key: str, config: dict, ms: float, *, path: Optional[Path] = None,
           details: Optional[dict] = None) -> Path:
    """Store ``config`` (measured ``ms``) as the choice for ``op`` on ``key``: locked read-modify-write of the
    table, written to a temporary file and renamed over it."""
    path = path or table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = _read(path)
        entries = data.setdefault("entries", {})
        entries.setdefault(op, {})[key] = {"config": dict(config), "ms": float(ms), **(details or {})}
        data["format"] = 1
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    with _lock:
        _loaded.pop(path, None)
    clear_derived_caches()  # the launchers' tiling plans may have been made from the old entry
    return path


def search(candidates: Iterable[dict], check: Callable[[dict], Optional[str]], time_ms: Callable[[dict], float],
           *, log: Callable[[str], None] = print) -> tuple[Optional[dict], float, list[dict]]:
    """Try every candidate: ``check(config)`` returns None when the result is right (else the reason), then
    ``time_ms(config)``. Returns (fastest correct config or None, its time, one report row per candidate).
    A candidate that fails to build or run is reported and skipped."""
    best, best_ms, rows = None, float("inf"), []
    for cfg in candidates:
        row = {"config": dict(cfg)}
        try:
            problem = check(cfg)
            if problem:
                row["error"] = f"wrong result: {problem}"
            else:
                row["ms"] = float(time_ms(cfg))
                if row["ms"] < best_ms:
                    best, best_ms = dict(cfg), row["ms"]
        except Exception as e:  # a candidate that does not build or run here
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"  {row}")
        rows.append(row)
    return best, best_ms, rows
