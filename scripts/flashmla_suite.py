"""FlashMLA's own sparse-attention tests as a conformance suite for this package's FlashMLA entry points.

    python scripts/flashmla_suite.py fetch --from <FlashMLA git dir or URL> [--commit REV]
    python scripts/flashmla_suite.py run decode|prefill [--sample N | --all] [--seed S] [--device cuda|cpu]
                                         [--out report.json] [--program scheduled|paired|portable|<workspace program>]

``fetch`` copies FlashMLA's ``tests/`` folder at ``REV`` (default: the last commit of its Hopper / V4 line this
package targets) into ``.flashmla/`` (git-ignored: none of FlashMLA's code is in this repository), with the commit
recorded. ``run`` puts ``integration_tests/flashmla_standin`` (a ``flash_mla`` package whose three functions are
ours) first on the path, takes the test module's own cases (decode: ``gen_testcase()``; prefill: the case lists its
``__main__`` block builds, read from its syntax tree and evaluated without running the rest of the block), leaves
out the V3.2 cases (``d_qk`` 576: a 656-byte cache format this package does not serve), runs each through the
module's own test function with its own tolerances (decode: output abs 1e-3 / rel 2/128 / cosine 5e-6, LSE abs 1e-6;
prefill: output 8e-4 / 3/128 / 7e-6, max-logits and LSE 1e-6), correctness only (``num_runs`` 0), and writes a
JSON report: how many cases ran, passed, failed (with each failing case's parameters) and raised.

``--device cpu`` runs the same cases on the CPU (our float32 references behind the entry points): FlashMLA's
test code asks for CUDA in a few places (``.cuda()``, ``torch.cuda.synchronize()``), which are made no-ops. Use
``--sample`` there: the large cases gather gigabytes.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / ".flashmla"
STANDIN = ROOT / "integration_tests" / "flashmla_standin"
# the last commit of FlashMLA's Hopper / DeepSeek-V4 (MODEL1) line
DEFAULT_COMMIT = "ba89a34"
MODULES = {"decode": "test_flash_mla_sparse_decoding", "prefill": "test_flash_mla_sparse_prefill"}


def fetch(source: str, commit: str) -> None:
    """``tests/`` of FlashMLA at ``commit`` from ``source`` (a git directory or a URL) into ``.flashmla/``."""
    SUITE.mkdir(exist_ok=True)
    src = Path(source)
    if not src.exists():  # a URL: a shallow clone beside the suite
        clone = SUITE / "repo"
        if not clone.exists():
            subprocess.run(["git", "clone", "--quiet", source, str(clone)], check=True)
        src = clone
    git = ["git", "--git-dir", str(src / ".git") if (src / ".git").exists() else str(src)]
    rev = subprocess.run(git + ["rev-parse", "--verify", f"{commit}^{{commit}}"], capture_output=True, text=True)
    if rev.returncode != 0:
        heads = subprocess.run(git + ["log", "--oneline", "-3"], capture_output=True, text=True).stdout
        raise SystemExit(f"fetch: {source} has no commit {commit!r}; its newest:\n{heads}")
    full = rev.stdout.strip()
    archive = subprocess.run(git + ["archive", full, "tests"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(SUITE)], input=archive, check=True)
    (SUITE / "COMMIT").write_text(full + "\n")
    print(f"fetch: FlashMLA tests at {full[:12]} in {SUITE / 'tests'}")


def _cpu_shims() -> None:
    """FlashMLA's test code on a CPU: its few CUDA calls become no-ops (our entry points run their references)."""
    import torch

    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None


