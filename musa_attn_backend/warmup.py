"""Ahead-of-time compilation of every kernel a model will use (``musa-attn warmup``).

From a Hugging Face ``config.json`` (or explicit head counts), the tensor-parallel size, the engine (its KV
cache layout) and the dtypes, :func:`plan` lists the kernels serving will launch: prefill/extend, decode
(with and without split-KV, and for speculative verify lengths), the split combine and the KV write.
:func:`run` compiles them in parallel worker processes into the on-disk kernel cache, so a serving image
can ship warm and nothing is compiled on the serving hot path (the first call only loads the kernel).
:func:`lower_all` (``musa-attn warmup --lower-only``) runs only TileLang's lowering of the same kernels, for
any target TileLang knows, and writes their device sources: the portability check of a machine without the
device compiler.

Which kernels a model needs also depends on the kernel settings (``config.kernel_settings``: the switches
marked ``kernels`` in :mod:`musa_attn_backend.config`): the plan is made and compiled under the settings of
the process that runs it (its workers inherit them), and :func:`record_settings` writes them into the cache
directory (``warmup-settings.json``, one entry per compile target). A server calls
:func:`check_warmup_settings` once at start-up; where its kernel settings differ from the recorded ones it logs
a warning naming each switch and both values, since the kernels those select were not warmed up and would be
compiled on the serving hot path.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from filelock import FileLock

from . import config

logger = logging.getLogger("musa_attn_backend")
RECORD_NAME = "warmup-settings.json"

ENGINES = ("sglang", "vllm")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16"}
KV_DTYPES = {"auto": None, "fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3"}


@dataclass(frozen=True)
class ModelAttention:
    """The attention shapes of one model on one tensor-parallel rank."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str = "bfloat16"
    has_window: bool = False  # some layers use a sliding window
    only_window: bool = False  # every layer does
    has_softcap: bool = False
    has_sinks: bool = False


