"""Every ``MUSA_ATTN_*`` switch, declared once, and the settings object the package reads them through.

The environment is read once per process, on the first call of :func:`settings`, into a frozen
:class:`Settings`; nothing else in the package reads ``MUSA_ATTN_*`` variables. :func:`refresh` reads the
environment again (for a process that changes it, e.g. the CLI setting ``MUSA_ATTN_TARGET`` for its worker
processes) and :func:`override` swaps in other values for the duration of a ``with`` block (tests). Both
empty the caches of values derived from the settings (the detected platform, the launchers' tiling plans;
:func:`on_change` registers them), so a launch after either sees the new values.

Boolean switches take ``1``/``0`` (also ``true``/``false``, ``yes``/``no``, ``on``/``off``, any case); an
unset or empty variable means the default. Any other value raises :class:`SettingsError` naming the variable
and what it accepts, on the first read: a typo never silently selects a default.

Switches marked ``kernels`` change which kernels are built for a model. They are part of every compile-cache
key (:func:`kernel_settings`), ``musa-attn warmup`` compiles under them and records them next to the kernels,
and a server started with other values says which (:func:`musa_attn_backend.warmup.check_warmup_settings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


class SettingsError(ValueError):
    """A ``MUSA_ATTN_*`` variable (or an :func:`override` argument) with a value it does not accept."""


@dataclass(frozen=True)
class Switch:
    """One setting: its :class:`Settings` field, environment variable, kind (``bool``, ``text`` or ``path``),
    default, whether it changes which kernels are built, and what it does."""

    field: str
    env: str
    kind: str
    default: Any
    kernels: bool
    meaning: str


def _switch(env: str, *, default: Any, kernels: bool, meaning: str) -> Any:
    """A :class:`Settings` field that declares its switch: the environment variable, the default, whether it
    changes which kernels are built, and what it does (the switch's kind follows from the field's type)."""
    return dataclasses.field(default=default, metadata={"env": env, "kernels": kernels, "meaning": meaning})


@dataclass(frozen=True)
class Settings:
    """The effective value of every switch; each field declares its switch (:data:`SWITCHES`)."""

    split_mixed: bool = _switch(
        "MUSA_ATTN_SPLIT_MIXED", default=True, kernels=False,
        meaning="a mixed batch whose metadata counts its leading decodes runs them with the decode kernel and the rest "
                "with the prefill kernel (0: the whole batch takes the prefill kernel; warmup builds both either way)")
    pingpong_gather: bool = _switch(
        "MUSA_ATTN_PINGPONG_GATHER", default=True, kernels=True,
        meaning="the ping-pong prefill with a gathering (cp.async) producer, for pages of any size, is a prefill "
                "candidate ahead of the row-gather kernel (0: removed)")
    pdl: bool = _switch(
        "MUSA_ATTN_PDL", default=True, kernels=True,
        meaning="the split-KV combine is a programmatic dependent launch of the decode kernel where the target has it "
                "(CUDA sm_90+), so its launch overlaps the decode's last wave (0: an ordinary launch)")
    tma_chunks: bool = _switch(
        "MUSA_ATTN_TMA_CHUNKS", default=True, kernels=True,
        meaning="the ping-pong prefill with TMA copies of page chunks (16/32/64 rows) is a candidate for pages of a "
                "multiple of 16 that hold no whole key tile: the default kernel for pages of 64 (0: removed)")
    chunked_combine: bool = _switch(
        "MUSA_ATTN_CHUNKED_COMBINE", default=True, kernels=True,
        meaning="the split-KV combine reads the partial LSEs at once and the partial outputs 8 splits at a time, their "
                "loads in flight together (0: one split after another)")
    new_kv_prefill: bool = _switch(
        "MUSA_ATTN_NEW_KV_PREFILL", default=True, kernels=True,
        meaning="a prefill whose requests have no cached prefix reads the batch's new K/V with whole-tile TMA copies "
                "instead of the paged cache, whatever the page size (0: the cache path)")
    shared_p: bool = _switch(
        "MUSA_ATTN_SHARED_P", default=False, kernels=True,
        meaning="every attention program stages the softmax probabilities P through shared memory before the P V "
                "product, as it must where the target's GEMMs take no register operand (MUSA), and the kernel choice "
                "is the one for such a target: to run and measure MUSA's programs on CUDA (0: only where needed)")
    musa_forms: bool = _switch(
        "MUSA_ATTN_MUSA_FORMS", default=False, kernels=True,
        meaning="every program takes the form MUSA's TileLang lowers (P through shared memory, one majorness a shared "
                "GEMM tile, GEMM tile rows of at most 256 bytes or multiples of 256, whole tiles as GEMM operands, "
                "float vectors of at most 8 lanes: platform.LOWERING_FLAGS off), as the programs MUSA would choose: to "
                "run and measure MUSA's programs on CUDA (0: only where the target needs them)")
    dsv4_program: str = _switch(
        "MUSA_ATTN_DSV4_PROGRAM", default="auto", kernels=True,
        meaning="the DeepSeek-V4 sparse attention program: auto (scheduled where the target has warp specialisation, "
                "register GEMM operands and FP8, else portable), scheduled (FlashMLA's division of the work on a "
                "per-batch plan), paired (one block a token, its two math warp groups taking the key tiles in pairs: "
                "FlashMLA's prefill division; correct, 1.15-1.19x the scheduled program's prefill time on the H100), "
                "paired_ws (the paired division over a bf16 workspace of the call's selected rows, built with a host "
                "synchronisation, so not under CUDA graph capture; its kernel 0.89-0.91x the scheduled program's "
                "prefill time on the H100, the workspace's build on top), portable, portable_ws (the portable program "
                "over such a workspace: any target, MUSA included) or staged_ws (over such a workspace, a producer warp "
                "group staging the next key tile beside the math, within MUSA's rules on every target); a workspace "
                "program named here also runs FlashMLA's sparse prefill entry; a program the target cannot run is "
                "refused, never replaced")
    target: Optional[str] = _switch(
        "MUSA_ATTN_TARGET", default=None, kernels=True,
        meaning="compile for this target instead of the detected device: sm_90a, cuda:sm_90a, cuda (arch of the "
                "device), mp_31, musa:mp_31, musa or cpu (checked by musa_attn_backend.platform)")
    cache_dir: Optional[Path] = _switch(
        "MUSA_ATTN_CACHE_DIR", default=None, kernels=False,
        meaning="the kernel cache, tuning tables and warmup record (unset: $XDG_CACHE_HOME/musa_attn_backend, else "
                "~/.cache/musa_attn_backend)")
    poison: bool = _switch(
        "MUSA_ATTN_POISON", default=False, kernels=False,
        meaning="fill outputs and split-KV partials with NaN before the kernels run, so an element no kernel writes "
                "shows up (a debug aid; the tests turn it on)")
    vllm_cuda_graphs: bool = _switch(
        "MUSA_ATTN_VLLM_CUDA_GRAPHS", default=True, kernels=False,
        meaning="the vLLM builders declare CUDA-graph support and build decode batches into persistent buffers under "
                "full CUDA graphs: UNIFORM_SINGLE_TOKEN_DECODE for dense attention, UNIFORM_BATCH for DeepSeek-V4's "
                "layer (0: both declare NEVER)")
    moe: str = _switch(
        "MUSA_ATTN_MOE", default="auto", kernels=False,
        meaning="the engines' FP8 and MXFP4 MoE experts run on this package's grouped GEMMs (kernels.moe): auto (on a "
                "MUSA device only), on (also on CUDA), off (the engines' own MoE kernels)")
    model_kernels: str = _switch(
        "MUSA_ATTN_MODEL_KERNELS", default="auto", kernels=False,
        meaning="SGLang's DeepSeek-V4 model-side kernels (q norm + RoPE, RoPE, clamped SwiGLU, mHC) are this package's "
                "(sglang.model_hooks): auto (where SGLang has none of its own: MUSA and CPU), on (also on CUDA: the "
                "MUSA situation on an NVIDIA GPU), off (SGLang's own, which exist on CUDA only)")
    compiled_launch: str = _switch(
        "MUSA_ATTN_COMPILED_LAUNCH", default="auto", kernels=False,
        meaning="DeepSeek-V4's sparse decode launches its kernels through one call into C++ (musa_attn_backend/csrc, "
                "built with torch's extension loader into the cache directory by warmup or at first use), and "
                "FlashMLA's entry replays a batch's launches recorded there, where the platform calls TileLang's "
                "compiled entries directly (CUDA): auto (a build that fails is reported once, with the compiler's "
                "reason, and TileLang's launches are used), on (a build that fails raises), off (TileLang's launches)")
    commit: Optional[str] = _switch(
        "MUSA_ATTN_COMMIT", default=None, kernels=False,
        meaning="the commit benchmark results record where the checkout has no usable git metadata (benchmarks only)")


_KINDS = {"bool": "bool", "str": "text", "Optional[str]": "text", "Optional[Path]": "path"}  # field type -> kind
SWITCHES: tuple[Switch, ...] = tuple(
    Switch(f.name, f.metadata["env"], _KINDS[f.type], f.default, f.metadata["kernels"], f.metadata["meaning"])
    for f in dataclasses.fields(Settings))
BY_FIELD: dict[str, Switch] = {s.field: s for s in SWITCHES}
CHOICES: dict[str, tuple[str, ...]] = {"moe": ("auto", "on", "off"), "model_kernels": ("auto", "on", "off"),
                                       "compiled_launch": ("auto", "on", "off"),
                                       "dsv4_program": ("auto", "scheduled", "paired", "paired_ws", "portable",
                                                                        "portable_ws", "staged_ws")}  # text switches with a fixed set of values

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def text(switch: Switch, value: Any) -> str:
    """``value`` as the environment variable would spell it (``1``/``0`` for booleans, ``(unset)`` for None)."""
    if value is None:
        return "(unset)"
    if switch.kind == "bool":
        return "1" if value else "0"
    return str(value)


def parse(switch: Switch, raw: str) -> Any:
    """The value of ``switch`` spelled ``raw`` in the environment (empty: the default); raises SettingsError."""
    value = raw.strip()
    if not value:
        return switch.default
    if switch.kind == "bool":
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise SettingsError(f"{switch.env}={raw!r} is not understood: use 1 or 0 (also true/false, yes/no, on/off), "
                            f"or leave it unset for the default ({text(switch, switch.default)})")
    if switch.kind == "path":
        return Path(value).expanduser()
    return _choice(switch, value, f"{switch.env}={raw!r} is not understood")


def _choice(switch: Switch, value: str, what: str) -> str:
    """``value`` (lower-cased) for a text switch with a fixed set of values (:data:`CHOICES`), else as given."""
    allowed = CHOICES.get(switch.field)
    if allowed is None:
        return value
    if value.lower() not in allowed:
        raise SettingsError(f"{what}: use one of {', '.join(allowed)}")
    return value.lower()


def _coerce(switch: Switch, value: Any) -> Any:
    """An :func:`override` argument, checked against the switch's kind."""
    if switch.kind == "bool":
        if not isinstance(value, bool):
            raise SettingsError(f"override({switch.field}=...): {switch.env} takes True or False, got {value!r}")
        return value
    if value is None:
        return None
    if switch.kind == "path" and isinstance(value, (str, Path)):
        return Path(value).expanduser()
    if switch.kind == "text" and isinstance(value, str) and value.strip():
        return _choice(switch, value.strip(), f"override({switch.field}={value!r})")
    raise SettingsError(f"override({switch.field}=...): {switch.env} takes "
                        f"{'a path' if switch.kind == 'path' else 'a non-empty string'} or None, got {value!r}")


