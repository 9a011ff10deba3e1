"""``musa-attn warmup``: model configs -> kernel plan, engine cache layouts, and a real compile for sm_90a."""

import os
import subprocess
import sys

import pytest
import torch

from musa_attn_backend import warmup
from musa_attn_backend.paged_layout import cache_rows

LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "torch_dtype": "bfloat16"}
GEMMA2 = {"model_type": "gemma2", "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0, "torch_dtype": "bfloat16",
          "layer_types": ["sliding_attention", "full_attention"] * 13}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128, "torch_dtype": "bfloat16",
           "layer_types": ["sliding_attention", "full_attention"] * 12}
MISTRAL = {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "sliding_window": 4096, "torch_dtype": "float16"}


def test_from_hf_config():
    m = warmup.from_hf_config(LLAMA, tp=2)
    assert (m.num_q_heads, m.num_kv_heads, m.head_dim, m.dtype, m.has_window) == (16, 4, 128, "bfloat16", False)
    g = warmup.from_hf_config(GEMMA2)
    assert (g.head_dim, g.has_window, g.only_window, g.has_softcap) == (256, True, False, True)
    o = warmup.from_hf_config(GPT_OSS, tp=8)
    assert (o.num_q_heads, o.num_kv_heads, o.has_sinks, o.has_window) == (8, 1, True, True)
    s = warmup.from_hf_config(MISTRAL)
    assert s.only_window and s.dtype == "float16"
    assert warmup.from_hf_config(LLAMA, tp=16).num_kv_heads == 1  # KV heads replicated past their count
    with pytest.raises(ValueError, match="divisible"):
        warmup.from_hf_config(LLAMA, tp=3)


def test_plan_lists_each_kernel_serving_needs():
    jobs = warmup.plan(warmup.from_hf_config(GEMMA2), engine="vllm", speculative_tokens=3)
    kinds = [j.kind for j in jobs]
    # windowed and full layers: two specs x (prefill, decode q=1 split/no-split, decode q=4, combine)
    assert kinds.count("prefill") == 2 and kinds.count("combine") == 2 and kinds.count("write_kv") == 1
    assert kinds.count("decode") == 8
    assert len(set(jobs)) == len(jobs)
    fp8 = warmup.plan(warmup.from_hf_config(LLAMA), kv_dtype="fp8")
    assert all(j.args[0].kv_dtype == "float8_e4m3" for j in fp8 if j.kind != "write_kv")


def test_plan_adds_the_new_kv_prefill(use_settings):
    """On a Hopper target (unless ``MUSA_ATTN_NEW_KV_PREFILL=0``), the prefill reading the new K/V of batches without
    cached prefixes is warmed up too, for the two layouts the engines hand over (views of a fused QKV
    projection, K/V of their own); not for FP8 caches, windowed layers, or with the switch off."""
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(target="sm_90a")
    llama = warmup.from_hf_config(LLAMA, tp=2)
    def new_kv_jobs(jobs):
        return [j for j in jobs if j.kind == "prefill" and len(j.args) > 3]

    use_settings(new_kv_prefill=False)
    assert not new_kv_jobs(warmup.plan(llama))  # switched off
    use_settings(new_kv_prefill=True)  # on by default
    new = new_kv_jobs(warmup.plan(llama, engine="vllm"))
    assert len(new) == 2 and all(j.args[4] == ti.new_kv_prefill_config(128, 128) and j.args[5] for j in new)
    # the layouts are those of the engines' tensors: k / v split off a fused projection, or contiguous
    qkv = torch.zeros(10, (16 + 2 * 4) * 128, dtype=torch.bfloat16)
    fused = ti._new_kv_rows((qkv[:, 16 * 128:20 * 128], qkv[:, 20 * 128:]), 10, 4, 128, 128, torch.bfloat16, "t")
    alone = ti._new_kv_rows((torch.zeros(10, 4, 128, dtype=torch.bfloat16),) * 2, 10, 4, 128, 128, torch.bfloat16,
                            "t")
    assert {(j.args[0].k_layout, j.args[0].v_layout) for j in new} == {fused[2:], alone[2:]}
    assert not new_kv_jobs(warmup.plan(llama, kv_dtype="fp8"))
    assert not new_kv_jobs(warmup.plan(warmup.from_hf_config(MISTRAL)))  # windowed only


