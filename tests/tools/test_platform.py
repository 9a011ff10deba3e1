import sys
import types

import pytest
import torch

from musa_attn_backend import platform
from musa_attn_backend.kernels._common import resolve_impl


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU detection")
def test_cpu_detected_without_gpu(use_settings):
    use_settings(target=None)
    p = platform.get_platform()
    assert p.kind == "cpu" and p.torch_device == "cpu"
    assert p.target_kind is None and not p.has_gpu
    assert not (p.fp8 or p.bulk_copy or p.warpgroup_mma)
    with pytest.raises(RuntimeError, match="MUSA_ATTN_TARGET"):
        p.tilelang_target()


@pytest.mark.parametrize(
    "value,kind,arch,fp8,bulk,wg",
    [
        ("sm_90a", "cuda", "sm_90a", True, True, True),
        ("cuda:sm_90a", "cuda", "sm_90a", True, True, True),
        ("sm_90", "cuda", "sm_90", True, True, False),
        ("sm_89", "cuda", "sm_89", True, False, False),
        ("sm_80", "cuda", "sm_80", False, False, False),
        ("sm_100a", "cuda", "sm_100a", True, True, False),
        ("mp_31", "musa", "mp_31", True, True, True),
        ("musa:mp_31", "musa", "mp_31", True, True, True),
        ("MP_22", "musa", "mp_22", False, False, False),
    ],
)
def test_env_override(use_settings, value, kind, arch, fp8, bulk, wg):
    use_settings(target=value)
    p = platform.get_platform()
    assert (p.target_kind, p.arch, p.fp8, p.bulk_copy, p.warpgroup_mma) == (kind, arch, fp8, bulk, wg)
    # programmatic dependent launch: CUDA sm_90+ (the same archs as TMA here), not MUSA
    assert p.dependent_launch == (kind == "cuda" and bulk)
    # register A operands of tile GEMMs: every CUDA arch, no MUSA one
    assert p.gemm_a_in_registers == (kind == "cuda")
    assert p.source == "env"
    target = p.tilelang_target()
    if kind == "cuda":
        assert target == {"kind": "cuda", "arch": arch}
    else:  # the form this TileLang's TVM takes (tests/attention/test_musa_portability.py: both forms)
        assert target == platform.musa_target(arch)
    assert p.sm_count > 0


@pytest.mark.parametrize("value", ["hopper", "sm_x", "musa:mp3", "rocm:gfx942"])
def test_env_override_rejects_garbage(use_settings, value):
    use_settings(target=value)
    with pytest.raises(ValueError, match="MUSA_ATTN_TARGET"):
        platform.get_platform()


def test_env_override_cpu_disables_compilation(use_settings):
    use_settings(target="cpu")
    p = platform.get_platform()
    assert p.target_kind is None
    with pytest.raises(RuntimeError):
        p.tilelang_target()


class _Props:
    def __init__(self, major, minor, name, sms):
        self.major, self.minor, self.name, self.multi_processor_count = major, minor, name, sms


def _fake_musa(monkeypatch, use_settings, major, minor, name, tilelang_musa=True):
    fake_torch_musa = types.ModuleType("torch_musa")
    monkeypatch.setitem(sys.modules, "torch_musa", fake_torch_musa)
    monkeypatch.setattr(platform.importlib.util, "find_spec",
                        lambda n, *a, _orig=platform.importlib.util.find_spec: object() if n == "torch_musa"
                        else _orig(n, *a))
    musa = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                                 get_device_properties=lambda i: _Props(major, minor, name, 56))
    monkeypatch.setattr(torch, "musa", musa, raising=False)
    monkeypatch.setattr(platform, "tilelang_supports_musa", lambda: tilelang_musa)
    use_settings(target=None)  # detected, not overridden


def test_simulated_musa_s5000(monkeypatch, use_settings):
    _fake_musa(monkeypatch, use_settings, 3, 1, "MTT S5000")
    p = platform.get_platform()
    assert p.kind == "musa" and p.torch_device == "musa" and p.has_gpu
    assert (p.arch, p.capability, p.sm_count) == ("mp_31", (3, 1), 56)
    assert p.fp8 and p.bulk_copy and p.warpgroup_mma
    assert platform.parse_target(p.tilelang_target()) == ("musa", "mp_31")
    assert "MTT S5000" in p.describe()


def test_simulated_musa_s4000_has_no_fp8(monkeypatch, use_settings):
    _fake_musa(monkeypatch, use_settings, 2, 2, "MTT S4000")
    p = platform.get_platform()
    assert p.arch == "mp_22" and not (p.fp8 or p.bulk_copy or p.warpgroup_mma)


def test_simulated_musa_without_tilelang_musa(monkeypatch, use_settings):
    _fake_musa(monkeypatch, use_settings, 3, 1, "MTT S5000", tilelang_musa=False)
    p = platform.get_platform()
    assert p.kind == "musa" and p.target_kind is None
    assert any("tilelang-musa" in n for n in p.notes)
    with pytest.raises(RuntimeError):
        p.tilelang_target()


def test_simulated_musa_wins_over_env_free_cuda_check(monkeypatch, use_settings):
    _fake_musa(monkeypatch, use_settings, 3, 1, "MTT S5000")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torchada may make this True on MUSA
    assert platform.get_platform().kind == "musa"


def test_simulated_cuda_h200(monkeypatch, use_settings):
    use_settings(target=None)
    monkeypatch.setattr(platform, "musa_runtime_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(9, 0, "NVIDIA H200", 132))
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    p = platform.get_platform()
    assert (p.kind, p.arch, p.sm_count) == ("cuda", "sm_90a", 132)
    assert p.fp8 and p.bulk_copy and p.warpgroup_mma
    assert p.tilelang_target() == {"kind": "cuda", "arch": "sm_90a"}


def test_resolve_impl():
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, "op") == "reference"
    assert resolve_impl("reference", cpu, "op") == "reference"
    assert resolve_impl("auto", torch.device("cuda", 0), "op") == "tilelang"
    with pytest.raises(ValueError, match="impl='tilelang' needs"):
        resolve_impl("tilelang", cpu, "op")
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton", cpu, "op")
