"""DeepSeek-V4's caches as vLLM 0.33.0 allocates them, read and written by this package's ops (issue 19, item 3).

A fresh interpreter builds the tiny V4 (``integration_tests/tiny_dsv4.py``: ratios 0/4/128/4, FP8 KV, pages of 256)
through ``EngineArgs(..., load_format="dummy").create_engine_config()`` with no network, constructs the model on
the CPU, takes each attention sub-layer's KV spec, plans the groups and allocates and binds the caches with vLLM's
own functions (its engine core's and worker's steps). vLLM packs the SWA, C4, C128 and indexer pages of a block
into one physical block: each bound ``layer.kv_cache`` is ``[blocks, rows, bytes]`` whose ``stride(0)`` is the
packed block, not the page; layers of different groups share bytes, kept apart by their block ids. On those
views:

- ``write_kv_v4`` / ``write_index_k`` change exactly the bytes of the rows they address (``block * stride(0)`` plus
  the row's data and scale bytes) and nothing else of the shared buffer, which starts filled with random bytes;
- what they wrote reads back as what the same writer puts into a standalone cache;
- ``sparse_mqa`` over the packed C4 and SWA views equals ``sparse_mqa`` over compact copies of their pages.

The reference ops run (this is a CPU); the TileLang programs address a cache by the same page stride (their tests
use vLLM's 93,888-byte block).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, sys
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, sys.argv[1])
import torch
from tiny_dsv4 import CONFIG
from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import initialize_model
from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.testing import vllm_dsv4 as fx

# a pool of 16 blocks must hold one whole request: max_model_len 16 (the compressor states are not windowed)
vc = fx.engine_config(CONFIG, max_model_len=16, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=16)
with set_current_vllm_config(vc):
    fx.init_distributed()
    with torch.device("cpu"):
        initialize_model(vllm_config=vc)
    layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
    alloc = fx.allocate(vc, layers)  # vLLM's planning, allocation and binding, as its engine core and worker run them

specs = [n for _, names, _ in alloc.groups for n in names]
bound = {n: layers[n].kv_cache for n in specs}
buf = alloc.buffer
g = torch.Generator().manual_seed(0)
buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))  # every byte nobody writes: noise
report = {"layout": alloc.layout, "views": {}, "checks": []}
kv_names = [n for n in bound if bound[n].dtype == torch.uint8 and bound[n].shape[-1] == L.ROW_BYTES]
idx_names = [n for n in bound if bound[n].dtype == torch.uint8 and bound[n].shape[-1] == L.INDEX_ROW_BYTES]
for n in kv_names + idx_names:
    v = bound[n]
    report["views"][n] = [list(v.shape), list(v.stride())]


def row_bytes(view, slots, row, scale):
    """The byte offsets in the shared buffer that slots' rows occupy: data rows first in a page, then scales."""
    R, stride = view.shape[1], view.stride(0)
    base = view.storage_offset()
    out = []
    for s in slots.tolist():
        b, i = divmod(s, R)
        page = base + b * stride
        out += list(range(page + i * row, page + (i + 1) * row))
        out += list(range(page + R * row + i * scale, page + R * row + (i + 1) * scale))
    return out