def from_hf_config(config: dict, *, tp: int = 1, dtype: Optional[str] = None) -> ModelAttention:
    """Read head counts, head dim, dtype, sliding window, logit softcap and sinks from a HF config dict."""
    cfg = config.get("text_config", config)
    hq_total = int(cfg["num_attention_heads"])
    hkv_total = int(cfg.get("num_key_value_heads") or hq_total)
    if hq_total % tp:
        raise ValueError(f"num_attention_heads={hq_total} is not divisible by tp={tp}")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq_total)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    layer_types = cfg.get("layer_types") or []
    windowed = [t for t in layer_types if "sliding" in str(t)]
    has_window = bool(window) and (not layer_types or bool(windowed))
    only_window = has_window and (not layer_types or len(windowed) == len(layer_types)) and \
        not cfg.get("max_window_layers")
    model_type = str(cfg.get("model_type", ""))
    torch_dtype = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return ModelAttention(
        num_q_heads=hq_total // tp,
        num_kv_heads=max(1, hkv_total // tp),
        head_dim=head_dim,
        head_dim_v=int(cfg.get("v_head_dim") or head_dim),
        dtype=DTYPES.get(str(torch_dtype).replace("torch.", ""), "bfloat16"),
        has_window=has_window,
        only_window=only_window,
        has_softcap=bool(cfg.get("attn_logit_softcapping")),
        has_sinks=model_type.startswith("gpt_oss") or bool(cfg.get("attention_sinks")),
    )


def cache_layouts(engine: str, hkv: int, d: int, dv: int) -> tuple[tuple, tuple]:
    """(width, row stride, head stride) of the K and V cache rows as each engine allocates them."""
    if engine == "sglang":  # separate K and V pools [slots, H, D]
        return (hkv * d, hkv * d, d), (hkv * dv, hkv * dv, dv)
    if engine == "vllm":  # one NHD buffer [blocks, block_size, H, D + Dv]; K and V are views
        row = hkv * (d + dv)
        return ((hkv - 1) * (d + dv) + d, row, d + dv), ((hkv - 1) * (d + dv) + dv, row, d + dv)
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def new_kv_layouts(hq: int, hkv: int, d: int, dv: int) -> list[tuple[tuple, tuple]]:
    """(K, V) row layouts of the new K/V a prefill without cached prefixes may read (``new_kv``): views of the
    fused ``[q | k | v]`` projection (both engines, when rotary embedding works in place), or K/V of their own."""
    row = hq * d + hkv * d + hkv * dv
    return [((hkv * d, row, d), (hkv * dv, row, dv)), ((hkv * d, hkv * d, d), (hkv * dv, hkv * dv, dv))]


@dataclass(frozen=True)
class Job:
    """One kernel to build: ``kind`` names its launcher's kernel getter (:data:`BUILDERS`), called with ``args``
    and the keyword arguments ``kwargs`` (pairs)."""

    kind: str
    args: tuple
    kwargs: tuple = ()

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{self.kind}{self.args}" + (f" {{{extra}}}" if extra else "")


# job kind -> (module, kernel getter): the launchers' own functions, so a job builds the kernel the launch asks
# for, under the same compile key
BUILDERS = {
    "prefill": ("musa_attn_backend.kernels.attention.tilelang_impl", "prefill_kernel"),
    "decode": ("musa_attn_backend.kernels.attention.tilelang_impl", "decode_kernel"),
    "combine": ("musa_attn_backend.kernels.attention.tilelang_impl", "combine_kernel"),
    "write_kv": ("musa_attn_backend.kernels.kv_cache.tilelang_impl", "write_kv_kernel"),
    "dsv4_sparse_mqa": ("musa_attn_backend.kernels.dsv4.sparse.tilelang_impl", "sparse_mqa_kernel"),
    "dsv4_combine": ("musa_attn_backend.kernels.dsv4.sparse.tilelang_impl", "combine_kernel"),
    "dsv4_sched": ("musa_attn_backend.kernels.dsv4.sparse.tilelang_impl", "sched_kernel"),
    "dsv4_sparse_combine": ("musa_attn_backend.kernels.dsv4.sparse.tilelang_impl", "sched_combine_kernel"),
    "dsv4_workspace_rows": ("musa_attn_backend.kernels.dsv4.sparse.tilelang_impl", "workspace_rows_kernel"),
    "dsv4_write_kv": ("musa_attn_backend.kernels.dsv4.writers.tilelang_impl", "write_kv_v4_kernel"),
    "dsv4_write_index_k": ("musa_attn_backend.kernels.dsv4.writers.tilelang_impl", "write_index_k_kernel"),
    "dsv4_attention_slots": ("musa_attn_backend.kernels.dsv4.model.tilelang_impl", "attention_slots_kernel"),
    "dsv4_indexer_logits": ("musa_attn_backend.kernels.dsv4.indexer.tilelang_impl", "indexer_logits_kernel"),
    "dsv4_paged_indexer_logits": ("musa_attn_backend.kernels.dsv4.indexer.tilelang_impl", "paged_indexer_logits_kernel"),
    "dsv4_indexer_topk": ("musa_attn_backend.kernels.dsv4.indexer.tilelang_impl", "indexer_topk_kernel"),
    "dsv4_indexer_q": ("musa_attn_backend.kernels.dsv4.indexer.tilelang_impl", "indexer_q_kernel"),
    "dsv4_compress_rows": ("musa_attn_backend.kernels.dsv4.compressor.tilelang_impl", "compress_rows_kernel"),
    "dsv4_save_state": ("musa_attn_backend.kernels.dsv4.compressor.tilelang_impl", "save_state_kernel"),
    "dsv4_norm_rope": ("musa_attn_backend.kernels.dsv4.model.tilelang_impl", "norm_rope_kernel"),
    "dsv4_silu_mul_clamp": ("musa_attn_backend.kernels.dsv4.model.tilelang_impl", "silu_mul_clamp_kernel"),
    "dsv4_mhc_pre": ("musa_attn_backend.kernels.dsv4.model.tilelang_impl", "mhc_pre_kernel"),
    "dsv4_mhc_post": ("musa_attn_backend.kernels.dsv4.model.tilelang_impl", "mhc_post_kernel"),
    "moe_fp8_contiguous": ("musa_attn_backend.kernels.moe.tilelang_impl", "contiguous_kernel"),
    "moe_fp8_masked": ("musa_attn_backend.kernels.moe.tilelang_impl", "masked_kernel"),
    "moe_fp4_contiguous": ("musa_attn_backend.kernels.moe.tilelang_impl", "contiguous_fp4_kernel"),
    "moe_fp4_masked": ("musa_attn_backend.kernels.moe.tilelang_impl", "masked_fp4_kernel"),
    "moe_swiglu_quant": ("musa_attn_backend.kernels.moe.tilelang_impl", "swiglu_quant_kernel"),
    "moe_fp8_contiguous_swiglu": ("musa_attn_backend.kernels.moe.tilelang_impl", "contiguous_swiglu_kernel"),
    "moe_fp8_masked_swiglu": ("musa_attn_backend.kernels.moe.tilelang_impl", "masked_swiglu_kernel"),
    "moe_combine": ("musa_attn_backend.kernels.moe.tilelang_impl", "combine_kernel"),
    "moe_quantize_scatter": ("musa_attn_backend.kernels.moe.tilelang_impl", "quantize_scatter_kernel"),
}


DEFAULT_PAGE_SIZE = {"sglang": 1, "vllm": 16}


def plan(model: ModelAttention, *, engine: str = "sglang", kv_dtype: Optional[str] = None,
         speculative_tokens: int = 0, page_size: Optional[int] = None) -> list[Job]:
    """The kernels serving ``model`` will launch (``page_size``: the engine's, default its default)."""
    from .kernels.attention.tilelang_impl import AttnSpec, decode_config, new_kv_prefill_config

    kv = KV_DTYPES.get(kv_dtype or "auto", kv_dtype) or model.dtype
    k_layout, v_layout = cache_layouts(engine, model.num_kv_heads, model.head_dim, model.head_dim_v)
    windows = [True] if model.only_window else ([False, True] if model.has_window else [False])
    jobs: list[Job] = []
    for window in windows:
        spec = AttnSpec(model.num_q_heads, model.num_kv_heads, model.head_dim, model.head_dim_v, model.dtype, kv,
                        window, model.has_softcap, model.has_sinks, k_layout, v_layout)
        jobs.append(Job("prefill", (spec, True, page_size or DEFAULT_PAGE_SIZE[engine])))
        ncfg = new_kv_prefill_config(model.head_dim, model.head_dim_v, window) if not spec.is_fp8 else None
        if ncfg is not None:  # prefills without cached prefixes (MUSA_ATTN_NEW_KV_PREFILL=0: off)
            for kl, vl in new_kv_layouts(model.num_q_heads, model.num_kv_heads, model.head_dim, model.head_dim_v):
                nspec = dataclasses.replace(spec, k_layout=kl, v_layout=vl)
                jobs.append(Job("prefill", (nspec, True, page_size or DEFAULT_PAGE_SIZE[engine], None, ncfg, True)))
        q_lens = sorted({1} | ({1 + speculative_tokens} if speculative_tokens else set()))
        seen = set()
        for q in q_lens:
            dcfg = decode_config(q, spec.group, spec.is_fp8, spec.dv)
            if dcfg is None or dcfg in seen:
                continue  # those batches run the prefill kernel
            seen.add(dcfg)
            jobs += [Job("decode", (spec, dcfg, False)), Job("decode", (spec, dcfg, True))]
        jobs.append(Job("combine", (spec,)))
    jobs.append(Job("write_kv", (model.num_kv_heads, model.head_dim, model.head_dim_v, model.dtype, kv,
                                 k_layout, v_layout)))
    return list(dict.fromkeys(jobs))


def _build(job: Job):
    """Make the launcher's kernel for ``job`` (through ``compile_cached``, or what intercepts it)."""
    import importlib

    module, getter = BUILDERS[job.kind]
    return getattr(importlib.import_module(module), getter)(*job.args, **dict(job.kwargs))


def _compile(job: Job) -> tuple[Job, float]:
    t0 = time.perf_counter()
    _build(job)
    return job, time.perf_counter() - t0


@dataclass(frozen=True)
class Lowered:
    """The outcome of lowering one job's kernel: the generated device source (where it lowered), or the error;
    ``checked_only``: the target's rules were checked on its TIR (:func:`._tilelang.check_portable`) but the
    installed TileLang cannot lower for the target (a MUSA target without tilelang-musa), so nothing was
    lowered."""

    job: Job
    name: str  # the file stem its source is written under: <kind>-<digest of its compile key>
    source: Optional[str] = None
    error: Optional[str] = None
    seconds: float = 0.0
    checked_only: bool = False


def can_lower_for(target) -> bool:
    """Whether the installed TileLang lowers for ``target``: any CUDA target; a MUSA one only with tilelang-musa."""
    from .platform import parse_target, tilelang_supports_musa

    return parse_target(target)[0] != "musa" or tilelang_supports_musa()


def _lower(job: Job) -> Lowered:
    """The target's rules checked on ``job``'s kernel (:func:`._tilelang.check_portable`), then TileLang's lowering
    of it where the installed TileLang can lower for the target, without a device compiler (see
    :func:`lower_all`)."""
    from . import _tilelang

    t0 = time.perf_counter()
    seen: list = []
    checked_only = []

    def lower(key, build, target, pass_configs):
        seen.append(_tilelang.kernel_digest((key, repr(target)))[:12])
        func = build()
        _tilelang.check_portable(key, func, target)
        if not can_lower_for(target):
            checked_only.append(key)
            return None
        return _tilelang.lower(func, target, pass_configs).source

    try:
        with _tilelang.intercepting(lower):
            source = _build(job)
        error = None
    except Exception as e:  # reported per kernel, with its reason
        source, error = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    name = f"{job.kind}-{seen[0] if seen else 'unbuilt'}"
    return Lowered(job, name, source, error, time.perf_counter() - t0, bool(checked_only) and error is None)


def lower_all(jobs: Iterable[Job], out_dir: Optional[Path] = None, *, workers: int = 0,
              progress: bool = True) -> list[Lowered]:
    """Run TileLang's lowering, up to device source, for every job's kernel on this process's compile target
    (``MUSA_ATTN_TARGET``), in ``workers`` processes (0: one per core, at most 8). Needs no device compiler
    (nvcc, mcc) and no device: with a MUSA-capable TileLang this is the check that every kernel a model uses
    lowers for MUSA. Nothing enters the kernel cache. With ``out_dir``, each generated source is written to
    ``<out_dir>/<name>.<cu|mu>`` and an ``index.json`` lists every job, its file or its error."""
    from .platform import get_platform

    jobs = list(jobs)
    workers = workers or min(8, os.cpu_count() or 1)
    ctx = multiprocessing.get_context("spawn")
    results: list[Lowered] = []
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)) or 1, mp_context=ctx,
                             initializer=_use_settings, initargs=(config.settings(),)) as pool:
        futures = [pool.submit(_lower, j) for j in jobs]
        for fut in as_completed(futures):
            res = fut.result()
            results.append(res)
            if progress:
                state = ("checked (not lowered)" if res.checked_only else "lowered") if res.error is None \
                    else f"FAILED: {res.error}"
                print(f"[{len(results)}/{len(jobs)}] {res.name} {res.job.kind} ({res.seconds:.1f}s) {state}",
                      flush=True)
    order = {j: i for i, j in enumerate(jobs)}
    results.sort(key=lambda r: order[r.job])
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        ext = "mu" if get_platform().target_kind == "musa" else "cu"
        index = []
        for r in results:
            entry = {"name": r.name, "kind": r.job.kind, "job": r.job.describe(), "seconds": round(r.seconds, 2)}
            if r.checked_only:
                entry["checked_only"] = True
            elif r.source is not None:
                (out_dir / f"{r.name}.{ext}").write_text(r.source)
                entry["file"] = f"{r.name}.{ext}"
            else:
                entry["error"] = r.error
            index.append(entry)
        (out_dir / "index.json").write_text(json.dumps(
            {"target": repr(get_platform().tilelang_target()), "settings": dict(config.kernel_settings()),
             "kernels": index}, indent=1))
    return results


