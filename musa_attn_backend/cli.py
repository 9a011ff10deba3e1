"""``musa-attn``: the command-line tool.

    musa-attn doctor [--json] [--require sglang,vllm]   what is installed, found and usable here
    musa-attn demo [--device cpu|cuda|musa] [--dtype bf16|fp16|fp32] [--impl auto|tilelang|reference]
    musa-attn warmup --model-config config.json [--tp N] [--engine sglang|vllm] [--target sm_90a]
                     [--experts fp8|fp4]   a DeepSeek-V4 config: every V4, indexer, compressor, model-side and
                                           MoE kernel that engine launches for it
    musa-attn warmup ... --target mp_31 --lower-only [--out DIR]   lowering only: does every kernel lower there
                                           (and keep MUSA's rules, checked on its TIR everywhere)
    musa-attn bench [--quick] [--ops prefill,decode] [--out DIR]   (GPU; from a source checkout)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from . import BACKEND_NAME, __version__

ENGINES = {
    "sglang": {"group": "sglang.srt.plugins", "module": "musa_attn_backend.sglang",
               "load": "from sglang.srt.plugins import load_plugins; load_plugins()",
               "registry": "from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS as R; "
                           "registered = NAME in R"},
    "vllm": {"group": "vllm.general_plugins", "module": "musa_attn_backend.vllm",
             "load": "from vllm.plugins import load_general_plugins; load_general_plugins()",
             "registry": "from vllm.v1.attention.backends.registry import AttentionBackendEnum as R; "
                         "registered = NAME.upper() in R.__members__"},
}

_PROBE = """
import json, importlib, importlib.metadata as md, logging
logging.disable(logging.CRITICAL)
NAME = {name!r}
out = {{"version": md.version({engine!r})}}
eps = [e for e in md.entry_points(group={group!r}) if e.name == NAME]
out["entry_point"] = eps[0].value if eps else None
try:
    {load}
    out["register_called"] = importlib.import_module({module!r}).registered
except Exception as e:
    out["error"] = f"{{type(e).__name__}}: {{e}}"
try:
    {registry}
    out["backend_registered"] = registered
except Exception as e:
    out["backend_registered"] = None
print("@@" + json.dumps(out))
"""


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def probe_engine(engine: str, timeout: float = 240.0) -> dict:
    """Run the engine's own plugin loader in a fresh interpreter and report what it did with our plugin."""
    if importlib.util.find_spec(engine) is None:
        return {"installed": False}
    spec = ENGINES[engine]
    code = _PROBE.format(name=BACKEND_NAME, engine=engine, **spec)
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cuda"),
               TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"installed": True, "error": f"probe timed out after {timeout:.0f}s"}
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("@@"):
            return {"installed": True, **json.loads(line[2:])}
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return {"installed": True, "error": "import failed: " + " | ".join(tail)}