for n in kv_names + idx_names:
    view = bound[n]
    is_kv = n in kv_names
    R = view.shape[1]
    n_rows = min(37, view.shape[0] * R // 2)  # C128 pages hold 2 rows
    slots = torch.randperm(view.shape[0] * R, generator=g)[:n_rows]
    x = torch.randn(n_rows, 512 if is_kv else 128, generator=g).to(torch.bfloat16) * 3
    before = buf.clone()
    (dsv4.write_kv_v4 if is_kv else dsv4.write_index_k)(x, view, slots)
    changed = set(torch.nonzero(buf != before).flatten().tolist())
    allowed = set(row_bytes(view, slots, 576 if is_kv else 128, 8 if is_kv else 4))
    report["checks"].append([n, "writes only its rows", changed <= allowed and len(changed) > 0.5 * len(allowed)])
    alone = (dsv4.new_kv_cache(view.shape[0], R) if is_kv else
             L.paged_view(torch.zeros(view.shape[0], L.index_page_bytes(R), dtype=torch.uint8), R, L.INDEX_ROW_BYTES))
    (dsv4.write_kv_v4 if is_kv else dsv4.write_index_k)(x, alone, slots)
    read = dsv4.read_kv_v4 if is_kv else dsv4.read_index_k
    report["checks"].append([n, "reads back", torch.equal(read(view, slots), read(alone, slots))])

# sparse attention over the packed C4 view of layer 1 and its SWA view, against compact copies of their pages.
# Layers of different groups share the buffer's bytes (vLLM gives each group its own block ids): here the C4
# pages are blocks 0-7 and the SWA pages blocks 8-15, as the block pool would hand them out.
c4, swa = bound["model.layers.1.attn"], bound["model.layers.1.attn.swa_cache"]
half = c4.shape[0] // 2
spans = {"c4": (c4, 0, half), "swa": (swa, half, swa.shape[0])}
compact = {}
for key, (v, lo, hi) in spans.items():
    R = v.shape[1]
    allslots = torch.arange(lo * R, hi * R)
    rows = torch.randn(allslots.numel(), 512, generator=g).to(torch.bfloat16)
    dsv4.write_kv_v4(rows, v, allslots)
    c = dsv4.new_kv_cache(v.shape[0], R)
    dsv4.write_kv_v4(rows, c, allslots)
    compact[key] = c
T, H = 5, 8
q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
i1 = torch.randint(half * 64 - 1, swa.shape[0] * 64, (T, 128), generator=g, dtype=torch.int32)
i1[i1 < half * 64] = -1
i2 = torch.randint(-1, half * 64, (T, 64), generator=g, dtype=torch.int32)
sink = torch.randn(H, generator=g)
a = dsv4.sparse_mqa(q, swa, i1, extra_cache=c4, extra_indices=i2, sink=sink)
b = dsv4.sparse_mqa(q, compact["swa"], i1, extra_cache=compact["c4"], extra_indices=i2, sink=sink)
report["checks"].append(["sparse_mqa", "packed = compact", torch.equal(a, b) and bool(torch.isfinite(a).all())])
report["shared"] = c4.storage_offset() < swa.storage_offset() + swa.shape[1] * 584 and \
    swa.storage_offset() < c4.storage_offset() + c4.shape[1] * 584
print("REPORT " + json.dumps(report))
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    script = tmp_path_factory.mktemp("vllm_v4") / "caches.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), str(ROOT / "integration_tests")], capture_output=True,
                         text=True, env=env, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("REPORT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_vllm_packs_the_v4_pages_into_one_block(report):
    views = report["views"]
    assert report["layout"] == "BLHNC"
    # C4 main, C128 main, SWA and indexer keys: rows of 584 / 132 bytes, 64 or 2 rows a page, one block stride
    assert views["model.layers.1.attn"][0][1:] == [64, 584] and views["model.layers.2.attn"][0][1:] == [2, 584]
    assert views["model.layers.1.attn.indexer.k_cache"][0][1:] == [64, 132]
    assert views["model.layers.0.attn.swa_cache"][0][1:] == [64, 584]
    strides = {s[0] for _, s in views.values()}
    assert len(strides) == 1 and strides.pop() > 64 * 584  # the packed block, larger than any one page
    assert report["shared"]  # layer 1's C4 and SWA views overlap in bytes: their block ids keep them apart


def test_our_ops_address_vllms_packed_caches(report):
    names = {c[0] for c in report["checks"]}
    assert "model.layers.3.attn.indexer.k_cache" in names and "model.layers.2.attn" in names
    failed = [c for c in report["checks"] if not c[2]]
    assert not failed, failed
