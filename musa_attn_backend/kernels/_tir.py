"""What a TileLang program's TIR says before target lowering, for the portability checks: which buffers its
tile GEMMs read, from which memory, in which majorness, which part of each tile, its parallel loops over their
accumulators; and the rules a target's lowering imposes on them (:func:`violations`).

A ``T.gemm`` is a call of TileLang's GEMM tile operator whose first three arguments are the regions of A, B
and C (each a region call wrapping a load of the region's first element, an access pointer, or the buffer
region itself, depending on the TileLang version), then ``transpose_A``, ``transpose_B``, ``M``, ``N``, ``K`` and the
warp policy. The scope of a buffer says where it lives: ``shared`` / ``shared.dyn`` (shared memory),
``local.fragment`` (registers, laid out across the threads).

The rules are those tilelang-musa's lowering for MUSA MP31 imposes (``docs/musa.md``: what fails there, why, and
the form that works); each is keyed by the capability flag of :mod:`musa_attn_backend.platform` whose absence
brings it in, so a target with every flag (CUDA) is checked against none of them. They follow the stricter of
the fork's two lines (0.1.12 and v0.1.8+musa1) where they differ.
"""

from __future__ import annotations

import importlib
from math import gcd
from typing import Any, Callable, NamedTuple, Optional

from .. import program_checks
from . import _sqmma

REGISTER_SCOPES = ("local.fragment", "local", "local.var")
# MUSA's SQMMA layouts chunk a shared operand's rows by this many bytes: a row of at most this, or a multiple
CHUNK_BYTES = 256
# MUSA's code generation prints float32 vectors of at most this many lanes
MAX_FLOAT_LANES = 8


class GemmOperands(NamedTuple):
    """The A, B and C buffers of one tile GEMM and their scopes."""

    a: str
    b: str
    c: str
    a_scope: str
    b_scope: str
    c_scope: str


class Operand(NamedTuple):
    """One GEMM operand: its buffer (name, scope, dtype, shape) and the region read (offsets and extents per
    dimension; an entry is an int where it is a constant, else a TIR expression)."""

    name: str
    scope: str
    dtype: str
    shape: tuple
    offsets: tuple
    extents: tuple

    @property
    def bits(self) -> int:
        return 8 if "float8" in self.dtype or "int8" in self.dtype else 32 if "32" in self.dtype else 16

    @property
    def shared(self) -> bool:
        return self.scope.startswith("shared")


class Gemm(NamedTuple):
    """One tile GEMM: ``C (+)= op(A) op(B)``, ``M x N x K``, with the transposes and the warp policy it was
    written with."""

    a: Operand
    b: Operand
    c: Operand
    transpose_a: bool
    transpose_b: bool
    M: Any
    N: Any
    K: Any
    policy: str

    def majorness(self, role: str) -> str:
        """How the GEMM reads operand ``role`` (``a`` or ``b``): ``K`` (the reduction dimension contiguous: A
        untransposed, B transposed) or ``MN`` (the other)."""
        if role == "a":
            return "MN" if self.transpose_a else "K"
        return "K" if self.transpose_b else "MN"

    def sqmma(self, threads: Optional[int]) -> Optional[_sqmma.SqmmaShape]:
        """MUSA's SQMMA partition and instruction for this GEMM in a block of ``threads`` (None: not SQMMA)."""
        if not (self.a.shared and self.b.shared) or not all(isinstance(x, int) for x in (self.M, self.N, self.K)):
            return None
        kind = "fp8" if self.a.bits == 8 else "tf32" if self.a.bits == 32 else "16bit"
        return _sqmma.sqmma_shape(self.M, self.N, self.K, threads or 0, self.policy, kind)


class Violation(NamedTuple):
    """A rule a program breaks: the capability flag whose absence brings the rule in, and what breaks it."""

    flag: str
    detail: str


def _tir_of(func) -> Any:
    """The TIR namespace the prim_func belongs to (``tvm.tirx`` on TileLang 0.1.12+, ``tvm.tir`` before)."""
    return importlib.import_module(type(func).__module__.rsplit(".", 1)[0])


