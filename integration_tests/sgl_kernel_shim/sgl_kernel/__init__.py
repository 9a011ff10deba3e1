"""Import-only stand-in for SGLang's compiled ``sgl_kernel`` (its CPU build is not on PyPI), for the
real-server tests on a CPU.

SGLang 0.5.23 imports a handful of ``sgl_kernel`` functions at module level even on the CPU engine; none of
them runs for a dense model served with ``--attention-backend tilelang_musa`` or ``torch_native``. Each name
in ``FUNCTIONS`` resolves to a stub that records the call (in the file named by ``SGL_KERNEL_SHIM_LOG``) and
raises, so a test can prove nothing was called. Any other name or submodule is missing, as it would be
without sgl_kernel, so SGLang's own ``try: ... except ImportError`` fallbacks keep working.
"""

import os

__version__ = "0.0.0+shim"
SHIM = True


def _stub(qualname: str):
    def stub(*args, **kwargs):
        log = os.environ.get("SGL_KERNEL_SHIM_LOG")
        if log:
            with open(log, "a") as f:
                f.write(qualname + "\n")
        raise NotImplementedError(f"{qualname} is an import-only shim (sgl_kernel is not installed)")

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = qualname
    return stub


# The module-level imports SGLang 0.5.23 makes on the CPU engine (found by starting the server).
FUNCTIONS = {
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
}


def __getattr__(name: str):
    if name in FUNCTIONS:
        return _stub(f"sgl_kernel.{name}")
    raise AttributeError(f"module 'sgl_kernel' (import-only shim) has no attribute {name!r}")
