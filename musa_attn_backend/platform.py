"""The platform layer: which accelerator is present and what the kernels may use on it.

Every decision that differs between NVIDIA (CUDA), Moore Threads (MUSA) and a plain CPU lives in this
module, so kernel code branches on capability flags (``fp8``, ``bulk_copy``, ``warpgroup_mma``) and never
on vendor names.

``gemm_a_in_registers`` says whether a tile GEMM may read its A operand from registers (a fragment) with B in
shared memory, as the ``P V`` product of attention does with the softmax probabilities: CUDA's ``mma.sync``
and WGMMA can; tilelang-musa lowers MUSA GEMMs (SQMMA, PH1 WMMA, the FMA fallback) only from shared-memory
A operands, so where the flag is false every attention program stages P through shared memory first. The
``MUSA_ATTN_SHARED_P`` setting turns the flag off on any target, to run those programs on CUDA.

Detection order: the ``MUSA_ATTN_TARGET`` setting (:mod:`musa_attn_backend.config`; a compile-target override, e.g.
``sm_90a`` to build Hopper kernels on a machine without a GPU), then MUSA (``torch_musa`` importable with a
device present and a TileLang build that knows the ``musa`` target), then CUDA, then CPU.

Target strings accepted by ``MUSA_ATTN_TARGET``: ``sm_90a``, ``cuda:sm_90a``, ``cuda`` (arch read from the
device), ``mp_31``, ``musa:mp_31``, ``musa``, ``cpu``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import config

TARGET_ENV = config.BY_FIELD["target"].env

DEVICE_KINDS = ("cuda", "musa", "cpu")
# the capability flags a Platform carries (kernels branch on these, never on the device name)
# the flags whose absence brings in a rule on the programs' TIR (kernels._tir.RULES), checked before lowering
LOWERING_FLAGS = ("gemm_a_in_registers", "gemm_tile_two_majors", "gemm_any_extent", "gemm_tile_slices",
                  "wide_float_vectors")
FEATURES = ("fp8", "bulk_copy", "warpgroup_mma", "warp_specialized", "dependent_launch", "clusters",
            "load_hints", "async_proxy_fence") + LOWERING_FLAGS

# Moore Threads architectures we know: MTT S5000 is MP31 (FP8, TME bulk copy, SQMMA warp-group MMA);
# MTT S4000 is MP22 (none of them).
MUSA_ARCH_NAMES = {"mp_31": "MTT S5000 (MP31)", "mp_22": "MTT S4000 (MP22)"}


@dataclass(frozen=True)
class Platform:
    """What is present and what the kernels may use.

    ``kind`` is where tensors live (``cuda``, ``musa`` or ``cpu``); ``target_kind``/``arch`` is what
    TileLang compiles for. They differ only under a ``MUSA_ATTN_TARGET`` override (e.g. compiling for
    ``sm_90a`` on a CPU machine).
    """

    kind: str
    target_kind: Optional[str]  # "cuda" | "musa" | None (nothing to compile for)
    arch: Optional[str]  # "sm_90a", "mp_31", ...
    device_name: str = "cpu"
    capability: Optional[tuple[int, int]] = None
    sm_count: int = 0
    smem_per_sm: int = 0  # shared memory bytes per SM (0: unknown); bounds the tilings, sizes the split-KV grid
    fp8: bool = False  # FP8 (e4m3) tensor-core MMA and conversions
    bulk_copy: bool = False  # TMA (NVIDIA) / TME (MUSA) bulk-copy engine
    warpgroup_mma: bool = False  # WGMMA (NVIDIA sm_90a) / SQMMA (MUSA MP31)
    # explicit producer/consumer warp groups: asynchronous warp-group MMA waited on by count, register
    # reallocation between warp groups (setmaxnreg) and named barriers (the ping-pong prefill kernel)
    warp_specialized: bool = False
    # programmatic dependent launch (a kernel launched while the one before it finishes, waiting on it in
    # the kernel): CUDA sm_90+
    dependent_launch: bool = False
    # thread-block clusters whose blocks store into each other's shared memory and arrive on each other's barriers
    # (CUDA sm_90+)
    clusters: bool = False
    # global loads may carry cache hints (PTX ld.global.nc with an L1 eviction priority and an L2 prefetch size,
    # through a force-included device function): CUDA sm_80+
    load_hints: bool = False
    # the tensor cores read shared memory through an asynchronous proxy, so a thread's shared stores that a GEMM
    # reads after a barrier need a proxy fence first (CUDA sm_90+: WGMMA); MUSA's programs wait for their local
    # stores instead (tilelang-musa's own producer/consumer kernels)
    async_proxy_fence: bool = False
    # a tile GEMM may take A from registers with B in shared memory (CUDA); else P goes through shared memory
    gemm_a_in_registers: bool = False
    # one shared tile may be a GEMM operand read K-major by one GEMM and MN-major by another (CUDA); else each
    # role gets a tile of its own (MUSA lays a shared operand out by its majorness)
    gemm_tile_two_majors: bool = False
    # a GEMM operand tile's rows may be any multiple of 16 bytes (CUDA); else at most 256 bytes or a multiple of
    # 256 (a 16-bit head dim of 192 split into GEMMs of 128 and 64), with the shapes MUSA's warp partition takes
    gemm_any_extent: bool = False
    # a GEMM may read part of a shared tile's last two dimensions (CUDA); else every operand is a whole tile at
    # offset 0 (MUSA's SQMMA takes an operand's own stride and no offset; a leading dimension may be indexed)
    gemm_tile_slices: bool = False
    # the code generator prints float vectors wider than 8 lanes (CUDA); else tilings keep them at 8
    wide_float_vectors: bool = False
    source: str = "detected"  # "detected" or "env"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def has_gpu(self) -> bool:
        return self.kind in ("cuda", "musa")

    @property
    def torch_device(self) -> str:
        """The torch device string for tensors on this platform."""
        return self.kind

    def tilelang_target(self):
        """The ``target=`` argument for ``tilelang.compile`` / ``tilelang.jit``.

        Raises ``RuntimeError`` on a platform with nothing to compile for.
        """
        if self.target_kind == "cuda":
            return {"kind": "cuda", "arch": self.arch}
        if self.target_kind == "musa":
            return musa_target(self.arch)
        raise RuntimeError(
            "no TileLang target on this machine (no CUDA or MUSA GPU found); set "
            f"{TARGET_ENV}=sm_90a (or mp_31) to compile kernels without a GPU"
        )

    def describe(self) -> str:
        parts = [f"device={self.kind}"]
        if self.has_gpu:
            parts.append(f"name={self.device_name!r}")
        if self.capability:
            parts.append(f"capability={self.capability[0]}.{self.capability[1]}")
        if self.arch:
            parts.append(f"target={self.target_kind}:{self.arch}")
        flags = [n for n in FEATURES if getattr(self, n)]
        parts.append("features=" + (",".join(flags) if flags else "none"))
        if self.sm_count:
            parts.append(f"sms={self.sm_count}")
        if self.source != "detected":
            parts.append(f"from={self.source}")
        return " ".join(parts)


def _cuda_arch(capability: tuple[int, int]) -> str:
    major, minor = capability
    arch = f"sm_{major}{minor}"
    # The "a" suffix unlocks architecture-specific instructions (WGMMA, setmaxnreg on Hopper).
    if (major, minor) in ((9, 0), (10, 0), (10, 3), (12, 0), (12, 1)):
        arch += "a"
    return arch


def _cuda_features(arch: str) -> dict:
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    if not m:
        raise ValueError(f"{TARGET_ENV}: cannot parse CUDA arch {arch!r}; expected e.g. sm_90a, sm_80")
    cc = int(m.group(1)) * 10 + int(m.group(2))
    return {
        "capability": (int(m.group(1)), int(m.group(2))),
        "fp8": cc >= 89,
        "bulk_copy": cc >= 90,
        "warpgroup_mma": cc == 90 and m.group(3) == "a",
        "warp_specialized": cc == 90 and m.group(3) == "a",
        "dependent_launch": cc >= 90,
        "clusters": cc >= 90,
        "load_hints": cc >= 80,
        "async_proxy_fence": cc >= 90,
        "gemm_a_in_registers": True,
        "gemm_tile_two_majors": True,
        "gemm_any_extent": True,
        "gemm_tile_slices": True,
        "wide_float_vectors": True,
    }


def _musa_features(arch: str) -> dict:
    m = re.fullmatch(r"mp_(\d)(\d)", arch)
    if not m:
        raise ValueError(f"{TARGET_ENV}: cannot parse MUSA arch {arch!r}; expected e.g. mp_31, mp_22")
    major = int(m.group(1))
    # MP31 (S5000) and newer: FP8, TME bulk copy and SQMMA; MP22 (S4000): none of them.
    return {
        "capability": (major, int(m.group(2))),
        "fp8": major >= 3,
        "bulk_copy": major >= 3,
        "warpgroup_mma": major >= 3,
        # not yet: tilelang-musa's lowering of named barriers and register reallocation is unverified
        "warp_specialized": False,
        "dependent_launch": False,
        "clusters": False,
        "load_hints": False,
        "async_proxy_fence": False,
        # SQMMA, PH1 WMMA and the FMA fallback of tilelang-musa's GEMM lowering read A from shared memory only
        "gemm_a_in_registers": False,
        # what tilelang-musa's lowering for MP31 refuses (docs/musa.md): its layout inference lays a shared GEMM
        # operand out by majorness, its SQMMA swizzles chunk a tile's rows by 256 bytes, its GEMMs take whole
        # tiles at offset 0, its code generator prints float vectors of up to 8 lanes
        "gemm_tile_two_majors": False,
        "gemm_any_extent": False,
        "gemm_tile_slices": False,
        "wide_float_vectors": False,
    }


def target_features(kind: str, arch: str) -> dict:
    """The capability flags (:data:`FEATURES`) and capability of a compile target, e.g. ("cuda", "sm_90a"),
    under the current settings (``MUSA_ATTN_SHARED_P`` turns ``gemm_a_in_registers`` off, ``MUSA_ATTN_MUSA_FORMS``
    every flag of :data:`LOWERING_FLAGS`)."""
    feats = _cuda_features(arch) if kind == "cuda" else _musa_features(arch)
    current = config.settings()
    if current.shared_p or current.musa_forms:
        feats["gemm_a_in_registers"] = False
    if current.musa_forms:
        feats.update(dict.fromkeys(LOWERING_FLAGS, False))
    return feats


def parse_target(target) -> tuple[str, str]:
    """``(kind, arch)`` of a TileLang target in any form this package passes: a ``{"kind", "arch"}`` dict, a
    TVM target string (``"musa -arch=mp_31"``, ``"cuda -arch=sm_90a"``) or an object with ``kind.name`` and
    ``arch`` (a TVM ``Target``). Raises ValueError for anything else."""
    if isinstance(target, dict):
        kind, arch = target.get("kind"), target.get("arch")
    elif isinstance(target, str):
        m = re.fullmatch(r"\s*(\w+)(?:\s+-arch=(\w+))?\s*", target)
        kind, arch = (m.group(1), m.group(2)) if m else (None, None)
    else:
        kind = getattr(getattr(target, "kind", None), "name", None)
        arch = getattr(target, "arch", None)
    if kind not in ("cuda", "musa") or not arch:
        raise ValueError(f"cannot read a CUDA/MUSA kind and arch from the target {target!r}; expected e.g. "
                         '{"kind": "musa", "arch": "mp_31"} or "musa -arch=mp_31"')
    return str(kind), str(arch)


def features_of(target=None) -> dict:
    """The capability flags of a compile target (see :func:`parse_target` for its forms; None: this platform's,
    under the current settings)."""
    if target is None:
        plat = get_platform()
        return {n: getattr(plat, n) for n in FEATURES}
    return _flags(target_features(*parse_target(target)))


@functools.lru_cache(maxsize=None)
def tvm_parses_target_strings() -> bool:
    """Whether the installed TileLang's TVM still parses command-line target strings (``"cuda -arch=sm_80"``).
    TVM 0.25, which TileLang 0.1.12+ (and tilelang-musa 0.1.12+musa.1) build on, takes only the dict form."""
    from .cache import configure_tilelang_env

    configure_tilelang_env()  # TileLang's environment set up before its TVM loads
    from tilelang import tvm

    try:
        tvm.target.Target("cuda -arch=sm_80")
    except Exception:
        return False
    return True


def musa_target(arch: str):
    """The ``target=`` of a MUSA arch in the form the installed TileLang takes: the dict
    ``{"kind": "musa", "arch": "mp_31"}`` where its TVM has no target-string parser, else the string
    ``"musa -arch=mp_31"`` (what tilelang-musa builds on older TVMs take; mcc gets ``--cuda-gpu-arch`` from
    the arch either way)."""
    if tvm_parses_target_strings():
        return f"musa -arch={arch}"
    return {"kind": "musa", "arch": arch}


def _flags(feats: dict) -> dict:
    """The capability flags of a ``_cuda_features`` / ``_musa_features`` result, as Platform fields."""
    return {n: feats[n] for n in FEATURES}


def musa_runtime_available() -> bool:
    """``torch_musa`` importable and at least one MUSA device visible."""
    if importlib.util.find_spec("torch_musa") is None:
        return False
    try:
        importlib.import_module("torch_musa")
    except Exception:
        return False
    musa = getattr(torch, "musa", None)
    try:
        return bool(musa is not None and musa.is_available() and musa.device_count() > 0)
    except Exception:
        return False


def tilelang_supports_musa() -> bool:
    """Whether the installed TileLang is a MUSA-capable build (tilelang-musa)."""
    spec = importlib.util.find_spec("tilelang")
    if spec is None:
        return False
    try:
        version = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    if "musa" in version:
        return True
    return importlib.util.find_spec("tilelang.contrib.mcc") is not None


def _detect_musa() -> Platform:
    musa = torch.musa
    props = musa.get_device_properties(musa.current_device())
    capability = (int(props.major), int(props.minor))
    arch = f"mp_{capability[0]}{capability[1]}"
    feats = target_features("musa", arch)
    notes = ()
    target_kind = "musa"
    if not tilelang_supports_musa():
        target_kind = None
        notes = ("torch_musa found but the installed TileLang has no MUSA backend: install tilelang-musa",)
    return Platform(
        kind="musa",
        target_kind=target_kind,
        arch=arch,
        device_name=str(getattr(props, "name", "MUSA device")),
        capability=capability,
        sm_count=int(getattr(props, "multi_processor_count", 0)),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0)) or _default_smem_per_sm("musa", arch),
        **_flags(feats),
        notes=notes,
    )


def _detect_cuda() -> Platform:
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    capability = (int(props.major), int(props.minor))
    arch = _cuda_arch(capability)
    feats = target_features("cuda", arch)
    return Platform(
        kind="cuda",
        target_kind="cuda",
        arch=arch,
        device_name=props.name,
        capability=capability,
        sm_count=int(props.multi_processor_count),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0)) or _default_smem_per_sm("cuda", arch),
        **_flags(feats),
    )


def _from_override(value: str, detected: Platform) -> Platform:
    raw = value.strip().lower()
    if raw == "cpu":
        return Platform(kind=detected.kind, target_kind=None, arch=None, device_name=detected.device_name,
                        capability=detected.capability, sm_count=detected.sm_count,
                        smem_per_sm=detected.smem_per_sm, source="env")
    kind, _, arch = raw.partition(":")
    if kind.startswith("sm_"):
        kind, arch = "cuda", kind
    elif kind.startswith("mp_"):
        kind, arch = "musa", kind
    if kind not in ("cuda", "musa"):
        raise ValueError(
            f"{TARGET_ENV}={value!r} is not understood; use e.g. sm_90a, cuda:sm_90a, mp_31, musa:mp_31 or cpu"
        )
    if not arch:
        if detected.target_kind != kind or not detected.arch:
            raise ValueError(f"{TARGET_ENV}={value!r} names no arch and no {kind} device is present to read it from")
        arch = detected.arch
    feats = target_features(kind, arch)
    same_device = detected.target_kind == kind
    return Platform(
        kind=detected.kind,
        target_kind=kind,
        arch=arch,
        device_name=detected.device_name,
        capability=feats["capability"],
        sm_count=detected.sm_count if same_device else _default_sm_count(kind, arch),
        smem_per_sm=detected.smem_per_sm if same_device else _default_smem_per_sm(kind, arch),
        **_flags(feats),
        source="env",
    )


def _default_sm_count(kind: str, arch: str) -> int:
    """SM count assumed when compiling for a chip that is not present (used only to size split-KV)."""
    if kind == "cuda":
        return {"sm_90a": 132, "sm_90": 132, "sm_80": 108, "sm_89": 128}.get(arch, 108)
    return {"mp_31": 56, "mp_22": 48}.get(arch, 48)


def _default_smem_per_sm(kind: str, arch: str) -> int:
    """Shared memory per SM assumed when the device does not report it or is not present (sizes split-KV)."""
    if kind == "cuda":
        return {"sm_90a": 228, "sm_90": 228, "sm_80": 164, "sm_89": 100, "sm_86": 100}.get(arch, 100) * 1024
    # MUSA: MP31 (S5000) as tilelang-musa's own kernel configs take it (192 KB); others a conservative guess
    return {"mp_31": 192}.get(arch, 128) * 1024


def detect() -> Platform:
    """Detect the platform now (uncached). Prefer :func:`get_platform`."""
    if musa_runtime_available():
        detected = _detect_musa()
    elif torch.cuda.is_available() and torch.version.cuda is not None:
        detected = _detect_cuda()
    else:
        detected = Platform(kind="cpu", target_kind=None, arch=None)
    override = config.settings().target
    if override:
        return _from_override(override, detected)
    return detected


@functools.lru_cache(maxsize=None)
def get_platform() -> Platform:
    """The platform of this process (detected once; :func:`reset`, ``config.refresh`` and ``config.override``
    clear it)."""
    return detect()


config.on_change(get_platform.cache_clear)


def reset() -> None:
    """Detect the platform again on next use, and empty every cache derived from it (tiling plans)."""
    config.clear_derived_caches()


def device_kind_of(tensor: torch.Tensor) -> str:
    """``cuda``, ``musa`` or ``cpu`` for a tensor (other device types are reported as they are)."""
    return tensor.device.type


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` (a CUDA or MUSA tensor's) is being captured into a graph; False on
    the CPU. ``torch.musa`` (torch_musa) mirrors ``torch.cuda``'s function where it is installed."""
    module = getattr(torch, device.type, None) if device.type in ("cuda", "musa") else None
    probe = getattr(module, "is_current_stream_capturing", None)
    return bool(probe()) if probe is not None else False