def run(jobs: Iterable[Job], *, workers: int = 0, progress: bool = True) -> list[tuple[Job, float]]:
    """Compile ``jobs`` in ``workers`` processes (0: one per core, at most 8); returns (job, seconds)."""
    jobs = list(jobs)
    workers = workers or min(8, os.cpu_count() or 1)
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc="warmup", unit="kernel")
        except ImportError:
            bar = None
    done: list[tuple[Job, float]] = []
    # spawn, not fork: the parent may hold an initialised CUDA context. The workers compile under this
    # process's settings (overrides included), not under whatever their environment says.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)) or 1, mp_context=ctx,
                             initializer=_use_settings, initargs=(config.settings(),)) as pool:
        futures = [pool.submit(_compile, j) for j in jobs]
        for fut in as_completed(futures):
            job, secs = fut.result()
            done.append((job, secs))
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{job.kind} {secs:.1f}s")
            elif progress:
                print(f"[{len(done)}/{len(jobs)}] {job.kind} ({secs:.1f}s)", flush=True)
    if bar is not None:
        bar.close()
    return done


def _use_settings(current: config.Settings) -> None:
    """Worker start-up: the parent's settings in place of the environment's."""
    config.install(current, source="parent process")


def _target_key(platform) -> str:
    """The record's key for a platform: its TileLang compile target, as the compile-cache keys spell it."""
    return repr(platform.tilelang_target())