def _const(tir, x):
    """``x`` as an int where it is a constant expression (after simplification), else ``x``."""
    if isinstance(x, int):
        return x
    if not isinstance(x, tir.IntImm) and isinstance(x, tir.PrimExpr):
        from tilelang import tvm

        x = tvm.arith.Analyzer().simplify(x)
    return int(x.value) if isinstance(x, tir.IntImm) else x


def _operand(tir, arg) -> Optional[Operand]:
    """The operand a GEMM argument names (None where it names no buffer)."""
    def of(buf, offsets, extents):
        shape = tuple(_const(tir, s) for s in buf.shape)
        extents = tuple(_const(tir, e) for e in extents)
        if len(extents) < len(shape):  # a region names the trailing dimensions; the leading ones are one element
            extents = (1,) * (len(shape) - len(extents)) + extents
        return Operand(buf.name, buf.scope(), str(buf.dtype), shape, tuple(_const(tir, o) for o in offsets),
                       extents or shape)

    if isinstance(arg, tir.BufferLoad):
        return of(arg.buffer, arg.indices, ())
    if hasattr(tir, "BufferRegion") and isinstance(arg, tir.BufferRegion):
        return of(arg.buffer, [r.min for r in arg.region], [r.extent for r in arg.region])
    if isinstance(arg, tir.Call):
        name = str(getattr(arg.op, "name", arg.op))
        if name.endswith("tvm_access_ptr") and len(arg.args) > 1 and isinstance(arg.args[1], tir.Var):
            var = arg.args[1]
            scope = str(getattr(var.type_annotation, "storage_scope", ""))
            return Operand(var.name, scope, str(arg.args[0].dtype), (), (_const(tir, arg.args[2]),),
                           (_const(tir, arg.args[3]),))
        if name.endswith("region") and arg.args and isinstance(arg.args[0], tir.BufferLoad):
            return of(arg.args[0].buffer, arg.args[0].indices, arg.args[2:])
        for inner in arg.args:  # some other wrapper: the buffer is inside
            found = _operand(tir, inner)
            if found is not None:
                return found
    return None


def gemms(func) -> list[Gemm]:
    """Every tile GEMM (``T.gemm``) of the prim_func ``func``, in program order."""
    tir = _tir_of(func)
    found: list[Gemm] = []

    def visit(node):
        if isinstance(node, tir.Call) and "gemm" in str(getattr(node.op, "name", "")).rsplit(".", 1)[-1]:
            ops = [_operand(tir, a) for a in node.args[:3]]
            if any(o is None for o in ops):
                raise ValueError(f"cannot read the operands of the GEMM {node.op} (TileLang version change?)")
            rest = [_const(tir, x) for x in node.args[3:9]] + [None] * 6
            ta, tb = (bool(x) if isinstance(x, int) else False for x in rest[:2])
            policy = _sqmma.POLICIES.get(rest[5], "Square") if isinstance(rest[5], int) else "Square"
            found.append(Gemm(*ops, ta, tb, rest[2], rest[3], rest[4], policy))

    tir.stmt_functor.post_order_visit(func.body, visit)
    return found


def gemm_operands(func) -> list[GemmOperands]:
    """The operand buffers of every tile GEMM in ``func``, in program order."""
    return [GemmOperands(g.a.name, g.b.name, g.c.name, g.a.scope, g.b.scope, g.c.scope) for g in gemms(func)]


def register_a_gemms(func) -> list[GemmOperands]:
    """The tile GEMMs of ``func`` that read their A operand from registers."""
    return [g for g in gemm_operands(func) if g.a_scope in REGISTER_SCOPES]


def block_threads(func) -> Optional[int]:
    """The threads of the program's blocks (its ``threadIdx.x`` extent), where constant: a thread-bound loop
    (TileLang 0.1.12), the root block's ``tl.launch_threads`` annotation (0.1.15) or a ``thread_extent``
    attribute."""
    tir = _tir_of(func)
    found = []

    def visit(node):
        if isinstance(node, tir.For) and node.thread_binding is not None and \
                node.thread_binding.thread_tag == "threadIdx.x":
            found.append(_const(tir, node.extent))
        elif isinstance(node, tir.AttrStmt) and node.attr_key == "thread_extent" and \
                getattr(node.node, "thread_tag", None) == "threadIdx.x":
            found.append(_const(tir, node.value))
        else:
            launch = (getattr(node, "annotations", None) or {}).get("tl.launch_threads")
            if launch is not None:
                found.append(_const(tir, launch[0]))

    tir.stmt_functor.post_order_visit(func.body, visit)
    return found[0] if found and isinstance(found[0], int) else None


