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


def test_prepared_launches_remake_slot_views_over_each_calls_tensors(entry):
    """``prepare``: an argument named as a view of slot k is remade over the tensor each ``run`` passes as slot k
    (its dtype, shape and strides as recorded: the entry's checks pass up to the device's), fixed tensors and
    allocs as in ``run``; a call whose slots differ from the recorded ones in shape, strides, dtype or 16-byte
    alignment launches nothing and returns None."""
    x = torch.randn(2, 3, N)  # the caller's [batch, s, N]; the kernel takes [batch * s, N]
    y = torch.zeros(6, N)
    prepared = _ffi_launch.prepare([(entry[0], (_ffi_launch.SlotView(0, x.view(6, N)), y, 2.0, 1))], [], [x])
    with pytest.raises(RuntimeError, match="input X device_type mismatch, expected cuda"):
        prepared.run([torch.randn(2, 3, N)])  # ndim, dtype, shape and strides of the remade view all passed
    wrong = _ffi_launch.prepare([(entry[0], (_ffi_launch.SlotView(0, x.view(3, 2 * N)), y, 2.0, 1))], [], [x])
    with pytest.raises(RuntimeError, match=r"input X shape\[1\] violates"):
        wrong.run([torch.randn(2, 3, N)])  # the recorded view's shape, not the slot's, reaches the entry
    words = _ffi_launch.SlotView(0, x.view(6, N).view(torch.int32))
    as_bytes = _ffi_launch.prepare([(entry[0], (words, y, 2.0, 1))], [], [x])
    with pytest.raises(RuntimeError, match="input X dtype mismatch, expected float32"):
        as_bytes.run([torch.randn(2, 3, N)])  # ... and its dtype
    alloc = _ffi_launch.prepare([(entry[0], (_ffi_launch.Alloc(0), _ffi_launch.SlotView(0, x.view(6, N)), 2.0, 1))],
                                [((6, N), torch.float64)], [x])
    with pytest.raises(RuntimeError, match="input X dtype mismatch, expected float32"):
        alloc.run([torch.randn(2, 3, N)])  # the alloc made per call, as in run()
    buf = torch.randn(2 * 3 * N + 4)
    for other in (torch.randn(3, 2, N), torch.randn(2, N, 3).transpose(1, 2), torch.randn(2, 3, N).double(),
                  buf[1:1 + 6 * N].view(2, 3, N)):  # shape, strides, dtype, alignment (4 bytes off)
        assert prepared.run([other]) is None
    assert prepared.run([]) is None and prepared.run([x, x]) is None
    with pytest.raises(RuntimeError, match="input X device_type mismatch"):
        prepared.run([buf[4:4 + 6 * N].view(2, 3, N)])  # 16 bytes off: aligned as the recorded slot, so launched


def test_what_prepare_refuses_is_named(entry):
    x = torch.randn(2, N)
    with pytest.raises(ValueError, match=r"must be \(slot index, view of that slot\)"):
        _ffi_launch.prepare([(entry[0], (_ffi_launch.SlotView(1, x), x, 2.0, 1))], [], [x])
    with pytest.raises(IndexError, match="names a missing alloc"):
        _ffi_launch.prepare([(entry[0], (_ffi_launch.Alloc(0), x, 2.0, 1))], [], [x])
    with pytest.raises(ValueError, match="slots must be tensors"):
        _ffi_launch.prepare([], [], [x, 3])
    with pytest.raises(ValueError, match="at least one slot"):
        _ffi_launch.prepare([], [], [])


def test_the_switch_decides_and_a_failed_build_is_never_silent(monkeypatch, caplog, capsys):
    """``MUSA_ATTN_COMPILED_LAUNCH``: off, or a platform that keeps TileLang's wrapper (MUSA), never loads the
    extension; auto turns a failed build into one warning with its reason and TileLang's launches; on raises it.
    A settings change asks again. ``musa-attn warmup`` builds it (a failure: a warning under auto, an error under
    on)."""
    import logging

    from musa_attn_backend import cli, config
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
    from musa_attn_backend.platform import get_platform

    loads = []

    def failing():
        loads.append(1)
        raise OSError("g++: not found")

    monkeypatch.setattr(_ffi_launch, "load", failing)
    monkeypatch.setattr(_ffi_launch, "_warned", set())
    with config.override(target="sm_90a", compiled_launch="off"):
        assert not _ffi_launch.enabled() and not loads
    with config.override(target="mp_31", compiled_launch="on"):
        assert not _ffi_launch.wanted() and not _ffi_launch.enabled() and not loads
    with config.override(target="sm_90a", compiled_launch="auto"), caplog.at_level(logging.WARNING):
        assert not _ffi_launch.enabled() and not _ffi_launch.enabled() and len(loads) == 1
        assert ti.compiled_launch_on() is False
        monkeypatch.setattr(ti, "SCHED_COMPILED_LAUNCH", True)  # forced (tests, benchmarks)
        assert ti.compiled_launch_on() is True
        monkeypatch.setattr(ti, "SCHED_COMPILED_LAUNCH", None)
        assert cli._build_compiled_launch(get_platform())  # warmup goes on: the server would launch via TileLang
    assert [r for r in caplog.records if "g++: not found" in r.getMessage()][:1]
    assert len([r for r in caplog.records if "did not build" in r.getMessage()]) == 1
    assert "warning: the compiled launch's extension did not build (g++: not found)" in capsys.readouterr().err
    with config.override(target="sm_90a", compiled_launch="on"):
        with pytest.raises(RuntimeError, match="MUSA_ATTN_COMPILED_LAUNCH=on: .* did not build: g\\+\\+: not found"):
            _ffi_launch.enabled()
        assert not cli._build_compiled_launch(get_platform())
    monkeypatch.setattr(_ffi_launch, "load", lambda: loads.append(2) or object())
    with config.override(target="sm_90a", compiled_launch="auto"):
        assert _ffi_launch.enabled() and loads[-1] == 2 and ti.compiled_launch_on()


def test_doctor_says_whether_the_compiled_launch_is_used_and_built(tmp_path):
    from musa_attn_backend import cli, config

    with config.override(target="sm_90a", compiled_launch="off"):
        assert _ffi_launch.status().startswith("off (MUSA_ATTN_COMPILED_LAUNCH=off)")
    with config.override(target="mp_31"):
        assert _ffi_launch.status().startswith("not used on this platform")
    with config.override(target="sm_90a", cache_dir=tmp_path):
        assert _ffi_launch.status().startswith("auto, not built yet")
        tag, build = _ffi_launch._build_dir(create=True)
        build.mkdir(parents=True)
        (build / f"musa_attn_ffi_launch_{tag}.so").write_bytes(b"")
        assert _ffi_launch.status() == f"auto, built ({build / f'musa_attn_ffi_launch_{tag}.so'})"
        info, _ = cli.collect()
        assert info["compiled_launch"] == _ffi_launch.status()
