"""Our compressor against vLLM's own Triton compressor kernels, on the CPU: ``fused_compress_quant_cache``'s
attention compressor (584-byte rows) and its indexer compressor (132-byte rows, power-of-two scale), run by
Triton's interpreter in a process of its own (:mod:`musa_attn_backend.testing.vllm_compressor_oracle`; skipped
where vLLM or Triton does not import). Both ratios, both widths, vLLM's paged state, several calls.

Tolerances: the rows read back within one e4m3 step of their tile's scale (vLLM takes each softmax in one pass,
ours online: the rows differ in the last bits, so a value at a rounding boundary may round the other way), the
bf16 RoPE values within 1e-2, and at least 99% of the bytes vLLM wrote identical to ours (a layout or formula
error changes nearly all of them; on these cases all are). The oracle rounds the interpreter's float casts to
nearest even, as the GPU does (see the oracle module).
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.testing.vllm_compressor_oracle import CASES


@pytest.fixture(scope="module")
def vllm_rows(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("vLLM or Triton is not installed here")
    out = tmp_path_factory.mktemp("vllm_compressor") / "rows.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "musa_attn_backend.testing.vllm_compressor_oracle", str(out)],
                         env=env, capture_output=True, text=True, timeout=900)
    if run.returncode != 0 and "No module named 'vllm.models.deepseek_v4" in run.stderr:
        pytest.skip("this vLLM has no DeepSeek-V4 compressor")
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("ratio,d", CASES)
def test_compress_matches_vllms_triton_compressor(vllm_rows, ratio, d):
    r = vllm_rows[f"{ratio}-{d}"]
    s = r["slots"]
    n = len(s)
    assert n >= 2
    width = L.INDEX_ROW_BYTES if d == L.INDEX_D else L.ROW_BYTES
    ours, theirs = (dsv4.paged_view(r[k], r["rows"], width) for k in ("ours", "theirs"))
    if d == L.INDEX_D:
        a, b = dsv4.read_index_k(ours, s).double(), dsv4.read_index_k(theirs, s).double()
        nope, tile = d, d
    else:
        a, b = dsv4.read_kv_v4(ours, s).double(), dsv4.read_kv_v4(theirs, s).double()
        nope, tile = L.D_NOPE, 64
        assert torch.allclose(a[:, nope:], b[:, nope:], rtol=1e-2, atol=1e-2)
    amax = b[:, :nope].abs().view(n, -1, tile).amax(-1, keepdim=True)
    assert ((a - b)[:, :nope].abs().view(n, -1, tile) <= amax / 14 + 1e-6).all()
    mine, vllms = r["ours"].reshape(-1), r["theirs"].reshape(-1)
    written = vllms != 0
    assert int(written.sum()) >= n * nope // 2  # vLLM wrote the rows
    same = (mine[written] == vllms[written]).double().mean()
    assert same >= 0.99, float(same)
