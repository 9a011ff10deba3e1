"""Where compiled kernels and tuning results live.

Default ``~/.cache/musa_attn_backend`` (``$XDG_CACHE_HOME`` respected); the ``MUSA_ATTN_CACHE_DIR`` setting
(:mod:`musa_attn_backend.config`) overrides.
TileLang's own compile cache is pointed inside it (``<cache>/tilelang``) unless ``TILELANG_CACHE_DIR`` is
already set, so one directory holds everything a serving image needs to ship warm.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import settings


def cache_dir(create: bool = False) -> Path:
    """The cache directory of the current settings (``create``: make it first)."""
    path = settings().cache_dir
    if path is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "musa_attn_backend"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def tilelang_cache_dir() -> Path:
    """Where TileLang keeps compiled kernels: ``TILELANG_CACHE_DIR`` if set, else ``<cache>/tilelang``."""
    return Path(os.environ.get("TILELANG_CACHE_DIR") or cache_dir() / "tilelang")


def configure_tilelang_env() -> None:
    """Point TileLang's cache into ours; must run before ``import tilelang`` to take effect."""
    os.environ["TILELANG_CACHE_DIR"] = str(tilelang_cache_dir())