def record_path() -> Path:
    """Where ``musa-attn warmup`` records the kernel settings it compiled with."""
    from .cache import cache_dir

    return cache_dir() / RECORD_NAME


def record_settings(platform=None) -> Path:
    """Record the current kernel settings as those the kernels of ``platform``'s target (default: this
    process's) were compiled with: a locked read-modify-write of the record, written to a temporary file and
    renamed over it."""
    from ._tilelang import tilelang_version
    from .platform import get_platform

    platform = platform or get_platform()
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = _read_record(path)
        data.setdefault("targets", {})[_target_key(platform)] = {
            "settings": dict(config.kernel_settings()), "tilelang": tilelang_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        data["format"] = 1
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    return path


def _read_record(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the warmup record {path} is unreadable ({type(e).__name__}: {e}); delete it and "
                           "rerun `musa-attn warmup`") from e
    if not isinstance(data, dict) or not isinstance(data.get("targets", {}), dict):
        raise RuntimeError(f"the warmup record {path} is not a musa-attn warmup record; delete it and rerun "
                           "`musa-attn warmup`")
    return data


def settings_differences(platform=None) -> Optional[list[tuple[str, str, str]]]:
    """``(switch, value here, value at warmup)`` for each kernel setting that differs from what ``musa-attn
    warmup`` recorded for ``platform``'s target (default: this process's), or None where nothing was
    recorded for it."""
    from .platform import get_platform

    platform = platform or get_platform()
    entry = _read_record(record_path()).get("targets", {}).get(_target_key(platform))
    if not isinstance(entry, dict) or not isinstance(entry.get("settings"), dict):
        return None
    recorded = entry["settings"]
    return [(env, value, str(recorded.get(env, "(not recorded)"))) for env, value in config.kernel_settings()
            if recorded.get(env) != value]


_checked: set = set()
_checked_lock = threading.Lock()


def check_warmup_settings(device=None) -> list[tuple[str, str, str]]:
    """Server start-up check (the SGLang and vLLM backends call it): warn, once per process and settings,
    where this process's kernel settings differ from those ``musa-attn warmup`` recorded in the cache
    directory for this target, naming each switch and both values. Returns the differences (empty: none, or
    nothing to compare: a CPU ``device``, no compile target here, or no warmup recorded for it; the last is
    logged at info level)."""
    from .platform import get_platform

    platform = get_platform()
    if (device is not None and getattr(device, "type", device) == "cpu") or not platform.target_kind:
        return []  # the reference ops: nothing is compiled
    key = (config.settings(), _target_key(platform))
    with _checked_lock:
        if key in _checked:
            return []
        _checked.add(key)
    diffs = settings_differences(platform)
    if diffs is None:
        logger.info("musa_attn_backend: no `musa-attn warmup` recorded in %s for target %s: kernels compile on "
                    "first use", record_path(), _target_key(platform))
        return []
    if diffs:
        logger.warning(
            "musa_attn_backend: kernel settings differ from those `musa-attn warmup` compiled with (%s, target "
            "%s): %s. The kernels these select are not in the warm cache and compile on first use, on the "
            "serving hot path; rerun warmup with the same settings, or start the server with the warmup's.",
            record_path(), _target_key(platform),
            "; ".join(f"{env}={here} here, {then} at warmup" for env, here, then in diffs))
    return diffs


def load_config(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())
