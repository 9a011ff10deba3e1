"""``musa-attn warmup`` for DeepSeek-V4 under SGLang is complete: every kernel SGLang's V4 path asks for, as the
V4 kit's cases (SWA, C4 and C128 decode and extend, sparse prefill, target verify, draft extend, the CUDA-graph
decode runner) and our compressor and indexer tests inside SGLang's pool drive it, is in the plan of the model
those cases describe, for sm_90a and for mp_31.

On a CPU the cases run the reference ops; :mod:`musa_attn_backend.testing.trace_plugin` records what each op's
TileLang glue would compile on either target (the glue runs, its kernels do not). The cases run in a
subprocess: their own test files, unchanged, under the plugin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from musa_attn_backend import _tilelang, config, warmup, warmup_dsv4  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("sm_90a", "mp_31")
# the model the cases describe: the kit's 64 heads, top-512 and ratios 0 / 4 / 128; the indexer tests' 16
# indexer heads; SGLang's pages of 256
KIT_MODEL = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 512,
             "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "compress_ratios": [0, 4, 128],
             "index_n_heads": 16, "index_topk": 512, "sliding_window": 128, "max_position_embeddings": 4096}


def plan_keys(cfg: dict, engine: str, target: str) -> set:
    """The compile keys of the warmup plan of ``cfg`` for ``engine`` on ``target``."""
    keys = []
    with config.override(target=target), _tilelang.intercepting(lambda k, b, t, p: keys.append(repr(k))):
        kind = "musa" if target.startswith("mp") else "cuda"
        for job in warmup_dsv4.plan(warmup_dsv4.from_hf_config(cfg), engine=engine, target_kind=kind):
            warmup._build(job)
    return set(keys)


@pytest.fixture(scope="module")
def asked(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "kernels.json"
    env = dict(os.environ, KERNEL_TRACE_OUT=str(out), KERNEL_TRACE_TARGETS=",".join(TARGETS),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "musa_attn_backend.testing.trace_plugin",
                          "-p", "no:cacheprovider", "tests/sglang/test_sglang_dsv4_kit.py",
                          "tests/sglang/test_sglang_dsv4_compressor.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1500)
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def _attention_kinds(target: str) -> set:
    """The sparse attention kernels a V4 step launches on ``target``: the program ``auto`` picks there."""
    from musa_attn_backend import config
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    with config.override(target=target):
        scheduled = tilelang_impl.sparse_mqa_program() == "scheduled"
    return {"dsv4_sparse_mqa_sched", "dsv4_sparse_combine"} if scheduled else {"dsv4_sparse_mqa", "dsv4_combine"}


@pytest.mark.parametrize("target", TARGETS)
def test_the_plan_holds_every_kernel_sglangs_v4_cases_ask_for(asked, target):
    want = set(asked[target])
    kinds = {k.split("'")[1] for k in want}
    # the cases drive every family of SGLang's V4 path: attention (split and not; the scheduled program and its
    # combine where the target runs it), writers, compressors, indexer
    assert _attention_kinds(target) | {"dsv4_write_kv", "dsv4_write_index_k", "dsv4_compress_rows",
            "dsv4_save_state", "dsv4_indexer_q", "dsv4_paged_indexer_logits", "dsv4_indexer_topk",
            "dsv4_norm_rope"} <= kinds, kinds
    missing = want - plan_keys(KIT_MODEL, "sglang", target)
    assert not missing, f"kernels SGLang's V4 path asks for that the warmup plan lacks on {target}: {missing}"
    # the comparison can fail: the plan of another model (top-1024, no C128 layers) lacks some of them
    assert want - plan_keys(dict(KIT_MODEL, index_topk=1024, compress_ratios=[0, 4]), "sglang", target)
