"""What a TileLang program's TIR says before target lowering, for the portability checks: which buffers its
tile GEMMs read, and from which memory.

A ``T.gemm`` is a call of TileLang's GEMM tile operator whose first three arguments are the regions of A, B
and C (each a region call wrapping a load of the buffer's first element, an access pointer, or the buffer
region itself, depending on the TileLang version). The scope of a buffer says where it lives: ``shared`` /
``shared.dyn`` (shared memory), ``local.fragment`` (registers, laid out across the threads).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Optional

REGISTER_SCOPES = ("local.fragment", "local", "local.var")


class GemmOperands(NamedTuple):
    """The A, B and C buffers of one tile GEMM and their scopes."""

    a: str
    b: str
    c: str
    a_scope: str
    b_scope: str
    c_scope: str


def _tir_of(func) -> Any:
    """The TIR namespace the prim_func belongs to (``tvm.tirx`` on TileLang 0.1.12+, ``tvm.tir`` before)."""
    return importlib.import_module(type(func).__module__.rsplit(".", 1)[0])


def _buffer(tir, arg) -> Optional[tuple[str, str]]:
    """``(name, scope)`` of the buffer a GEMM operand argument names, or None where it names none."""
    if isinstance(arg, tir.BufferLoad):
        return arg.buffer.name, arg.buffer.scope()
    if hasattr(tir, "BufferRegion") and isinstance(arg, tir.BufferRegion):
        return arg.buffer.name, arg.buffer.scope()
    if isinstance(arg, tir.Call):
        name = str(getattr(arg.op, "name", arg.op))
        if name.endswith("tvm_access_ptr") and len(arg.args) > 1 and isinstance(arg.args[1], tir.Var):
            var = arg.args[1]
            return var.name, str(getattr(var.type_annotation, "storage_scope", ""))
        for inner in arg.args:  # a region call: the buffer load is its first argument
            found = _buffer(tir, inner)
            if found is not None:
                return found
    return None


def gemm_operands(func) -> list[GemmOperands]:
    """The operands of every tile GEMM (``T.gemm``) in the prim_func ``func``, in program order."""
    tir = _tir_of(func)
    found: list[GemmOperands] = []

    def visit(node):
        if isinstance(node, tir.Call) and "gemm" in str(getattr(node.op, "name", "")).rsplit(".", 1)[-1]:
            ops = [_buffer(tir, a) for a in node.args[:3]]
            if all(o is not None for o in ops):
                (a, sa), (b, sb), (c, sc) = ops
                found.append(GemmOperands(a, b, c, sa, sb, sc))
            else:
                raise ValueError(f"cannot read the operands of the GEMM {node.op} (TileLang version change?)")

    tir.stmt_functor.post_order_visit(func.body, visit)
    return found


def register_a_gemms(func) -> list[GemmOperands]:
    """The tile GEMMs of ``func`` that read their A operand from registers."""
    return [g for g in gemm_operands(func) if g.a_scope in REGISTER_SCOPES]
