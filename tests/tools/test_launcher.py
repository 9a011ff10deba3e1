"""``_tilelang.launcher``: a kernel's compiled TVM-FFI entry called without TileLang's Python wrapper, where the
platform allows it (CPU: fake adapters for the paths, and a real sm_90a compile for the attributes read)."""

import pytest
import torch

from musa_attn_backend import _tilelang, config
from musa_attn_backend.platform import direct_launch


class Executable:  # tvm.runtime.Executable's shape: jit() links a module whose entry function is looked up by name
    def __init__(self, calls):
        self.calls, self.jits = calls, 0

    def __call__(self, *args):
        raise AssertionError("the launcher calls the entry function, not the executable")

    def jit(self):
        self.jits += 1
        return self

    entry_name = "main"

    def __getitem__(self, name):
        assert name == "main"
        return lambda *args: self.calls.append(args)


class TVMFFIKernelAdapter:  # the name launcher() looks for; the fakes below give it either TileLang's attributes
    def __init__(self, result_idx=(), with_get=True):
        self.result_idx = list(result_idx)
        self.entry_calls = []
        self.entry = Executable(self.entry_calls)
        self._executables_by_device = {}
        self.executable = None
        if with_get:
            self._get_executable = lambda: self.entry


class CythonKernelAdapter(TVMFFIKernelAdapter):
    pass


class Kernel:
    def __init__(self, adapter):
        self.adapter, self.calls = adapter, []

    def __call__(self, *args):
        self.calls.append(args)
        self.adapter._executables_by_device[0] = self.adapter.entry  # what TileLang 0.1.12's wrapper does
        return []


@pytest.fixture
def device0(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("with_get", [True, False], ids=["tilelang_0.1.15", "tilelang_0.1.12"])
def test_the_entry_takes_every_launch_after_the_first_on_cuda(device0, with_get):
    kernel = Kernel(TVMFFIKernelAdapter(with_get=with_get))
    with config.override(target="sm_90a"):
        fast = _tilelang.launcher(kernel)
    assert fast is not kernel
    a, b = torch.zeros(3), torch.ones(2)
    fast(a, b, 1.5)  # the first launch on a device goes through TileLang (which makes the entry)
    assert len(kernel.calls) == 1 and not kernel.adapter.entry_calls
    fast(b, a, 2.5)
    fast(a, a, 0.5)
    assert len(kernel.calls) == 1
    assert [tuple(x if isinstance(x, float) else id(x) for x in c) for c in kernel.adapter.entry_calls] == \
        [(id(b), id(a), 2.5), (id(a), id(a), 0.5)]
    assert kernel.adapter.entry.jits == 1  # the entry function looked up once, not per launch


def test_kernels_keep_tilelangs_wrapper_where_the_entry_is_not_known_to_be_equivalent(device0):
    with config.override(target="sm_90a"):
        allocating = Kernel(TVMFFIKernelAdapter(result_idx=[2]))  # TileLang allocates an output: its wrapper does
        assert _tilelang.launcher(allocating) is allocating
        other_backend = Kernel(CythonKernelAdapter())
        assert _tilelang.launcher(other_backend) is other_backend
        stub = lambda *a: None  # noqa: E731 - a kernel an intercepting handler returned: no adapter
        assert _tilelang.launcher(stub) is stub
        bare = Kernel(TVMFFIKernelAdapter(with_get=False))
        del bare.adapter._executables_by_device  # a TileLang with neither attribute
        assert _tilelang.launcher(bare) is bare
    with config.override(target="mp_31"):  # MUSA: tilelang-musa's wrapper is kept
        assert not direct_launch()
        kernel = Kernel(TVMFFIKernelAdapter())
        assert _tilelang.launcher(kernel) is kernel
    assert direct_launch("cuda") and not direct_launch("musa")


def test_a_missing_entry_is_an_error_not_a_silent_skip(device0):
    kernel = Kernel(TVMFFIKernelAdapter(with_get=False))
    kernel.__class__ = type("NoEntryKernel", (Kernel,), {"__call__": lambda self, *a: self.calls.append(a)})
    with config.override(target="sm_90a"):
        fast = _tilelang.launcher(kernel)
    with pytest.raises(RuntimeError, match="no executable for device 0"):
        fast(torch.zeros(1))


def test_tilelangs_adapter_has_what_the_launcher_reads():
    """A real compile for sm_90a (nvcc, no GPU): the adapter TileLang gives the package's kernels is the TVM-FFI
    one, with the attributes :func:`_tilelang._compiled_entry` reads on this TileLang (0.1.12 in CI, 0.1.15 on
    the lent GPU), so a TileLang that renames them fails here instead of silently keeping the slow path."""
    import tilelang
    import tilelang.language as T

    @T.prim_func
    def copy(a: T.Tensor((128,), "float32"), b: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            for i in T.Parallel(128):
                b[i] = a[i]

    kernel = tilelang.compile(copy, target={"kind": "cuda", "arch": "sm_90a"})
    adapter = kernel.adapter
    assert type(adapter).__name__ == "TVMFFIKernelAdapter"
    assert not adapter.result_idx
    assert hasattr(adapter, "_get_executable") or hasattr(adapter, "_executables_by_device")
    with config.override(target="sm_90a"):
        assert isinstance(_tilelang.launcher(kernel), _tilelang._Entry)
    if hasattr(adapter, "_get_executable"):  # 0.1.15 links its executable without a GPU; 0.1.12 at first launch
        import tvm_ffi

        # the function the launcher and the compiled launch (``_Entry.handle``) call; on 2026-12-07 the GPU test
        # found ``handle`` reading ``entry_name`` off the executable, which only the linked module has
        entry = _tilelang._entry_function(adapter._get_executable())
        assert isinstance(entry, tvm_ffi.Function) and entry.__chandle__()
