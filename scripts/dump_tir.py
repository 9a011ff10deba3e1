"""Write the TIR of every program of the reference plans (``musa_attn_backend.testing.mp31``: dense attention,
DeepSeek-V4, MoE) as TileLang builds it, one file a program, for comparing a refactor's programs before and after.

    python scripts/dump_tir.py OUT_DIR [--families moe,v4,dense] [--targets sm_90a,mp_31]
    python scripts/dump_tir.py --compare OLD_DIR NEW_DIR

Each file holds ``prim_func.script()`` of one program (its first line names the target and compile key); the
names are hashes of that line. Identical TIR lowers to identical code, so a refactor whose dumps compare equal
leaves every kernel as it was (the MoE programs composed from one body per layout: 140 of 140 equal, 2026-12-06).
Building TIR runs no compiler: the MoE families take seconds, dense attention minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def dump(out: Path, families, targets) -> int:
    from musa_attn_backend.testing import mp31

    build = {"dense": mp31.dense_programs, "v4": mp31.v4_programs, "moe": mp31.moe_programs}
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for target in targets:
        for fam in families:
            for key, (func, _) in build[fam](target).items():
                head = f"# {target} {key}"
                (out / f"{hashlib.sha1(head.encode()).hexdigest()[:16]}.tir").write_text(head + "\n" + func.script())
                n += 1
    return n


def compare(old: Path, new: Path) -> int:
    a, b = {p.name for p in old.glob("*.tir")}, {p.name for p in new.glob("*.tir")}
    differ = sorted(n for n in a & b if (old / n).read_text() != (new / n).read_text())
    for name, where in [(n, "only in " + str(old)) for n in sorted(a - b)] + [(n, "only in " + str(new))
                                                                             for n in sorted(b - a)]:
        print(f"{where}: {(old if name in a else new).joinpath(name).read_text().splitlines()[0]}")
    for name in differ:
        print(f"differs: {(old / name).read_text().splitlines()[0]}")
    print(f"{len(a & b) - len(differ)} of {len(a | b)} programs identical")
    return 0 if not differ and a == b else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--families", default="moe,v4,dense")
    ap.add_argument("--targets", default="sm_90a,mp_31")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        ap.error("OUT_DIR is required unless --compare")
    print(f"{dump(args.out, args.families.split(','), args.targets.split(','))} programs written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
