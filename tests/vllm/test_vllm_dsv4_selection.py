"""DeepSeek-V4 under ``--attention-backend tilelang_musa`` in vLLM 0.33.0: its model picks the layer class itself
(``nvidia.model._select_dsv4_attn_cls``) and used to drop our backend for FlashMLA silently. After the plugin loads
(in a fresh interpreter, as vLLM's processes load it), that choice refuses ours with a message, whether vLLM
imports the model module after the plugin (the post-import hook) or before; other backends keep vLLM's choice;
loading twice changes nothing. The module is not imported by loading the plugin (it costs seconds)."""

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
order = sys.argv[1]
if order == "module-first":
    import vllm.models.deepseek_v4.nvidia.model
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
assert order == "module-first" or "vllm.models.deepseek_v4.nvidia.model" not in sys.modules, "imported early"
import vllm.models.deepseek_v4.nvidia.model as nv
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
cfg = lambda b: SimpleNamespace(attention_config=SimpleNamespace(backend=b))
try:
    nv._select_dsv4_attn_cls(cfg(E["TILELANG_MUSA"]))
    raise SystemExit("no refusal")
except ValueError as e:
    assert "tilelang_musa: DeepSeek-V4 attention through vLLM is not supported yet" in str(e), e
assert nv._select_dsv4_attn_cls(cfg(E.FLASHMLA_SPARSE_DSV4)) is nv.DeepseekV4FlashMLAAttention
assert nv._select_dsv4_attn_cls(cfg(None)) is nv.DeepseekV4FlashMLAAttention
assert nv._select_dsv4_attn_cls.__wrapped__.__name__ == "_select_dsv4_attn_cls"
assert not hasattr(nv._select_dsv4_attn_cls.__wrapped__, "__wrapped__"), "wrapped twice"
print("SELECTION OK")
"""


@pytest.mark.parametrize("order", ["plugin-first", "module-first"])
def test_v4_layer_choice_refuses_tilelang_musa(order):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK, order], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "SELECTION OK" in out.stdout, (out.stdout[-2000:], out.stderr[-3000:])