# --- the rules -------------------------------------------------------------------------------------------------

def _shared_operands(func) -> list[str]:
    """GEMM operands outside shared memory (MUSA's SQMMA reads both from shared memory; no other path takes a
    register A with a shared B)."""
    bad = []
    for g in gemms(func):
        for role in ("a", "b"):
            op = getattr(g, role)
            if op.scope in REGISTER_SCOPES:
                bad.append(f"{g.a.name} ({g.a.scope}) x {g.b.name} ({g.b.scope}): the {role.upper()} operand is in "
                           "registers; this target's GEMMs take A and B from shared memory only (stage it "
                           "through a shared tile)")
    return bad


def _layout_key(g: Gemm, role: str) -> str:
    """The shared layout a GEMM gives its operand ``role``: the same for A untransposed and B transposed
    (K-major), one of its own for an MN-major A and for an MN-major B."""
    return "K-major" if g.majorness(role) == "K" else f"{role.upper()} MN-major"


def _two_majors(func) -> list[str]:
    """A shared tile that two GEMMs lay out differently (e.g. K of ``Q K^T``, K-major, and V of ``P V``,
    MN-major)."""
    uses: dict[str, set] = {}
    for g in gemms(func):
        for role in ("a", "b"):
            op = getattr(g, role)
            if op.shared:
                uses.setdefault(op.name, set()).add(_layout_key(g, role))
    return [f"{name} is read {' and '.join(sorted(u))}: the target lays a shared GEMM operand out by how it is "
            "read and cannot give one tile two layouts (give each role a tile of its own)"
            for name, u in uses.items() if len(u) > 1]