def _main_block_cases(path: Path, namespace: dict) -> list:
    """The case lists a test script's ``__main__`` block builds: its assignments up to ``testcases = ...``,
    evaluated in the module's namespace (the block's device set-up and run loop are not executed)."""
    tree = ast.parse(path.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    body = []
    for stmt in main.body:
        if isinstance(stmt, ast.Assign):
            body.append(stmt)
            if any(isinstance(t, ast.Name) and t.id == "testcases" for t in stmt.targets):
                break
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["testcases"]


def _cases(kind: str, module) -> list:
    if kind == "decode":
        return [raw.to_test_param() for raw in module.gen_testcase()]
    return _main_block_cases(Path(module.__file__), vars(module))


def _work(case) -> int:
    """Index entries a case's queries attend to, in all."""
    if case.decode is None:
        return case.s_q * case.topk
    return case.decode.b * case.s_q * (case.topk + (case.decode.extra_topk or 0))


def run(kind: str, sample: int, seed: int, device: str, out: str, program: str | None, max_work: int = 0) -> int:
    if not (SUITE / "tests").exists():
        raise SystemExit("run: no FlashMLA tests in .flashmla/; run `scripts/flashmla_suite.py fetch` first")
    if program:
        os.environ["MUSA_ATTN_DSV4_PROGRAM"] = program
    sys.path[:0] = [str(STANDIN), str(SUITE / "tests"), str(ROOT)]
    import torch

    if device == "cpu":
        _cpu_shims()
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(device)
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.set_float32_matmul_precision("high")
    module = __import__(MODULES[kind])
    cases = [c for c in _cases(kind, module) if c.d_qk == 512]  # the V3.2 (656-byte) cases are not ours
    total = len(cases)
    if max_work:  # entries attended in all (CPU runs: the references gather that many 512-value rows twice)
        cases = [c for c in cases if _work(c) <= max_work]
    if sample and sample < len(cases):
        cases = [cases[i] for i in sorted(random.Random(seed).sample(range(len(cases)), sample))]
    for c in cases:
        c.num_runs = 0
    check = module.test_flash_mla if kind == "decode" else module.run_test
    stamp = ROOT / ".commit"  # the tree's commit as the caller wrote it (a lent machine's git metadata is stale)
    report = {"suite": kind, "flashmla_commit": (SUITE / "COMMIT").read_text().strip(), "device": device,
              "card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "commit": stamp.read_text().strip() if stamp.exists() else "unknown",
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "program": os.environ.get("MUSA_ATTN_DSV4_PROGRAM", "auto"), "model1_cases": total,
              "max_work": max_work or None, "seed": seed, "ran": len(cases),
              "passed": 0, "failed": [], "raised": []}
    t0 = time.time()
    for i, case in enumerate(cases):
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                result = check(case)
            ok = result.is_correct if kind == "decode" else bool(result)
        except Exception:  # a case that raises is a failure too, with its traceback
            report["raised"].append({"case": repr(case), "error": traceback.format_exc(limit=4)[-2000:]})
            print(f"[{i + 1}/{len(cases)}] RAISED {case}", flush=True)
            continue
        if ok:
            report["passed"] += 1
        else:
            report["failed"].append({"case": repr(case), "log": log.getvalue()[-2000:]})
            print(f"[{i + 1}/{len(cases)}] FAILED {case}\n{log.getvalue()[-800:]}", flush=True)
        if (i + 1) % 25 == 0:
            print(f"[{i + 1}/{len(cases)}] {report['passed']} passed, {time.time() - t0:.0f} s", flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    print(f"{kind}: {report['passed']}/{len(cases)} passed ({len(report['failed'])} failed, "
          f"{len(report['raised'])} raised) of {total} MODEL1 cases, {report['seconds']} s")
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["passed"] == len(cases) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--from", dest="source", required=True)
    f.add_argument("--commit", default=DEFAULT_COMMIT)
    r = sub.add_parser("run")
    r.add_argument("kind", choices=sorted(MODULES))
    g = r.add_mutually_exclusive_group()
    g.add_argument("--sample", type=int, default=24)
    g.add_argument("--all", action="store_true")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--out", default="")
    r.add_argument("--program", choices=("scheduled", "paired", "portable", "paired_ws", "portable_ws", "staged_ws"),
                   default=None, help="MUSA_ATTN_DSV4_PROGRAM for the run (prefill: a workspace program)")
    r.add_argument("--max-work", type=int, default=0,
                   help="skip cases attending to more index entries in all (for CPU runs)")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        fetch(args.source, args.commit)
        return 0
    return run(args.kind, 0 if args.all else args.sample, args.seed, args.device, args.out, args.program,
               args.max_work)


if __name__ == "__main__":
    sys.exit(main())
