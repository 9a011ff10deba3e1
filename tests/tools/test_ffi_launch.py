"""``_ffi_launch``: compiled TileLang entries called from C++ (the scheduled V4 decode's launches, issue 38's
host path). On the CPU a real sm_90a kernel's compiled entry is called through the extension with CPU tensors:
the entry's own argument checks (ndim, dtype, shape, strides, then the device) see the tensors the extension
passes, so an argument the extension got wrong fails an earlier check than the device one, and each entry error
comes back as a RuntimeError with the entry's message. The launches themselves run in the GPU tests
(``test_gpu_dsv4.py``: the scheduled program through the compiled call against TileLang's wrapper)."""

import pytest
import torch

from musa_attn_backend import _ffi_launch
from musa_attn_backend.testing.toolchain import nvcc_path

N = 128


@pytest.fixture(scope="module")
def entry():
    """``(handle, function)`` of a small sm_90a kernel's compiled entry: ``Y = X * s + m`` over ``[n, 128]``."""
    if nvcc_path() is None:
        pytest.skip("needs nvcc to compile a kernel for sm_90a")
    import tilelang

    from musa_attn_backend._tilelang import tl_lang as T

    n = T.dynamic("n")

    @T.prim_func
    def scale_add(X: T.Tensor((n, N), "float32"), Y: T.Tensor((n, N), "float32"), s: T.float32, m: T.int32):
        with T.Kernel(n, threads=N) as b:
            for j in T.Parallel(N):
                Y[b, j] = X[b, j] * s + m

    kernel = tilelang.compile(scale_add, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi")
    adapter = kernel.adapter  # TileLang 0.1.12 keeps the module (made at compile time), 0.1.15 makes it on demand
    module = adapter.executable if getattr(adapter, "executable", None) is not None else adapter._get_executable()
    fn = module[module.entry_name]
    return _ffi_launch.handle(fn), fn


def _call(entry, *args, allocs=()):
    return _ffi_launch.run([(entry[0], args)], list(allocs), torch.zeros(1))


def test_the_entry_sees_the_tensors_and_scalars_it_is_given(entry):
    x, y = torch.randn(3, N), torch.zeros(3, N)
    with pytest.raises(RuntimeError, match="input X device_type mismatch, expected cuda"):
        entry[1](x, y, 2.0, 1)  # Python's call of the same entry fails where the extension's must
    with pytest.raises(RuntimeError, match="input X device_type mismatch, expected cuda"):
        _call(entry, x, y, 2.0, 1)  # every check before the device's passed: ndim, dtype, shape, strides
    with pytest.raises(RuntimeError, match="input X dtype mismatch, expected float32"):
        _call(entry, x.double(), y, 2.0, 1)
    with pytest.raises(RuntimeError, match=r"input X shape\[1\] violates"):
        _call(entry, x[:, :64].contiguous(), y, 2.0, 1)
    with pytest.raises(RuntimeError, match=r"input X stride"):
        _call(entry, torch.randn(N, 3).t(), y, 2.0, 1)  # the strides as they are, not assumed contiguous
    with pytest.raises(RuntimeError, match="input X device_type mismatch"):
        _call(entry, x, y, 2, 1)  # an int where the entry takes a float: accepted, as from Python


def test_allocated_tensors_stand_in_for_their_placeholders(entry):
    y = torch.zeros(3, N)
    with pytest.raises(RuntimeError, match="input X dtype mismatch, expected float32"):
        _call(entry, _ffi_launch.Alloc(0), y, 2.0, 1, allocs=[((3, N), torch.float64)])  # the made tensor
    with pytest.raises(RuntimeError, match=r"input X shape\[1\] violates"):
        _call(entry, _ffi_launch.Alloc(1), y, 2.0, 1, allocs=[((3, N), torch.float32), ((3, 64), torch.float32)])
    with pytest.raises(RuntimeError, match="input X device_type mismatch"):
        _call(entry, _ffi_launch.Alloc(0), y, 2.0, 1, allocs=[((3, N), torch.float32)])


def test_what_the_extension_refuses_is_named():
    with pytest.raises(ValueError, match="argument 2 is str; tensors, ints, floats or"):
        _ffi_launch.run([(0, (torch.zeros(1), torch.zeros(1), "x"))], [], torch.zeros(1))
    with pytest.raises(IndexError):
        _ffi_launch.run([(0, (_ffi_launch.Alloc(1),))], [((1,), torch.float32)], torch.zeros(1))
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        _ffi_launch.run([], [((1,), "float32")], torch.zeros(1))
