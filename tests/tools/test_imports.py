"""The package's import graph: no cycles, and no module imports one of a higher layer.

Every ``import`` / ``from ... import`` of a package module counts, at module level or inside a function (a
deferred import is still a dependency, and a cycle through one breaks as soon as someone hoists it). A
``from . import name`` edge points at the submodule ``name`` where one exists, else at the package itself, so a
submodule that reads a name defined in its package's ``__init__`` (which imports the submodule) is a cycle.

The layers, lowest first (a module may import its own layer or lower ones; the longest matching prefix decides):
settings, the kernel cache, the platform layer, TileLang's loader and the tuning tables, the engine-neutral
metadata, the kernels, the V4 metadata translations (they call the kernels' slot helpers), warmup, the engine
adapters, the test support, the tools (demo, tuner), the CLI.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "musa_attn_backend"
P = "musa_attn_backend"

LAYERS = [
    (P, f"{P}.program_checks", f"{P}.import_hooks", f"{P}.paged_layout"),
    (f"{P}.config",),
    (f"{P}.cache",),
    (f"{P}.platform",),
    (f"{P}._tilelang", f"{P}._ffi_launch", f"{P}.tuning"),
    (f"{P}.metadata",),
    (f"{P}.kernels",),
    (f"{P}.metadata.sglang_dsv4", f"{P}.metadata.vllm_dsv4"),
    (f"{P}.warmup", f"{P}.warmup_dsv4"),
    (f"{P}.sglang", f"{P}.vllm"),
    (f"{P}.testing",),
    (f"{P}.demo", f"{P}.tune_attention"),
    (f"{P}.cli",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PKG) -> dict:
    """``{module: {package modules it imports}}`` for every ``.py`` under ``root`` (a package directory)."""
    base = root.parent
    mods = {".".join(p.relative_to(base).with_suffix("").parts[:-1] if p.name == "__init__.py"
                     else p.relative_to(base).with_suffix("").parts): p for p in root.rglob("*.py")}
    top = root.name
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    stem = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    target = ".".join(stem + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in mods and t != name and (t == top or t.startswith(top + "."))}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer_of(module: str) -> int:
    best = (-1, -1)
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (i, len(prefix))
    assert best[0] >= 0, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} -> {t}" for m, ts in sorted(import_graph().items()) for t in sorted(ts)
              if layer_of(t) > layer_of(m)]
    assert upward == []


def test_the_engine_adapters_do_not_import_each_other():
    graph = import_graph()
    crossing = [f"{m} -> {t}" for m, ts in graph.items() for t in ts
                for a, b in ((".sglang", ".vllm"), (".vllm", ".sglang"))
                if m.startswith(P + a) and t.startswith(P + b)]
    assert crossing == []


def test_the_checker_finds_a_cycle_through_a_package_init_and_a_deferred_import(tmp_path):
    pkg = tmp_path / "demo_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import y\nNAME = 1\n")
    (pkg / "sub" / "leaf.py").write_text("def g():\n    from . import NAME\n")
    (pkg / "c.py").write_text("from .sub import leaf\n")
    found = cycles(import_graph(pkg))
    assert ["demo_pkg.a", "demo_pkg.b"] in found
    assert ["demo_pkg.sub", "demo_pkg.sub.leaf"] in found
    assert len(found) == 2  # c imports into the second cycle without being part of it


@pytest.mark.parametrize("module, absent", [
    ("musa_attn_backend.config", ["musa_attn_backend.platform", "musa_attn_backend._tilelang", "tilelang"]),
    ("musa_attn_backend.metadata", ["musa_attn_backend.kernels", "sglang", "vllm"]),
    ("musa_attn_backend.platform", ["musa_attn_backend._tilelang", "tilelang"]),
    ("musa_attn_backend.kernels", ["tilelang", "musa_attn_backend.testing", "sglang", "vllm"]),
])
def test_importing_a_low_module_loads_nothing_above_it(module, absent):
    code = (f"import sys, {module}; print(' '.join(m for m in {absent!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
