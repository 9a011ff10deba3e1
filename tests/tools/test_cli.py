import json
import os
import subprocess
import sys

import pytest

from musa_attn_backend import cli


def _run(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "musa_attn_backend.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def doctor_json():
    res = _run("doctor", "--json", "--require", "sglang,vllm")
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def test_doctor_sees_both_engines_discover_the_entry_point(doctor_json):
    for engine, group in (("sglang", "sglang.srt.plugins"), ("vllm", "vllm.general_plugins")):
        r = doctor_json["engines"][engine]
        assert r["installed"], engine
        assert r["entry_point"] == f"musa_attn_backend.{engine}:register", r
        assert r["register_called"] is True, r  # the engine's own loader ran our hook
    assert doctor_json["engines"]["sglang"]["version"] == "0.5.23"
    for engine in ("sglang", "vllm"):  # the adapters registered the name
        assert doctor_json["engines"][engine]["backend_registered"] is True, engine
    assert doctor_json["engines"]["vllm"]["version"] == "0.33.0"
    assert doctor_json["problems"] == []


def test_doctor_reports_platform_and_toolchain(doctor_json):
    assert doctor_json["tilelang"].startswith("0.1.")
    assert doctor_json["platform"]["device"] in ("cpu", "cuda", "musa")
    assert doctor_json["torch"].startswith("2.")
    assert doctor_json["cache_dir"]


def test_doctor_text_report_and_target_override():
    res = _run("doctor", env={"MUSA_ATTN_TARGET": "sm_90a"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert '"arch": "sm_90a"' in res.stdout and "fp8, bulk_copy, warpgroup_mma" in res.stdout
    assert "status: OK" in res.stdout


def test_doctor_fails_with_clear_message_on_bad_target():
    res = _run("doctor", env={"MUSA_ATTN_TARGET": "hopper"})
    assert res.returncode == 1
    assert "MUSA_ATTN_TARGET='hopper' is not understood" in res.stdout


def test_doctor_fails_when_a_required_engine_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(cli, "probe_engine", lambda e: {"installed": False})
    rc = cli.main(["doctor", "--require", "vllm"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "vllm is required (--require) but not installed" in out
    assert "neither SGLang nor vLLM is installed" in out


def test_doctor_fails_when_engine_does_not_see_entry_point(monkeypatch, capsys):
    monkeypatch.setattr(cli, "probe_engine", lambda e: {"installed": True, "version": "x", "entry_point": None})
    assert cli.main(["doctor"]) == 1
    assert "does not see the 'tilelang_musa' entry point" in capsys.readouterr().out


def test_doctor_rejects_unknown_engine(capsys):
    assert cli.main(["doctor", "--require", "trtllm"]) == 2


def test_demo_runs_and_checks_against_sdpa():
    res = _run("demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(" OK") == 2 and "views_identical=True" in res.stdout
    assert "all checks passed" in res.stdout
