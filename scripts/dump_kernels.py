"""Write the generated CUDA of a fixed list of attention kernels, one file per kernel, for diffing across commits.

    PYTHONPATH=. python scripts/dump_kernels.py OUT_DIR [--only SUBSTRING ...] [--runs N] [--tir] [--skip-existing]
    python scripts/dump_kernels.py --compare OLD_DIR NEW_DIR

Each kernel is lowered for ``{"kind": "cuda", "arch": "sm_90a"}`` with the pass configs the launcher
(``tilelang_impl.prefill_kernel``) gives it, and its device source (TileLang's codegen, before nvcc) is written
to ``OUT_DIR/<name>.cu``; nvcc is not run. The list covers the default kernels of head dim 128 with 32 query /
8 KV heads in bf16 and the variants the launcher or the tuner can build. Run it at two commits and compare
with ``diff -r``.

``--compare`` reports each kernel as identical, identical up to the names of TileLang's reduction workspaces,
or different: TileLang 0.1.12 hands the ``AllReduce`` workspaces of the 16-row decode tiling (four buffers of
one size) to its reductions in an order that changes from run to run of the same program, so those kernels are
compared with the workspace names folded into one. TileLang 0.1.12 also places some ``__syncthreads()``
differently from one lowering of a program to the next (seen on DeepSeek-V4's split portable program and the
masked FP4 MoE program with float32 scales), so a commit's sources of a program are a set: ``--runs N`` lowers
each program N times and keeps every source it gets, and ``--compare`` accepts a program whose new sources are
all among the old ones.

The builders are reached through a small import shim so that the script runs both at the commits that hold
one program per module and at those before, when all of them lived in ``tilelang_kernel``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("MUSA_ATTN_TARGET", "sm_90a")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tilelang  # noqa: E402
from tvm import target as tvm_target  # noqa: E402
from tvm import transform as tvm_transform  # noqa: E402

from musa_attn_backend._tilelang import tl  # noqa: E402  (configures TileLang's environment first)


def _builders():
    """``(build_prefill, build_prefill_pingpong, build_decode, build_combine)`` wherever this commit keeps them."""
    try:
        from musa_attn_backend.kernels.attention.combine_kernel import build_combine
        from musa_attn_backend.kernels.attention.decode_kernel import build_decode
        from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill
        from musa_attn_backend.kernels.attention.prefill_pingpong_kernel import build_prefill_pingpong
    except ImportError:
        from musa_attn_backend.kernels.attention.tilelang_kernel import (build_combine, build_decode, build_prefill,
                                                                         build_prefill_pingpong)
    return build_prefill, build_prefill_pingpong, build_decode, build_combine


PREFILL, PINGPONG, DECODE, COMBINE = _builders()
TARGET = {"kind": "cuda", "arch": "sm_90a"}
HQ, HKV, D = 32, 8, 128
SGLANG = (HKV * D, HKV * D, D)  # (width, row stride, head stride) of SGLang's K or V pool rows
VLLM = (HKV * 2 * D, HKV * 2 * D, 2 * D)  # vLLM's NHD K|V rows (V starts D elements in: same strides)
FUSED_QKV = (HKV * D, (HQ + 2 * HKV) * D, D)  # new K/V rows as views of a fused [q | k | v] projection
FAST = {tl.PassConfigKey.TL_ENABLE_FAST_MATH: True}
GATHERING = {**FAST, tl.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
             tl.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}


def _pingpong(causal=True, softcap=False, sinks=False, lay=SGLANG, block_N=128, stages=2, gather=False,
              tma_rows=0, ragged=False, d=D, hq=HQ, hkv=HKV):
    kw = {}
    if tma_rows:
        kw["tma_rows"] = tma_rows
    if ragged:
        kw["ragged"] = True
    return (lambda: PINGPONG.__wrapped__(hq, hkv, d, d, "bfloat16", causal, softcap, sinks, lay, lay, block_N,
                                         stages, gather=gather, **kw)), (GATHERING if gather else FAST)


def _prefill(causal=True, kv="bfloat16", window=False, softcap=False, sinks=False, lay=SGLANG, block_N=128,
             stages=2, tma=False, ragged=False, d=D):
    fp8 = kv.startswith("float8")
    return (lambda: PREFILL.__wrapped__(HQ, HKV, d, d, "bfloat16", kv, causal, window, softcap, sinks, fp8, lay,
                                        lay, 128, block_N, stages, 256, tma, ragged)), None


def _decode(max_q=1, hkv=HKV, block_M=16, threads=128, split=True, kv="bfloat16", window=False, softcap=False,
            sinks=False, stages=2, slot_tiles=8, full_runs=False, pdl=False, lay=SGLANG):
    fp8 = kv.startswith("float8")
    return (lambda: DECODE.__wrapped__(HQ, hkv, D, D, "bfloat16", kv, max_q, window, softcap, sinks, fp8, split,
                                       lay, lay, block_M, 64, stages, threads, slot_tiles, full_runs, pdl)), None


def _combine(sinks=False, pdl=True, max_splits=64):
    return (lambda: COMBINE.__wrapped__(HQ, D, "bfloat16", sinks, pdl=pdl, max_splits=max_splits)), None


KERNELS = {
    # ping-pong prefill (the defaults of Hopper for a bf16 cache without a window)
    "pingpong_tma_p128_s3_causal": _pingpong(stages=3),  # pages of 128
    "pingpong_tma_p128_s3_noncausal_softcap_sinks": _pingpong(causal=False, softcap=True, sinks=True, stages=3),
    "pingpong_chunk64_s3_causal_vllm": _pingpong(stages=3, tma_rows=64, lay=VLLM),  # pages of 64
    "pingpong_gather_s2_causal": _pingpong(gather=True),  # page 1 (any page size)
    "pingpong_gather_s2_noncausal_softcap_sinks_hd64": _pingpong(causal=False, softcap=True, sinks=True,
                                                                 gather=True, d=64, lay=(HKV * 64, HKV * 64, 64)),
    "pingpong_ragged_s3_causal_fused_qkv": _pingpong(stages=3, ragged=True, lay=FUSED_QKV),  # new K/V
    # the prefill of other platforms (and of caches the ping-pong kernel does not take)
    "prefill_rows_bf16_s2_causal": _prefill(),
    "prefill_rows_fp8_s1_causal": _prefill(kv="float8_e4m3", stages=1),
    "prefill_rows_fp8_s1_causal_window_softcap_sinks": _prefill(kv="float8_e4m3", stages=1, window=True,
                                                                softcap=True, sinks=True),
    "prefill_rows_bf16_s2_causal_window_softcap_sinks": _prefill(window=True, softcap=True, sinks=True),
    "prefill_rows_bf16_bn64_hd256_causal": _prefill(block_N=64, d=256, lay=(HKV * 256, HKV * 256, 256)),
    "prefill_tma_bn128_s2_causal": _prefill(tma=True),
    "prefill_tma_ragged_bn64_hd256_causal": _prefill(tma=True, ragged=True, block_N=64, d=256,
                                                     lay=(HKV * 256, (HQ + 2 * HKV) * 256, 256)),
    # split-KV decode: 16-row (1 token x 4 heads), 64-row (8 x 4) and 128-row (8 x 16) tiles
    "decode_m16_split_pdl": _decode(pdl=True),
    "decode_m16_nosplit": _decode(split=False),
    "decode_m16_split_pdl_fp8_s1": _decode(pdl=True, kv="float8_e4m3", stages=1),
    "decode_m16_split_window_softcap_sinks": _decode(window=True, softcap=True, sinks=True),
    "decode_m16_split_full_runs_s3": _decode(full_runs=True, stages=3),
    "decode_m16_split_slot_tiles0": _decode(slot_tiles=0),
    "decode_m64_split_pdl": _decode(max_q=8, block_M=64, pdl=True),
    "decode_m64_nosplit_vllm": _decode(max_q=8, block_M=64, split=False, lay=VLLM),
    "decode_m128_split_pdl": _decode(max_q=8, hkv=2, block_M=128, threads=256, pdl=True,
                                     lay=(2 * D, 2 * D, D)),
    "decode_m128_nosplit_fp8_s1": _decode(max_q=8, hkv=2, block_M=128, threads=256, split=False,
                                          kv="float8_e4m3", stages=1, lay=(2 * D, 2 * D, D)),
    # the split combine: chunked (default) and one split after the other
    "combine_chunked_pdl": _combine(),
    "combine_chunked_pdl_sinks": _combine(sinks=True),
    "combine_serial_sinks": _combine(sinks=True, pdl=False, max_splits=0),
}


def lower_source(func, pass_configs) -> str:
    """The device source TileLang generates for ``func`` (the code nvcc would compile), without compiling it."""
    target = tvm_target.Target(TARGET)
    config = {(k.value if hasattr(k, "value") else k): v for k, v in (pass_configs or {}).items()}
    with tvm_transform.PassContext(opt_level=3, config=config), target:
        return tilelang.lower(func, target=target).kernel_source


def variants(out: Path, stem: str) -> set:
    """The digests of the sources ``--runs`` found for program ``stem`` in ``out`` (its ``.cu`` alone where the
    runs agreed or ``--runs`` was 1)."""
    listed = out / f"{stem}.variants"
    if listed.exists():
        return {line.split()[0] for line in listed.read_text().splitlines()}
    return {digest((out / f"{stem}.cu").read_text())}


def digest(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()[:12]


def compare(old: Path, new: Path) -> int:
    """Print one line per kernel of ``old`` / ``new``; 1 if any differs (beyond workspace names and TileLang's
    run-to-run variation) or is missing."""
    bad = 0
    for name in sorted({p.name for p in old.glob("*.cu")} | {p.name for p in new.glob("*.cu")}):
        a, b = old / name, new / name
        if not (a.exists() and b.exists()):
            verdict = "missing in " + (str(old) if not a.exists() else str(new))
        elif a.read_text() == b.read_text():
            verdict = "identical"
        elif WORKSPACE.sub("workspace", a.read_text()) == WORKSPACE.sub("workspace", b.read_text()):
            verdict = "identical up to workspace names"
        elif variants(new, name[:-3]) <= variants(old, name[:-3]):
            verdict = (f"identical up to run-to-run variation (every source of the new runs is one of the old runs': "
                       f"{len(variants(new, name[:-3]))} of {len(variants(old, name[:-3]))})")
        else:
            verdict = "DIFFERS"
        bad += not verdict.startswith("identical")
        print(f"{name[:-3]}: {verdict}")
    return 1 if bad else 0


WORKSPACE = re.compile(r"\bworkspace(_\d+)?\b")


def cli(argv, doc: str, names, make) -> int:
    """The command line of this script and of ``dump_programs.py``: ``make(name)`` gives ``(prim_func,
    pass_configs)`` of each program of ``names``, lowered and written (or compared, ``--compare``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"), help="compare two output dirs")
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--only", nargs="*", default=[], help="only the programs whose name contains one of these")
    ap.add_argument("--skip-existing", action="store_true", help="leave programs already written in OUT alone")
    ap.add_argument("--runs", type=int, default=1,
                    help="lower each program this many times: TileLang 0.1.12 places some barriers differently "
                         "from run to run of the same program, so a program's sources are a set (the most frequent "
                         "is <name>.cu, each one <name>.<digest>.cu.variant, their counts <name>.variants)")
    ap.add_argument("--tir", action="store_true",
                    help="write each program's TIR before lowering (<name>.tir.py; seconds, not minutes): the same "
                         "TIR lowers to the same CUDA")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        ap.error("OUT_DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        done = args.out / f"{name}.{'tir.py' if args.tir else 'cu'}"
        if (args.only and not any(s in name for s in args.only)) or (args.skip_existing and done.exists()):
            continue
        t = time.time()
        if args.tir:
            done.write_text(make(name)[0].script())
            print(f"{name}: TIR, {time.time() - t:.1f} s", flush=True)
            continue
        try:
            sources = collections.Counter(lower_source(*make(name)) for _ in range(args.runs))
        except Exception as e:  # report and go on: a program that no longer lowers is a result too
            failed += 1
            (args.out / f"{name}.error").write_text(f"{type(e).__name__}: {e}\n")
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[-300:]}", flush=True)
            continue
        src = sources.most_common(1)[0][0]
        done.write_text(src)
        if len(sources) > 1:  # each source the runs gave, and how often
            for text in sources:
                (args.out / f"{name}.{digest(text)}.cu.variant").write_text(text)
            (args.out / f"{name}.variants").write_text("".join(f"{digest(text)} {n}\n" for text, n in
                                                               sources.most_common()))
        print(f"{name}: {len(src)} chars, {len(sources)} source(s) in {args.runs} run(s), "
              f"{time.time() - t:.1f} s", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    return cli(argv, __doc__, KERNELS, lambda name: (KERNELS[name][0](), KERNELS[name][1]))


if __name__ == "__main__":
    sys.exit(main())
