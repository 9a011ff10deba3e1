"""The settings module: every MUSA_ATTN_* switch read once into a frozen Settings, override() for tests, the
caches derived from settings and the tuning table, the kernel settings in compile keys and the warmup record,
and ``musa-attn doctor``'s list of them."""

import dataclasses
import json
import logging
from dataclasses import asdict

import pytest
import torch

from musa_attn_backend import cli, config, tuning, warmup
from musa_attn_backend.kernels.attention import tilelang_impl as ti

ENV_NAMES = ["MUSA_ATTN_SPLIT_MIXED", "MUSA_ATTN_PINGPONG_GATHER", "MUSA_ATTN_PDL", "MUSA_ATTN_TMA_CHUNKS",
             "MUSA_ATTN_CHUNKED_COMBINE", "MUSA_ATTN_NEW_KV_PREFILL", "MUSA_ATTN_SHARED_P", "MUSA_ATTN_MUSA_FORMS",
             "MUSA_ATTN_DSV4_PROGRAM", "MUSA_ATTN_TARGET", "MUSA_ATTN_CACHE_DIR",
             "MUSA_ATTN_POISON", "MUSA_ATTN_VLLM_CUDA_GRAPHS", "MUSA_ATTN_MOE", "MUSA_ATTN_MODEL_KERNELS",
             "MUSA_ATTN_COMPILED_LAUNCH",
             "MUSA_ATTN_COMMIT"]
KERNEL_SWITCHES = ["MUSA_ATTN_PINGPONG_GATHER", "MUSA_ATTN_PDL", "MUSA_ATTN_TMA_CHUNKS", "MUSA_ATTN_CHUNKED_COMBINE",
                   "MUSA_ATTN_NEW_KV_PREFILL", "MUSA_ATTN_SHARED_P", "MUSA_ATTN_MUSA_FORMS",
                   "MUSA_ATTN_DSV4_PROGRAM"]


def test_every_switch_is_declared_once_with_its_default():
    assert [s.env for s in config.SWITCHES] == ENV_NAMES
    assert all(s.meaning and s.kind in ("bool", "text", "path") for s in config.SWITCHES)
    defaults, sources = config.read_environment({})
    assert defaults == config.Settings()
    assert (defaults.split_mixed, defaults.pingpong_gather, defaults.pdl, defaults.tma_chunks,
            defaults.chunked_combine, defaults.new_kv_prefill, defaults.vllm_cuda_graphs) == (True,) * 7
    assert not defaults.poison and not defaults.shared_p
    assert defaults.target is None and defaults.cache_dir is None and defaults.commit is None
    assert set(sources.values()) == {"default"}
    assert [env for env, _ in config.kernel_settings(defaults)] == KERNEL_SWITCHES
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.pdl = False


@pytest.mark.parametrize("raw,value", [("0", False), ("1", True), ("true", True), (" Off ", False), ("YES", True),
                                       ("no", False), ("", True)])
def test_boolean_spellings(raw, value):
    s, sources = config.read_environment({"MUSA_ATTN_PDL": raw})
    assert s.pdl is value
    assert sources["pdl"] == ("default" if not raw else "environment")


def test_environment_values_of_every_kind(tmp_path):
    s, _ = config.read_environment({"MUSA_ATTN_POISON": "1", "MUSA_ATTN_TARGET": " sm_90a ",
                                    "MUSA_ATTN_CACHE_DIR": "~/kc", "MUSA_ATTN_COMMIT": "abc123",
                                    "MUSA_ATTN_NEW_KV_PREFILL": "0"})
    assert s.poison and s.target == "sm_90a" and s.commit == "abc123" and not s.new_kv_prefill
    assert s.cache_dir == config.Path("~/kc").expanduser()


@pytest.mark.parametrize("env,raw", [("MUSA_ATTN_PDL", "maybe"), ("MUSA_ATTN_POISON", "2"),
                                     ("MUSA_ATTN_SPLIT_MIXED", "disabled")])
def test_invalid_values_name_the_variable_and_what_it_takes(monkeypatch, env, raw):
    before = config.settings()
    monkeypatch.setenv(env, raw)
    with pytest.raises(config.SettingsError, match=rf"{env}='{raw}' is not understood: use 1 or 0"):
        config.refresh()
    assert config.settings() is before  # the settings in force stay in force


def test_read_once_then_refresh(monkeypatch):
    before = config.settings()
    monkeypatch.setenv("MUSA_ATTN_CHUNKED_COMBINE", "0" if before.chunked_combine else "1")
    assert config.settings() is before  # not read again by itself
    assert config.refresh().chunked_combine is not before.chunked_combine
    assert config.settings().chunked_combine is not before.chunked_combine


