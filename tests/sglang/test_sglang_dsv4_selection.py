"""``--attention-backend tilelang_musa`` for a DeepSeek-V4 model: SGLang's V4 model override replaces any backend
by ``dsv4``; our provider, registered after it by the entry point, keeps ours. Resolved in fresh interpreters from
the tiny V4 ``config.json`` of ``integration_tests/tiny_dsv4.py`` (nothing downloads), as SGLang's launcher
resolves ``ServerArgs``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT / "integration_tests"))
from tiny_dsv4 import CONFIG as TINY_V4  # noqa: E402

RESOLVE = """
import sys
if sys.argv[2] == "plugins":
    from sglang.srt.plugins import load_plugins
    load_plugins()
    load_plugins()  # every SGLang process loads them; a second load must change nothing
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view
args = ServerArgs(model_path=sys.argv[1], device="cpu", skip_tokenizer_init=True, **dict(
    a.split("=") for a in sys.argv[3:]))
args.resolve_once()
view = resolved_view(args)
print("RESOLVED", view.attention_backend, *attention_backends_of(view))
"""


def _resolve(tmp_path, plugins: bool, *fields: str) -> list:
    (tmp_path / "config.json").write_text(json.dumps(TINY_V4))
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "integration_tests" / "sgl_kernel_shim"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", RESOLVE, str(tmp_path), "plugins" if plugins else "none", *fields],
                         capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESOLVED")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return line[-1].split()[1:]


def test_sglang_alone_replaces_the_backend_by_dsv4(tmp_path):
    """The trap our provider closes: without the plugin, SGLang resolves a V4 model to ``dsv4``."""
    assert _resolve(tmp_path, False, "attention_backend=tilelang_musa") == ["dsv4"] * 3


def test_tilelang_musa_survives_the_v4_override(tmp_path):
    assert _resolve(tmp_path, True, "attention_backend=tilelang_musa") == ["tilelang_musa"] * 3


def test_other_backends_keep_sglangs_choice(tmp_path):
    assert _resolve(tmp_path, True, "attention_backend=triton") == ["dsv4"] * 3


def test_split_flags_select_ours(tmp_path):
    got = _resolve(tmp_path, True, "prefill_attention_backend=tilelang_musa", "decode_attention_backend=tilelang_musa")
    assert got[1:] == ["tilelang_musa", "tilelang_musa"]