_lock = threading.RLock()
_current: Optional[Settings] = None
_sources: dict[str, str] = {}  # field -> "default" | "environment" | "override"
_derived: list[Callable[[], None]] = []


def read_environment(environ=None) -> tuple[Settings, dict[str, str]]:
    """The settings ``environ`` (default ``os.environ``) spells, and where each value came from."""
    environ = os.environ if environ is None else environ
    values, sources = {}, {}
    for s in SWITCHES:
        raw = environ.get(s.env)
        if raw is None or not raw.strip():
            values[s.field], sources[s.field] = s.default, "default"
        else:
            values[s.field], sources[s.field] = parse(s, raw), "environment"
    return Settings(**values), sources


def settings() -> Settings:
    """The settings of this process: the environment as read on the first call (or since :func:`refresh`),
    or what :func:`override` put in place."""
    current = _current
    return current if current is not None else refresh()


def on_change(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear`` to empty a cache of values derived from the settings, the platform or the tuning
    table; :func:`clear_derived_caches` (run by :func:`refresh` and :func:`override`) calls it."""
    with _lock:
        _derived.append(clear)
    return clear


def clear_derived_caches() -> None:
    """Empty every cache registered with :func:`on_change` (the next launch plans again)."""
    with _lock:
        hooks = list(_derived)
    for clear in hooks:
        clear()


def _install(new: Settings, sources: dict[str, str]) -> None:
    global _current, _sources
    with _lock:
        _current, _sources = new, dict(sources)
    clear_derived_caches()


def install(new: Settings, *, source: str = "override") -> None:
    """Put ``new`` in place of the current settings until the next :func:`refresh` (e.g. a worker process
    taking its parent's; every value reported as coming from ``source``)."""
    if not isinstance(new, Settings):
        raise SettingsError(f"install: expected a Settings, got {type(new).__name__}")
    _install(new, {s.field: source for s in SWITCHES})


def refresh() -> Settings:
    """Read the environment again (dropping any :func:`override` in force) and return the new settings."""
    new, sources = read_environment()
    _install(new, sources)
    return new


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[Settings]:
    """``with override(pdl=False, target="sm_90a"): ...``: these values instead of the current ones until the
    block ends, then the previous settings again (derived caches emptied at both ends). Raises SettingsError
    for an unknown field or a value of the wrong kind."""
    unknown = sorted(set(fields) - set(BY_FIELD))
    if unknown:
        raise SettingsError(f"override: unknown setting(s) {', '.join(unknown)}; settings are "
                            f"{', '.join(BY_FIELD)}")
    base = settings()
    with _lock:
        previous = (_current, dict(_sources))
    new = dataclasses.replace(base, **{k: _coerce(BY_FIELD[k], v) for k, v in fields.items()})
    _install(new, {**previous[1], **{k: "override" for k in fields}})
    try:
        yield new
    finally:
        _install(*previous)


def kernel_settings(current: Optional[Settings] = None) -> tuple[tuple[str, str], ...]:
    """``(env name, value)`` of the switches that change which kernels are built, as part of compile-cache
    keys and the warmup record. Without the target: that enters resolved (the compile target of the device or
    of ``MUSA_ATTN_TARGET``), so kernels warmed up with ``--target sm_90a`` serve a device detected as
    sm_90a."""
    current = current or settings()
    return tuple((s.env, text(s, getattr(current, s.field))) for s in SWITCHES if s.kernels and s.field != "target")


def describe() -> list[dict]:
    """One row per switch: env name, value, default, where the value came from, whether it changes kernels,
    and its meaning (``musa-attn doctor`` prints these)."""
    current = settings()
    with _lock:
        sources = dict(_sources)
    return [{"env": s.env, "value": text(s, getattr(current, s.field)), "default": text(s, s.default),
             "source": sources.get(s.field, "default"), "kernels": s.kernels, "meaning": s.meaning}
            for s in SWITCHES]


def markdown_table() -> str:
    """The README's table of switches: variable, default, whether it changes kernels, meaning."""
    rows = ["| variable | default | kernels | meaning |", "|---|---|---|---|"]
    for s in SWITCHES:
        rows.append(f"| `{s.env}` | {text(s, s.default)} | {'yes' if s.kernels else ''} | {s.meaning} |")
    return "\n".join(rows)