def collect(require: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Everything ``doctor`` reports, and the list of problems that make it fail."""
    problems: list[str] = []
    info: dict = {"musa_attn_backend": __version__, "python": sys.version.split()[0]}
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["torch_musa"] = _version("torch_musa")
    info["torchada"] = _version("torchada")
    from . import config

    info["settings"] = config.describe()
    from . import platform as plat

    try:
        p = plat.get_platform()
        info["platform"] = {"device": p.kind, "name": p.device_name, "capability": p.capability, "arch": p.arch,
                            "target_kind": p.target_kind, "sm_count": p.sm_count,
                            **plat.features_of(), "source": p.source,
                            "notes": list(p.notes)}
        info["tilelang_target"] = p.tilelang_target() if p.target_kind else None
        if p.has_gpu and not p.target_kind:
            problems.append(f"a {p.kind} GPU is present but TileLang cannot target it: {'; '.join(p.notes)}")
    except ValueError as e:
        problems.append(str(e))
        p = None
    info["tilelang"] = _version("tilelang")
    if info["tilelang"] is None:
        problems.append("TileLang is not installed: pip install 'tilelang>=0.1.12' (tilelang-musa on MUSA)")
    else:
        try:
            from ._tilelang import tilelang_version

            info["tilelang"] = tilelang_version()
        except Exception as e:  # broken install
            problems.append(f"TileLang does not import: {type(e).__name__}: {e}")
    info["tile_kernels"] = _version("tile-kernels")
    if info["tile_kernels"]:
        try:
            importlib.import_module("tile_kernels")
        except Exception as e:
            info["tile_kernels"] += f" (does not import with this TileLang: {type(e).__name__}: {e})"
    info["nvcc"] = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
    info["mcc"] = shutil.which("mcc")
    from .cache import cache_dir, tilelang_cache_dir

    info["cache_dir"] = str(cache_dir())
    info["tilelang_cache_dir"] = str(tilelang_cache_dir())
    if p is not None:
        from . import _ffi_launch

        info["compiled_launch"] = _ffi_launch.status()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(ENGINES)) as pool:  # each probe is a fresh interpreter importing an engine
        engines = dict(zip(ENGINES, pool.map(probe_engine, ENGINES)))
    for engine, r in engines.items():
        if not r["installed"]:
            if engine in require:
                problems.append(f"{engine} is required (--require) but not installed")
            continue
        if r.get("error"):
            problems.append(f"{engine}: {r['error']}")
        elif not r.get("entry_point"):
            problems.append(f"{engine} is installed but does not see the '{BACKEND_NAME}' entry point in group "
                            f"{ENGINES[engine]['group']!r}: reinstall musa-attn-backend into the same environment")
        elif not r.get("register_called"):
            problems.append(f"{engine}'s plugin loader did not call our register() (is the plugin filtered by "
                            f"{'SGLANG_PLUGINS' if engine == 'sglang' else 'VLLM_PLUGINS'}?)")
    info["engines"] = engines
    if not any(r["installed"] for r in engines.values()):
        problems.append("neither SGLang nor vLLM is installed: nothing to plug into "
                        "(pip install 'musa-attn-backend[sglang]' or '[vllm]')")
    return info, problems


def _yes(v) -> str:
    return "yes" if v else ("no" if v is not None else "unknown")


def print_report(info: dict, problems: list[str]) -> None:
    from .platform import FEATURES

    p = info.get("platform") or {}
    rows = [
        ("musa_attn_backend", info["musa_attn_backend"]),
        ("python", info["python"]),
        ("torch", f"{info['torch']} (CUDA {info['torch_cuda'] or 'none'})"),
        ("torch_musa", info["torch_musa"] or "not installed"),
        ("torchada", info["torchada"] or "not installed"),
        ("device", p.get("device", "?")),
    ]
    if p.get("device") in ("cuda", "musa"):
        cap = p.get("capability")
        rows += [("gpu", p.get("name")), ("capability", f"{cap[0]}.{cap[1]}" if cap else "?"),
                 ("sm count", p.get("sm_count"))]
    target = info.get("tilelang_target")
    rows += [
        ("tilelang", info["tilelang"] or "not installed"),
        ("tilelang target", (json.dumps(target) if isinstance(target, dict) else target) if target
         else "none (no GPU; set MUSA_ATTN_TARGET=sm_90a to compile for Hopper)"),
        ("target features", ", ".join(n for n in FEATURES if p.get(n)) or "none"),
    ]
    if target:
        from .kernels._tir import RULES

        rows.append(("P V operand", "registers" if p.get("gemm_a_in_registers") else
                     "shared memory (this target's GEMMs read A from shared memory only, or MUSA_ATTN_SHARED_P=1)"))
        rules = [what for flag, (what, _) in RULES.items() if not p.get(flag)]
        rows.append(("lowering rules", "; ".join(rules) + " (checked on every program before it compiles)"
                     if rules else "none (the target has every capability)"))
    rows += [
        ("tile-kernels", info["tile_kernels"] or "not installed"),
        ("nvcc", info["nvcc"] or "not found"),
        ("mcc", info["mcc"] or "not found"),
        ("kernel cache", info["cache_dir"]),
        ("tilelang cache", info["tilelang_cache_dir"]),
        ("compiled launch", info.get("compiled_launch", "?")),
    ]
    for engine, r in info["engines"].items():
        if not r["installed"]:
            rows.append((engine, "not installed"))
            continue
        rows.append((engine, r.get("version", "?")))
        rows.append((f"  entry point {BACKEND_NAME}", r.get("entry_point") or "NOT FOUND"))
        rows.append(("  plugin loaded by engine", _yes(r.get("register_called"))))
        rows.append((f"  backend '{BACKEND_NAME}' registered", _yes(r.get("backend_registered"))))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    _print_settings(info["settings"])
    for note in p.get("notes") or []:
        print(f"note: {note}")
    if problems:
        print("\nPROBLEMS:")
        for prob in problems:
            print(f"  - {prob}")
    else:
        print("\nstatus: OK")
    print("\nwarm the kernel cache before serving: musa-attn warmup --model-config <config.json> --engine "
          "sglang|vllm --tp N (a DeepSeek-V4 config plans its V4 kernels; add --experts fp4 for an MXFP4 "
          "checkpoint)")


def _print_settings(rows: list[dict]) -> None:
    """The effective settings: one line per switch (value, default, where the value came from)."""
    print("\nsettings (* = changes which kernels are built; warmup and the server must agree on these):")
    table = [(r["env"] + (" *" if r["kernels"] else ""), r["value"], f"default {r['default']}",
              "overridden" if r["source"] != "default" else "", f"({r['source']})" if r["source"] != "default"
              else "") for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(3)]
    for name, value, default, over, source in table:
        print(f"  {name:<{widths[0]}}  {value:<{widths[1]}}  {default:<{widths[2]}}  {over} {source}".rstrip())


def cmd_doctor(args) -> int:
    require = tuple(x for x in (args.require or "").split(",") if x)
    unknown = [x for x in require if x not in ENGINES]
    if unknown:
        print(f"musa-attn doctor: --require takes {', '.join(ENGINES)}; got {', '.join(unknown)}", file=sys.stderr)
        return 2
    from .config import SettingsError, refresh

    # the environment as it is now; every other report depends on it, so a bad value is the one problem reported
    try:
        refresh()
    except SettingsError as e:
        if args.json:
            print(json.dumps({"settings": None, "problems": [str(e)]}, indent=2))
        else:
            print(f"musa-attn doctor: {e}")
        return 1
    info, problems = collect(require)
    if args.json:
        print(json.dumps({**info, "problems": problems}, indent=2, default=str))
    else:
        print_report(info, problems)
    return 1 if problems else 0


def cmd_demo(args) -> int:
    import torch

    from .demo import run_demo
    from .platform import get_platform

    device = args.device or get_platform().torch_device
    if device == "cuda" and not torch.cuda.is_available():
        print("musa-attn demo: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = dtypes[args.dtype] if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    return 0 if run_demo(device=device, dtype=dtype, seed=args.seed, impl=args.impl) else 1


def cmd_warmup(args) -> int:
    import time

    from . import config, warmup, warmup_dsv4

    if args.target:
        # also in the environment, for any process started from here that reads it
        os.environ[config.BY_FIELD["target"].env] = args.target
    config.refresh()
    from .platform import get_platform

    platform = get_platform()
    if not platform.target_kind:
        print("musa-attn warmup: no GPU to compile for here; pass --target sm_90a (or mp_31)", file=sys.stderr)
        return 2
    try:
        model = _model_from_args(args, "warmup")
        if model is None:
            return 2
        if isinstance(model, warmup_dsv4.V4Model):
            jobs = warmup_dsv4.plan(model, engine=args.engine, kv_dtype=args.kv_cache_dtype,
                                    speculative_tokens=args.speculative_tokens, experts=args.experts)
        else:
            jobs = warmup.plan(model, engine=args.engine, kv_dtype=args.kv_cache_dtype,
                               speculative_tokens=args.speculative_tokens, page_size=args.page_size)
    except ValueError as e:  # e.g. no tiling of this model fits the target, a V4 setting the kernels refuse
        print(f"musa-attn warmup: {e}", file=sys.stderr)
        return 2
    if args.lower_only:
        return _lower_only(jobs, model, args, platform)
    if args.out:
        print("musa-attn warmup: --out goes with --lower-only (compiled kernels go into the kernel cache)",
              file=sys.stderr)
        return 2
    from .cache import cache_dir

    markers = cache_dir(create=True) / "kernels"
    before = len(list(markers.glob("*.done"))) if markers.exists() else 0
    print(f"warmup: {model} engine={args.engine} target={platform.tilelang_target()} -> {len(jobs)} kernels "
          f"into {cache_dir()}")
    t0 = time.perf_counter()
    warmup.run(jobs, workers=args.jobs, progress=not args.quiet)
    if isinstance(model, warmup_dsv4.V4Model) and not _build_compiled_launch(platform):
        return 1
    after = len(list(markers.glob("*.done")))
    record = warmup.record_settings(platform)
    print(f"warmup: done in {time.perf_counter() - t0:.1f}s; {after - before} compiled now, "
          f"{len(jobs) - (after - before)} already in the cache; kernel settings "
          f"{' '.join(f'{k}={v}' for k, v in config.kernel_settings())} recorded in {record}")
    return 0


def _build_compiled_launch(platform) -> bool:
    """The compiled launch's extension (``_ffi_launch``: DeepSeek-V4's sparse decode launches) built into the cache
    where ``MUSA_ATTN_COMPILED_LAUNCH`` and the target ask for it, so the server loads it rather than building it
    at its first decode. False (an error printed) where it fails under ``on``; under ``auto`` a failure is printed
    as a warning and the server will launch through TileLang."""
    import time

    from . import _ffi_launch
    from .config import settings

    if not _ffi_launch.wanted(platform.target_kind):
        return True
    t0 = time.perf_counter()
    try:
        _ffi_launch.load()
    except Exception as e:  # noqa: BLE001 - reported with the compiler's reason
        strict = settings().compiled_launch == "on"
        then = ("MUSA_ATTN_COMPILED_LAUNCH=on: a server would refuse to run without it" if strict else
                "the server will launch through TileLang (MUSA_ATTN_COMPILED_LAUNCH=off: not tried)")
        print(f"musa-attn warmup: {'error' if strict else 'warning'}: the compiled launch's extension did not "
              f"build ({e}); {then}", file=sys.stderr)
        return not strict
    print(f"warmup: compiled launch extension ready in {time.perf_counter() - t0:.1f}s")
    return True


def _lower_only(jobs, model, args, platform) -> int:
    """``warmup --lower-only``: lower every kernel of the plan, write the sources, name each that fails."""
    import time

    from . import warmup

    out = Path(args.out) if args.out else None
    print(f"warmup --lower-only: {model} engine={args.engine} target={platform.tilelang_target()} -> {len(jobs)} "
          f"kernels{f', sources into {out}' if out else ''}")
    t0 = time.perf_counter()
    results = warmup.lower_all(jobs, out, workers=args.jobs, progress=not args.quiet)
    failed = [r for r in results if r.error is not None]
    for r in failed:
        print(f"warmup --lower-only: {r.name} does not lower: {r.job.describe()}\n    {r.error}", file=sys.stderr)
    checked = sum(r.checked_only for r in results)
    done = (f"{len(results) - len(failed)} of {len(results)} kernels "
            + ("passed the target's rules (checked on their TIR; not lowered: this TileLang has no backend for "
               "the target)" if checked else "lowered") + f" for {platform.tilelang_target()}")
    print(f"warmup --lower-only: {done} in {time.perf_counter() - t0:.1f}s"
          + (f", {len(failed)} did not" if failed else ""))
    return 1 if failed else 0


def _model_from_args(args, cmd: str, v4: bool = True):
    """The model's attention shapes from --model-config or the explicit head flags (None after an error): a
    :class:`.warmup_dsv4.V4Model` for a DeepSeek-V4 config (where ``v4``), else a :class:`.warmup.ModelAttention`."""
    from . import warmup, warmup_dsv4

    if args.model_config:
        config = warmup.load_config(args.model_config)
        if warmup_dsv4.is_v4(config):
            if not v4:
                raise ValueError(f"{cmd} takes dense models; DeepSeek-V4's kernels have no tuning table")
            return warmup_dsv4.from_hf_config(config, tp=args.tp)
        return warmup.from_hf_config(config, tp=args.tp, dtype=args.dtype)
    missing = [n for n in ("heads", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
        print(f"musa-attn {cmd}: give --model-config, or --heads, --kv-heads and --head-dim "
              f"(missing: {', '.join('--' + m.replace('_', '-') for m in missing)})", file=sys.stderr)
        return None
    return warmup.ModelAttention(args.heads, args.kv_heads, args.head_dim, args.head_dim_v or args.head_dim,
                                 warmup.DTYPES[args.dtype or "bf16"], has_window=args.sliding_window,
                                 has_softcap=args.softcap, has_sinks=args.sinks)


def cmd_tune(args) -> int:
    from . import warmup
    from .platform import get_platform

    if not get_platform().has_gpu:
        print("musa-attn tune: needs a GPU (candidates are checked and timed on it); `musa-attn warmup "
              "--target ...` builds without one", file=sys.stderr)
        return 2
    try:
        model = _model_from_args(args, "tune", v4=False)
    except ValueError as e:
        print(f"musa-attn tune: {e}", file=sys.stderr)
        return 2
    if model is None:
        return 2
    import torch

    from .tune_attention import tune_prefill

    page_size = args.page_size or warmup.DEFAULT_PAGE_SIZE[args.engine]
    windows = [True] if model.only_window else ([False, True] if model.has_window else [False])
    ok = True
    for window in windows:
        res = tune_prefill(model.num_q_heads, model.num_kv_heads, model.head_dim, model.head_dim_v,
                           dtype=getattr(torch, model.dtype), fp8_kv=args.kv_cache_dtype != "auto",
                           page_size=page_size, sliding_window=4096 if window else None,
                           softcap=30.0 if model.has_softcap else None, sinks=model.has_sinks, seqlen=args.seqlen,
                           record=not args.dry_run)
        if res["best"] is None:
            print(f"tune: no correct candidate for {res['key']}", file=sys.stderr)
            ok = False
        else:
            print(f"tune: {res['key']} -> {res['best']} ({res['ms']:.3f} ms)"
                  + (f", recorded in {res['table']}" if res["table"] else " (dry run: not recorded)"))
    return 0 if ok else 1


def cmd_bench(args) -> int:
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_attention.py"
    if not script.exists():
        print("musa-attn bench: benchmarks/ is not next to this install; run it from a source checkout "
              "(pip install -e .)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.bench_args])


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", help="a Hugging Face config.json (or the folder holding it)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads per rank)")
    p.add_argument("--heads", type=int, help="query heads per rank (without --model-config)")
    p.add_argument("--kv-heads", type=int, help="KV heads per rank")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--head-dim-v", type=int)
    p.add_argument("--sliding-window", action="store_true", help="the model has sliding-window layers")
    p.add_argument("--softcap", action="store_true", help="the model uses a logit softcap")
    p.add_argument("--sinks", action="store_true", help="the model has attention sinks")
    p.add_argument("--dtype", choices=("bf16", "fp16"), help="activation dtype (default: the config's, or bf16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"))
    p.add_argument("--engine", default="sglang", choices=("sglang", "vllm"), help="KV-cache layout / page default")
    p.add_argument("--page-size", type=int, default=None,
                   help="the engine's KV page size (default: SGLang 1, vLLM 16); pages of 64+ tokens use the "
                        "bulk-copy prefill kernel")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="musa-attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"musa-attn-backend {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="report the platform, TileLang, engines and plugin discovery")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--require", help="comma-separated engines that must be installed (sglang,vllm)")
    d.set_defaults(func=cmd_doctor)
    m = sub.add_parser("demo", help="run the ops on a paged batch and check them against SDPA")
    m.add_argument("--device", choices=("cpu", "cuda", "musa"))
    m.add_argument("--dtype", choices=("bf16", "fp16", "fp32"))
    m.add_argument("--impl", choices=("auto", "tilelang", "reference"), default="auto")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_demo)
    w = sub.add_parser("warmup", help="compile every kernel a model needs into the kernel cache, ahead of serving")
    _add_model_args(w)
    w.add_argument("--speculative-tokens", type=int, default=0, help="draft tokens verified per step")
    w.add_argument("--experts", default="fp8", choices=("fp8", "fp4"),
                   help="DeepSeek-V4: the checkpoint's routed-expert format (FP8 block scales or MXFP4); its MoE "
                        "kernels are planned where MUSA_ATTN_MOE routes the experts to this package")
    w.add_argument("--target", help="compile for this target instead of the local GPU (sm_90a, mp_31, ...)")
    w.add_argument("--lower-only", action="store_true",
                   help="run only TileLang's lowering (no device compiler, nothing cached): exit 1 naming each kernel "
                        "that does not lower for the target, and why")
    w.add_argument("--out", help="with --lower-only: write each kernel's generated device source into this folder")
    w.add_argument("-j", "--jobs", type=int, default=0, help="parallel compiler processes (default: cores, <= 8)")
    w.add_argument("--quiet", action="store_true")
    w.set_defaults(func=cmd_warmup)
    t = sub.add_parser("tune", help="pick the prefill tiling for a model on this GPU and record it in the "
                                    "tuning table of the kernel cache (run before warmup)")
    _add_model_args(t)
    t.add_argument("--seqlen", type=int, default=8192, help="prefill length the candidates are timed on")
    t.add_argument("--dry-run", action="store_true", help="measure and print, do not record")
    t.set_defaults(func=cmd_tune)
    b = sub.add_parser("bench", help="benchmark against SDPA/FlexAttention on a GPU (benchmarks/bench_attention.py)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed on (--quick, --ops, --out, ...)")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
