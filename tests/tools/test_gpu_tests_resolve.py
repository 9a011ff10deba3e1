"""The GPU tests run only where a GPU is lent, so a renamed or moved function would break them unseen: every
attribute they take from one of this package's modules (``dsv4.read_kv_v4``, ``ops.norm_rope_``) and every name
they import from it must exist, checked here on the CPU. (A GPU run on 2026-12-06 failed this way after the V4
family's split: ``dsv4.read_kv_v4_reference`` had never been a name of the package.)"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = sorted(p for p in (ROOT / "tests").rglob("test_gpu_*.py"))


def _package_modules(tree: ast.Module) -> dict:
    """``{local name: module}`` for each of this package's modules the file imports, and the names it imports from
    them, checked as it goes."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("musa_attn_backend") and a.asname:
                    aliases[a.asname] = importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("musa_attn_backend"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                try:
                    value = getattr(mod, a.name) if hasattr(mod, a.name) else importlib.import_module(
                        f"{node.module}.{a.name}")
                except ImportError:
                    raise AssertionError(f"line {node.lineno}: {node.module} has no {a.name}") from None
                if hasattr(value, "__file__"):  # a module: its attributes are checked too
                    aliases[a.asname or a.name] = value
    return aliases


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.name)
def test_every_package_name_a_gpu_test_uses_exists(path):
    tree = ast.parse(path.read_text())
    aliases = _package_modules(tree)
    missing = [f"line {n.lineno}: {n.value.id}.{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
               and isinstance(n.ctx, ast.Load) and not hasattr(aliases[n.value.id], n.attr)]
    assert not missing, f"{path.name} uses names the package does not have: {missing}"


def test_the_check_finds_gpu_tests_and_a_missing_name(tmp_path):
    assert len(GPU_TESTS) >= 10
    bad = ast.parse("from musa_attn_backend.kernels import dsv4\nx = dsv4.no_such_op\n")
    aliases = _package_modules(bad)
    assert "dsv4" in aliases and not hasattr(aliases["dsv4"], "no_such_op")
