"""scripts/deepgemm_suite.py on a CPU: DeepGEMM's grouped-GEMM test cases (shrunk) pass on our reference path by
DeepGEMM's rule, the case list is its generators', and a GEMM off by 10% fails the rule."""

import json

import pytest


@pytest.fixture(scope="module")
def suite(load_script):
    return load_script("deepgemm_suite")


def test_cases_are_deepgemms(suite):
    full = suite.cases({"contiguous", "masked"})
    assert len(full) == 4 * (2 + 4)
    assert {(c[3], c[4]) for c in full} == {(6144, 7168), (7168, 3072), (4096, 4096), (4096, 2048)}
    assert {(c[1], c[2]) for c in full if c[0] == "contiguous"} == {(4, 8192), (8, 4096)}
    assert {(c[1], c[2], c[5]) for c in full if c[0] == "masked"} == {(32, 192, 4096), (6, 1024, 4096),
                                                                      (32, 20, 4096), (6, 20, 4096)}


def test_shrunk_suite_passes_on_the_reference(suite, tmp_path):
    out = tmp_path / "dg.json"
    assert suite.main(["--device", "cpu", "--shrink", "16", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ran"] == doc["passed"] == 24 and doc["deep_gemm"] is None
    assert all(0 < c["calc_diff"] < 1e-3 for c in doc["cases"])
    # each contiguous group's real rows in 0.7-1.3x the expected m
    assert all(0.7 * c["expected_m"] - 1 <= m <= 1.3 * c["expected_m"] for c in doc["cases"] for m in c["ms"])


def test_a_gemm_ten_percent_off_fails(suite, monkeypatch):
    real = suite.moe.grouped_gemm_fp8
    monkeypatch.setattr(suite.moe, "grouped_gemm_fp8", lambda *a, **k: real(*a, **k) * 1.1)
    assert suite.main(["--device", "cpu", "--shrink", "16", "--kinds", "contiguous"]) == 1
