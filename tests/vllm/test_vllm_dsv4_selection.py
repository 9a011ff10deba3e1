"""DeepSeek-V4 under ``--attention-backend tilelang_musa`` in vLLM 0.33.0: its model picks the layer class itself
(``nvidia.model._select_dsv4_attn_cls``) and used to drop our backend for FlashMLA silently. After the plugin loads
(in a fresh interpreter, as vLLM's processes load it), that choice returns our layer for V4 and refuses ours with a
message for V4.1 (its own model package), whether vLLM imports the model modules after the plugin (the
post-import hook) or before; other backends keep vLLM's choice; loading twice changes nothing. The modules are not
imported by loading the plugin (they cost seconds). Spawned workers load the plugin themselves: a spawned
process gets the same choice."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
from types import SimpleNamespace


def cfg(b):
    return SimpleNamespace(attention_config=SimpleNamespace(backend=b),
                           parallel_config=SimpleNamespace(prefill_context_parallel_size=1))


def child(q):  # a spawned process: it loads the plugin itself, as vLLM's spawned workers do
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.models.deepseek_v4.nvidia.model as m
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    q.put(m._select_dsv4_attn_cls(cfg(E["TILELANG_MUSA"])).__name__)


def main(order):
    if order == "module-first":
        import vllm.models.deepseek_v4.nvidia.model
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    load_general_plugins()
    for early in ("vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v41.nvidia.model"):
        assert order == "module-first" or early not in sys.modules, "imported early"
    import vllm.models.deepseek_v4.nvidia.model as nv
    import vllm.models.deepseek_v41.nvidia.model as nv41
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from musa_attn_backend.vllm.dsv4 import MusaDeepseekV4Attention
    assert nv._select_dsv4_attn_cls(cfg(E["TILELANG_MUSA"])) is MusaDeepseekV4Attention
    assert nv._select_dsv4_attn_cls(cfg(E.FLASHMLA_SPARSE_DSV4)) is nv.DeepseekV4FlashMLAAttention
    assert nv._select_dsv4_attn_cls(cfg(None)) is nv.DeepseekV4FlashMLAAttention  # a CPU is not MUSA
    try:
        nv41._select_dsv4_attn_cls(cfg(E["TILELANG_MUSA"]))
        raise SystemExit("no refusal")
    except ValueError as e:
        assert "tilelang_musa: DeepSeek-V4.1 checkpoints are not supported" in str(e), e
    for m in (nv, nv41):
        assert m._select_dsv4_attn_cls.__wrapped__.__name__ == "_select_dsv4_attn_cls"
        assert not hasattr(m._select_dsv4_attn_cls.__wrapped__, "__wrapped__"), "wrapped twice"
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    assert q.get(timeout=240) == "MusaDeepseekV4Attention"
    p.join(60)
    print("SELECTION OK")


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.parametrize("order", ["plugin-first", "module-first"])
def test_v4_layer_choice_is_ours(order, tmp_path):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), order], capture_output=True, text=True, env=env, timeout=400)
    assert out.returncode == 0 and "SELECTION OK" in out.stdout, (out.stdout[-2000:], out.stderr[-3000:])