def _extents(func) -> list[str]:
    """Shared operands whose rows MUSA's swizzled layouts cannot chunk, and GEMM shapes its warp partition stops
    on."""
    threads = block_threads(func)
    bad = []
    for g in gemms(func):
        shape = g.sqmma(threads)
        if g.a.shared and g.b.shared and threads and threads % 128 == 0 and isinstance(g.M, int) \
                and isinstance(g.N, int) and (g.M % 4 or g.N % 8):
            bad.append(f"GEMM {g.a.name} x {g.b.name}: M {g.M} and N {g.N} must be multiples of 4 and 8")
        for role in ("a", "b"):
            op = getattr(g, role)
            if not op.shared or len(op.shape) < 2 or not all(isinstance(x, int) for x in op.shape[-2:]):
                continue
            eb = op.bits // 8
            cont, rows = op.shape[-1], op.shape[-2]
            continuity = cont
            if role == "b" and not g.transpose_b and shape is not None and shape.inst_n < cont:
                continuity = shape.inst_n  # an MN-major B is laid out an instruction's columns at a time
            chunk = continuity if continuity < cont else CHUNK_BYTES // eb
            if cont <= chunk:
                continue
            k_major = g.majorness(role) == "K"
            group = 16 if op.bits == 8 or k_major else 32 if op.bits == 16 else 64
            cycle = (256 // group) * 256
            swizzle = rows * chunk * eb
            if cont % chunk or (swizzle < cycle and 2 * swizzle != cycle):
                bad.append(f"{op.name} ({role.upper()}, {op.dtype}): rows of {cont} elements ({cont * eb} bytes) in "
                           f"a tile of {rows}; the target chunks a row by {chunk} elements and takes at most "
                           f"{chunk} or a multiple of it, with chunks of at least {cycle // 2} bytes down the tile "
                           "(cut the dimension into GEMMs of such widths)")
    return sorted(set(bad))


def _slices(func) -> list[str]:
    """A and B operands that are not a whole tile: a region of the last two dimensions other than all of them
    (MUSA's SQMMA takes an operand at offset 0 with the tile's own stride; a leading dimension may be indexed)."""
    bad = []
    for g in gemms(func):
        for role in ("a", "b"):
            op = getattr(g, role)
            if not op.shared or len(op.shape) < 2:
                continue
            offsets, extents, shape = op.offsets[-2:], op.extents[-2:], op.shape[-2:]
            if any(o != 0 for o in offsets) or tuple(extents) != tuple(shape):
                where = ", ".join(f"{o}:+{e}" for o, e in zip(offsets, extents))
                bad.append(f"{op.name} ({role.upper()}) is read at [{where}] of its {'x'.join(map(str, shape))} tile: "
                           "the target's GEMMs take whole tiles at offset 0 (give the part a tile of its own)")
    return sorted(set(bad))


def _uses(tir, exprs, var) -> bool:
    """Whether any of the expressions ``exprs`` refers to the variable ``var``."""
    found = []
    for e in exprs:
        tir.stmt_functor.post_order_visit(tir.Evaluate(e), lambda n: found.append(
            isinstance(n, tir.Var) and n.same_as(var)))
    return any(found)


def _parallel_nests(tir, func):
    """``(i, j, body)`` of each two-deep parallel loop nest of ``func``."""
    nests = []

    def visit(node):
        if isinstance(node, tir.For) and node.kind == tir.ForKind.PARALLEL and isinstance(node.body, tir.For) \
                and node.body.kind == tir.ForKind.PARALLEL:
            nests.append((node.loop_var, node.body.loop_var, node.body.body))

    tir.stmt_functor.post_order_visit(func.body, visit)
    return nests


def _float_vectors(func) -> list[str]:
    """Parallel loops over a float32 GEMM accumulator that MUSA's vectoriser (v0.1.8's) would make wider than its
    code generator prints: a loop that reads shared or global memory by row alone (or at a constant) is
    vectorised as wide as the accumulator's row runs (:func:`._sqmma.loop_lanes`)."""
    tir = _tir_of(func)
    threads = block_threads(func)
    by_c = {}
    for g in gemms(func):
        if isinstance(g.M, int) and isinstance(g.N, int):
            by_c.setdefault((g.c.name, g.M, g.N), g)
            by_c.setdefault(((), g.M, g.N), g)
    bad = []
    for i, j, body in _parallel_nests(tir, func):
        stores, accesses, casts = [], [], []

        def visit(node):
            if isinstance(node, (tir.BufferStore, tir.BufferLoad)):
                scope = node.buffer.scope()
                if isinstance(node, tir.BufferStore):
                    stores.append(node)
                if scope.startswith("shared") or scope == "global":
                    idx = list(node.indices)
                    accesses.append("col" if _uses(tir, idx, j) else "row" if _uses(tir, idx, i) else "none")
            elif isinstance(node, tir.Cast):
                casts.append(int(node.dtype.bits))

        tir.stmt_functor.post_order_visit(body, visit)
        if not stores or not accesses:
            continue
        target = stores[0].buffer
        if target.scope() != "local.fragment" or "float32" not in str(target.dtype) or len(target.shape) != 2:
            continue
        M, N = (_const(tir, x) for x in target.shape)
        g = by_c.get((target.name, M, N)) or by_c.get(((), M, N))
        shape = g.sqmma(threads) if g is not None else None
        if shape is None:
            continue
        statements = len(body.seq) if isinstance(body, tir.SeqStmt) else 1
        lanes = _sqmma.loop_lanes(M, N, threads, shape, accesses, statements, tuple(casts))
        if lanes > MAX_FLOAT_LANES:
            bad.append(f"the loop over {target.name} [{M}, {N}] (GEMM {g.a.name} x {g.b.name}, {threads} threads, "
                       f"{g.policy}) would be vectorised {lanes} float32 lanes wide; the target prints at most "
                       f"{MAX_FLOAT_LANES} (more threads or a narrower tile shorten the accumulator's row runs)")
    return bad


# the 32-bit registers an SM gives its one block of a warp-specialised program, and setmaxnreg's bounds
REGISTER_FILE, NREG_MIN, NREG_MAX = 65536, 24, 256
WARP_GROUP = 128


def _set_max_nregs(func) -> list[tuple[int, int]]:
    """``(registers, is_inc)`` of each ``T.set_max_nreg`` the program calls (one a warp group: each sits in its
    own ``T.ws`` branch); ``(-1, -1)`` where not constant. Nothing for what is not a TIR function (a test's stand-in
    build)."""
    tir = _tir_of(func)
    if not hasattr(tir, "stmt_functor") or not hasattr(func, "body"):
        return []
    found = []

    def visit(node):
        if isinstance(node, tir.Call) and getattr(node.op, "name", "") == "tl.set_max_nreg":
            n, inc = (_const(tir, a) for a in node.args[:2])
            found.append((n, inc) if isinstance(n, int) and isinstance(inc, int) else (-1, -1))

    tir.stmt_functor.post_order_visit(func.body, visit)
    return found


def _register_budget(func) -> list[str]:
    """setmaxnreg only moves registers between a block's warp groups: at launch every thread holds the launch
    bound's share (ptxas gives a warp-specialised kernel 65,536 / threads rounded down to 8, e.g. 168 at 384
    threads), a decrease returns registers to the block's pool and an increase *waits* until the pool holds
    them. Warp groups asking for more than the block was given therefore wait forever: the kernel hangs with
    no error (the paired V4 program's first GPU run: 2 x 208 + 96 > 3 x 168). Each count is a multiple of 8 in
    [24, 256]."""
    calls = _set_max_nregs(func)
    if not calls:
        return []
    threads = block_threads(func)
    if threads is None or threads % WARP_GROUP:
        return [f"setmaxnreg in a block of {threads} threads (warp-specialised blocks are whole warp groups)"]
    groups = threads // WARP_GROUP
    share = min(REGISTER_FILE // threads // 8 * 8, NREG_MAX)
    bad = [f"setmaxnreg({n}): a count is a multiple of 8 in [{NREG_MIN}, {NREG_MAX}]" for n, _ in calls
           if n % 8 or not NREG_MIN <= n <= NREG_MAX]
    if len(calls) > groups:
        bad.append(f"{len(calls)} setmaxnreg calls for {groups} warp groups")
    asked = sum(n for n, _ in calls) + share * max(groups - len(calls), 0)
    if not bad and asked > share * groups:
        bad.append(f"warp groups asking {' + '.join(str(n) for n, _ in calls)} registers a thread exceed the block's "
                   f"{groups} x {share} (its launch share at {threads} threads): the increases would wait forever")
    return bad


# checked on every target: a program breaking one fails (hangs) wherever it runs
INVARIANTS: dict[str, tuple[str, Callable[[Any], list[str]]]] = {
    "register_budget": ("warp groups' setmaxnreg counts within the block's registers", _register_budget),
}

# flag -> (what the rule says, the check): a target without the flag must pass the check
RULES: dict[str, tuple[str, Callable[[Any], list[str]]]] = {
    "gemm_a_in_registers": ("GEMM operands from shared memory", _shared_operands),
    "gemm_tile_two_majors": ("one layout a shared GEMM tile", _two_majors),
    "gemm_any_extent": (f"GEMM tile rows of at most {CHUNK_BYTES} bytes or multiples of it", _extents),
    "gemm_tile_slices": ("whole tiles as GEMM operands", _slices),
    "wide_float_vectors": (f"float vectors of at most {MAX_FLOAT_LANES} lanes", _float_vectors),
}


def violations(func, flags: dict) -> list[Violation]:
    """The rules ``func`` breaks on a target with the capability ``flags`` (:func:`..platform.features_of`): for
    every flag of :data:`RULES` the target lacks, what its check finds; then what the :data:`INVARIANTS` find on
    any target (their violations' ``flag`` is empty: no capability lifts them)."""
    return [Violation(flag, d) for flag, (_, rule) in RULES.items() if not flags.get(flag, True) for d in rule(func)] \
        + [Violation("", d) for _, rule in INVARIANTS.values() for d in rule(func)]


program_checks.register(violations)