def fp8_e4m3_dtype() -> torch.dtype:
    """The FP8 e4m3 dtype used for KV caches (same on CUDA and MUSA)."""
    return torch.float8_e4m3fn


def moe_experts_enabled() -> bool:
    """Whether the engine adapters route the FP8 MoE experts to :mod:`musa_attn_backend.kernels.moe`
    (``MUSA_ATTN_MOE``: ``auto`` on a MUSA device, ``on``, ``off``)."""
    value = config.settings().moe
    if value == "auto":
        return get_platform().kind == "musa"
    return value == "on"


def model_kernels_enabled(kind: Optional[str] = None) -> bool:
    """Whether SGLang's DeepSeek-V4 model-side kernels are replaced by this package's on a device of ``kind``
    (default: this platform's): ``MUSA_ATTN_MODEL_KERNELS`` ``auto`` where SGLang has no kernels of its own (MUSA,
    CPU), ``on`` everywhere, ``off`` nowhere."""
    value = config.settings().model_kernels
    if value == "auto":
        return (kind or get_platform().kind) != "cuda"
    return value == "on"


def direct_launch(target_kind: Optional[str] = None) -> bool:
    """Whether a launch may call a TileLang kernel's compiled TVM-FFI entry itself, without TileLang's Python
    wrapper (:func:`musa_attn_backend._tilelang.launcher`), for targets of ``target_kind`` (default: this
    platform's). On CUDA upstream TileLang's wrapper adds only bookkeeping for a kernel whose outputs the caller
    passes (it hands the same arguments to the same entry), at about twice the entry's host cost
    (``scripts/launch_overhead.py``; the figures in docs/dsv4.md). Not on MUSA: tilelang-musa's wrapper has not
    been read on a device (it may set the MUSA stream there), so its launches keep the wrapper."""
    return (target_kind or get_platform().target_kind) == "cuda"
