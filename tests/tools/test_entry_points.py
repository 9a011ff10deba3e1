"""Both engines find the plugin through its installed entry point, in a fresh interpreter."""

import subprocess
import sys
import textwrap

import pytest

CASES = {
    "sglang": """
        from sglang.srt.plugins import load_plugins
        import musa_attn_backend.sglang as plugin
        assert not plugin.registered
        load_plugins()
        assert plugin.registered
        load_plugins()  # idempotent
        plugin.register()
        print("OK")
    """,
    "vllm": """
        from vllm.plugins import load_general_plugins
        import musa_attn_backend.vllm as plugin
        assert not plugin.registered
        load_general_plugins()
        assert plugin.registered
        plugin.register()
        print("OK")
    """,
}


@pytest.mark.parametrize("engine", sorted(CASES))
def test_engine_loader_calls_register(engine):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(CASES[engine])], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-2000:] + res.stderr[-3000:]


def test_entry_points_declared():
    import importlib.metadata as md

    for group, value in (("sglang.srt.plugins", "musa_attn_backend.sglang:register"),
                         ("vllm.general_plugins", "musa_attn_backend.vllm:register")):
        eps = {e.name: e.value for e in md.entry_points(group=group)}
        assert eps.get("tilelang_musa") == value
    scripts = {e.name: e.value for e in md.entry_points(group="console_scripts")}
    assert scripts.get("musa-attn") == "musa_attn_backend.cli:main"