def test_override_swaps_and_restores(tmp_path):
    before = config.settings()
    with config.override(pdl=False, cache_dir=str(tmp_path)) as s:
        assert config.settings() is s and not s.pdl and s.cache_dir == tmp_path
        assert s.split_mixed == before.split_mixed
        with config.override(pdl=True, target="sm_90a"):
            assert config.settings().pdl and config.settings().target == "sm_90a"
        assert not config.settings().pdl and config.settings().target == before.target
        rows = {r["env"]: r for r in config.describe()}
        assert rows["MUSA_ATTN_PDL"]["source"] == "override" and rows["MUSA_ATTN_PDL"]["value"] == "0"
        assert rows["MUSA_ATTN_PDL"]["default"] == "1" and rows["MUSA_ATTN_PDL"]["kernels"]
    assert config.settings() is before


@pytest.mark.parametrize("fields,match", [({"pdll": False}, "unknown setting.*pdll"),
                                          ({"pdl": "0"}, "MUSA_ATTN_PDL takes True or False"),
                                          ({"target": ""}, "MUSA_ATTN_TARGET takes a non-empty string"),
                                          ({"cache_dir": 3}, "MUSA_ATTN_CACHE_DIR takes a path")])
def test_override_rejects_bad_arguments(fields, match):
    with pytest.raises(config.SettingsError, match=match):
        with config.override(**fields):
            pass


def test_platform_and_cache_dir_follow_the_settings(tmp_path, use_settings):
    from musa_attn_backend.cache import cache_dir
    from musa_attn_backend.platform import get_platform

    use_settings(target="sm_90a", cache_dir=tmp_path)
    assert get_platform().arch == "sm_90a" and cache_dir() == tmp_path
    with config.override(target="mp_31"):
        assert get_platform().arch == "mp_31"
    assert get_platform().arch == "sm_90a"


def test_plans_follow_the_settings(use_settings):
    """The tiling plans are cached per shape class; a change of settings plans again."""
    use_settings(target="sm_90a")
    gather = ti.PrefillConfig(128, 128, 2, 384, False, True)
    assert ti.prefill_config(128, 128, page_size=16) == gather
    assert ti.prefill_config(128, 128, page_size=16) is ti.prefill_config(128, 128, page_size=16)
    with config.override(pingpong_gather=False):
        assert ti.prefill_config(128, 128, page_size=16) == ti.PrefillConfig(128, 128, 2, 256, False)
    assert ti.prefill_config(128, 128, page_size=16) == gather
    cands = ti.prefill_candidates(128, 128, page_size=16)
    cands.clear()  # a copy: the plan cache is not the caller's list
    assert ti.prefill_candidates(128, 128, page_size=16)
    assert ti.new_kv_prefill_config(128, 128) is not None
    use_settings(new_kv_prefill=False)
    assert ti.new_kv_prefill_config(128, 128) is None


def test_plans_follow_the_tuning_table(tmp_path, use_settings):
    """A table written by another process is read on ``tuning.load(refresh=True)``, which also plans again."""
    use_settings(target="sm_90a", cache_dir=tmp_path)
    tuning._loaded.clear()
    default = ti.prefill_config(128, 128, page_size=128)
    gathered = ti.PrefillConfig(block_M=128, block_N=64, num_stages=1, threads=256, tma=False)
    path = tuning.table_path()
    path.parent.mkdir(parents=True)
    key = ti.prefill_shape_class(128, 128, False, 128, False)
    path.write_text(json.dumps({"entries": {"prefill": {key: {"config": asdict(gathered), "ms": 1.0}}}}))
    assert ti.prefill_config(128, 128, page_size=128) == default  # planned from the table as it was
    tuning.load(refresh=True)
    assert ti.prefill_config(128, 128, page_size=128) == gathered
    tuning._loaded.clear()


def test_compile_keys_hold_the_kernel_settings(tmp_path, use_settings, monkeypatch):
    from musa_attn_backend import _tilelang

    use_settings(target="sm_90a", cache_dir=tmp_path)
    built = []
    monkeypatch.setattr(_tilelang.tl, "compile", lambda func, **kw: built.append(kw) or object())
    first = _tilelang.compile_cached(("test-kernel",), lambda: None)
    assert _tilelang.compile_cached(("test-kernel",), lambda: None) is first and len(built) == 1
    use_settings(pdl=False)
    assert _tilelang.compile_cached(("test-kernel",), lambda: None) is not first and len(built) == 2
    markers = list((tmp_path / "kernels").glob("*.done"))
    assert len(markers) == 2 and any("('MUSA_ATTN_PDL', '0')" in m.read_text() for m in markers)