@pytest.mark.parametrize("hkv,d", [(8, 128), (1, 64), (4, 256)])
def test_cache_layouts_match_what_each_engine_allocates(hkv, d):
    # SGLang: separate K and V pools [slots, H, D], viewed as pages of 16.
    k_pool = torch.zeros(64, hkv, d, dtype=torch.bfloat16).view(4, 16, hkv, d)
    k_sg, v_sg = warmup.cache_layouts("sglang", hkv, d, d)
    assert cache_rows(k_pool)[1] == k_sg and cache_rows(k_pool)[1] == v_sg
    # vLLM NHD: one [blocks, block, H, 2D] buffer, K and V are views.
    buf = torch.zeros(4, 16, hkv, 2 * d, dtype=torch.bfloat16)
    kc, vc = buf.split(d, dim=-1)
    k_vl, v_vl = warmup.cache_layouts("vllm", hkv, d, d)
    assert cache_rows(kc)[1] == k_vl and cache_rows(vc)[1] == v_vl


def test_warmup_compiles_for_sm90a_then_hits_the_cache(tmp_path):
    """The representative CI compile of attention kernels: a GQA model (4 q / 1 kv heads, head dim 64). Seven
    kernels: prefill, the new-K/V prefill for its two layouts, the decode of 1 query token (two variants),
    combine, KV write."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, '
                   '"num_key_value_heads": 1, "torch_dtype": "bfloat16"}')
    env = {**os.environ, "MUSA_ATTN_CACHE_DIR": str(tmp_path / "cache"), "TILELANG_CACHE_DIR": ""}
    env.pop("TILELANG_CACHE_DIR")
    cmd = [sys.executable, "-m", "musa_attn_backend.cli", "warmup", "--model-config", str(cfg), "--target",
           "sm_90a", "-j", "2", "--quiet"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "7 compiled now, 0 already in the cache" in first.stdout
    assert len(list((tmp_path / "cache" / "kernels").glob("*.done"))) == 7
    assert any((tmp_path / "cache" / "tilelang").rglob("*.cubin")), "TileLang wrote no kernel into our cache"
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and "0 compiled now, 7 already in the cache" in again.stdout, again.stdout


def test_warmup_needs_a_target(monkeypatch, capsys):
    from musa_attn_backend import cli

    monkeypatch.delenv("MUSA_ATTN_TARGET", raising=False)  # the command reads the environment again
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: warmup has a target")
    assert cli.main(["warmup", "--heads", "4", "--kv-heads", "1", "--head-dim", "64"]) == 2
    assert "--target" in capsys.readouterr().err


def _lower_only(tmp_path, target, *extra, env_extra=None):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, '
                   '"num_key_value_heads": 1, "torch_dtype": "bfloat16"}')
    env = {**os.environ, "MUSA_ATTN_CACHE_DIR": str(tmp_path / "cache"), **(env_extra or {})}
    cmd = [sys.executable, "-m", "musa_attn_backend.cli", "warmup", "--model-config", str(cfg), "--target", target,
           "--lower-only", "-j", "2", "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)


def test_warmup_lower_only_for_sm90a_writes_every_source(tmp_path):
    """``warmup --lower-only``: TileLang's lowering of the seven kernels of the tiny model, with P staged through
    shared memory as on MUSA (``MUSA_ATTN_SHARED_P=1``); each generated source written under ``--out`` with an
    index, no device compiler run, nothing put into the kernel cache."""
    out = tmp_path / "src"
    res = _lower_only(tmp_path, "sm_90a", "--out", str(out), env_extra={"MUSA_ATTN_SHARED_P": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "7 of 7 kernels lowered" in res.stdout
    import json

    index = json.loads((out / "index.json").read_text())
    assert len(index["kernels"]) == 7 and all("file" in k and "error" not in k for k in index["kernels"])
    assert ["MUSA_ATTN_SHARED_P", "1"] in [list(kv) for kv in index["settings"].items()]
    sources = {k["kind"]: (out / k["file"]).read_text() for k in index["kernels"]}
    assert set(sources) == {"prefill", "decode", "combine", "write_kv"}
    assert all("__global__" in s for s in sources.values())
    assert "P_s" in sources["prefill"] and "P_s" in sources["decode"]
    assert not any((tmp_path / "cache").rglob("*.done")) and not any((tmp_path / "cache").rglob("*.cubin"))


def test_warmup_lower_only_checks_musa_rules_without_a_musa_tilelang(tmp_path):
    """A target the installed TileLang cannot lower for (MUSA, with this CUDA-only TileLang): every kernel's TIR is
    checked against the target's rules (:mod:`musa_attn_backend.kernels._tir`) and the run says that nothing was
    lowered; exit 0 when all pass, nothing written but the index."""
    out = tmp_path / "src"
    res = _lower_only(tmp_path, "mp_31", "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "7 of 7 kernels passed the target's rules" in res.stdout and "not lowered" in res.stdout
    import json

    index = json.loads((out / "index.json").read_text())
    assert len(index["kernels"]) == 7 and all(k.get("checked_only") and "file" not in k for k in index["kernels"])
    assert sorted(p.name for p in out.iterdir()) == ["index.json"]


def _register_p_spec():
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    lay = (2 * 128, 2 * 128, 128)
    return ti.AttnSpec(8, 2, 128, 128, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)


def _pingpong():
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    return ti.PrefillConfig(block_M=128, block_N=128, num_stages=2, threads=384, tma=True, pingpong=True)


def test_lower_only_reports_a_register_operand_for_musa(use_settings):
    """The lowering-only check refuses, before lowering, a program whose P V product reads P from registers on a
    MUSA target (the ping-pong prefill forced on it), and says why; a kernel within the rules is checked only
    (no MUSA TileLang here), with no error and no source."""
    use_settings(target="mp_31")
    res = warmup._lower(warmup.Job("prefill", (_register_p_spec(), True, 128, None, _pingpong())))
    assert res.source is None and "keeps P in registers" in res.error and not res.checked_only
    res = warmup._lower(warmup.Job("combine", (_register_p_spec(),)))
    assert res.source is None and res.error is None and res.checked_only and res.name.startswith("combine-")


def test_lower_only_names_the_rule_a_program_breaks(use_settings, monkeypatch):
    """A program that breaks an MP31 rule (the sparse MQA program with one K/V tile for both GEMMs, as it was
    before MUSA's form) is reported by ``--lower-only`` with the rule's flag."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as dti

    use_settings(target="mp_31")
    monkeypatch.setattr(dti, "portable_form", lambda target=None: {"block_N": 64, "separate_v": False})
    res = warmup._lower(warmup.Job("dsv4_sparse_mqa", (64, True, True, False, "bfloat16")))
    assert res.error and "is read B MN-major and K-major" in res.error and "gemm_tile_two_majors" in res.error


def test_warmup_says_when_no_tiling_fits(monkeypatch, capsys):
    """A model none of whose prefill tilings fit the target (head dim 256 on MP22): exit 2 with the reason, no
    traceback."""
    from musa_attn_backend import cli, config

    monkeypatch.setenv("MUSA_ATTN_TARGET", "mp_22")  # the command sets it again and reads the environment
    try:
        assert cli.main(["warmup", "--heads", "8", "--kv-heads", "2", "--head-dim", "256", "--lower-only"]) == 2
    finally:
        monkeypatch.delenv("MUSA_ATTN_TARGET")
        config.refresh()
    assert "no prefill tiling of head dims 256/256 fits the 128 KB of shared memory of mp_22" in capsys.readouterr().err
