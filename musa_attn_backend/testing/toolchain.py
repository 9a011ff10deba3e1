"""The kernel toolchain the build tests compile with: ``nvcc`` for the Hopper target, without a GPU.

Shared by the attention and KV-cache build tests: both skip where nvcc is missing, except in CI, which must
have it (there the test fails on the missing compiler instead of skipping).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

# The target every build test compiles for (TileLang's target dict: CUDA, Hopper with its async features).
HOPPER = {"kind": "cuda", "arch": "sm_90a"}


def in_ci() -> bool:
    """Whether this runs in CI (``CI`` set to 1 / true / yes)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def nvcc_path() -> Optional[str]:
    """The nvcc on ``PATH``, else CUDA's default install location, else None."""
    default = "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc") or (default if os.path.exists(default) else None)