def test_warmup_workers_take_the_parents_settings():
    current = dataclasses.replace(config.settings(), tma_chunks=False, poison=True)
    try:
        warmup._use_settings(current)
        assert config.settings() is current
        assert {r["source"] for r in config.describe()} == {"parent process"}
    finally:
        config.refresh()


def test_warmup_record_and_the_servers_mismatch_warning(tmp_path, use_settings, caplog):
    use_settings(target="sm_90a", cache_dir=tmp_path)
    caplog.set_level(logging.INFO, logger="musa_attn_backend")
    assert warmup.check_warmup_settings() == [] and "no `musa-attn warmup` recorded" in caplog.text
    path = warmup.record_settings()
    assert path == tmp_path / "warmup-settings.json"
    entry = json.loads(path.read_text())["targets"][repr({"kind": "cuda", "arch": "sm_90a"})]
    assert entry["settings"] == dict(config.kernel_settings()) and entry["tilelang"]
    caplog.clear()
    use_settings(split_mixed=False, poison=True)  # not kernel settings: nothing to say
    assert warmup.check_warmup_settings() == [] and not caplog.records
    use_settings(pdl=False, tma_chunks=False)
    diffs = warmup.check_warmup_settings()
    assert diffs == [("MUSA_ATTN_PDL", "0", "1"), ("MUSA_ATTN_TMA_CHUNKS", "0", "1")]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "MUSA_ATTN_PDL=0 here, 1 at warmup; MUSA_ATTN_TMA_CHUNKS=0 here, 1 at warmup" in warning.getMessage()
    caplog.clear()
    assert warmup.check_warmup_settings() == [] and not caplog.records  # once per process and settings
    assert warmup.check_warmup_settings(torch.device("cpu")) == []  # the reference path compiles nothing
    # another target's record does not speak for this one
    use_settings(target="sm_80")
    assert warmup.settings_differences() is None


def test_unreadable_warmup_record_is_an_error(tmp_path, use_settings):
    use_settings(target="sm_90a", cache_dir=tmp_path)
    (tmp_path / "warmup-settings.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="warmup record .* is unreadable"):
        warmup.settings_differences()


def test_sglang_start_up_checks_the_warmup_settings(tmp_path, use_settings, caplog):
    """SGLang's backend factory runs the check for a GPU device (here an sm_90a target without one)."""
    from musa_attn_backend.sglang.backend import _check_environment

    use_settings(target="sm_90a", cache_dir=tmp_path)
    warmup.record_settings()
    use_settings(chunked_combine=False)
    with caplog.at_level(logging.WARNING, logger="musa_attn_backend"):
        _check_environment(torch.device("cuda"))
    assert "MUSA_ATTN_CHUNKED_COMBINE=0 here, 1 at warmup" in caplog.text


def test_vllm_builder_checks_the_warmup_settings(tmp_path, use_settings, monkeypatch):
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from musa_attn_backend.vllm.backend import TileLangMusaBackend

    seen = []
    monkeypatch.setattr(warmup, "check_warmup_settings", lambda device=None: seen.append(device) or [])
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    TileLangMusaBackend.get_builder_cls()(spec, ["layer.0"], VllmConfig(), torch.device("cpu"))
    assert seen == [torch.device("cpu")]


def test_doctor_lists_the_effective_settings(monkeypatch, capsys):
    monkeypatch.setattr(cli, "probe_engine", lambda e: {"installed": False})
    monkeypatch.setenv("MUSA_ATTN_PDL", "0")
    config.refresh()
    cli.main(["doctor"])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("MUSA_ATTN_")}
    assert list(lines) == ENV_NAMES
    assert lines["MUSA_ATTN_PDL"].split()[1:] == ["*", "0", "default", "1", "overridden", "(environment)"]
    assert "overridden" not in lines["MUSA_ATTN_SPLIT_MIXED"] and "*" not in lines["MUSA_ATTN_SPLIT_MIXED"]
    cli.main(["doctor", "--json"])
    rows = {r["env"]: r for r in json.loads(capsys.readouterr().out)["settings"]}
    assert rows["MUSA_ATTN_PDL"] == {"env": "MUSA_ATTN_PDL", "value": "0", "default": "1", "source": "environment",
                                     "kernels": True, "meaning": config.BY_FIELD["pdl"].meaning}


def test_doctor_reports_an_invalid_setting(monkeypatch, capsys):
    monkeypatch.setenv("MUSA_ATTN_PDL", "maybe")
    with pytest.raises(config.SettingsError):
        config.refresh()
    assert cli.main(["doctor"]) == 1
    assert "MUSA_ATTN_PDL='maybe' is not understood" in capsys.readouterr().out
