"""benchmarks/bench_moe.py --smoke on a CPU: the harness routes, lays out, runs both layouts (references) and
writes the documented JSON."""

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"


def test_smoke_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe-smoke-*.json")
    doc = json.loads(path.read_text())
    for key in ("device", "commit", "date", "versions", "rows"):
        assert key in doc, key
    assert {r["op"] for r in doc["rows"]} == {"moe_gate_up", "moe_down"}
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert "ours_ms" in r and "ours_masked_ms" in r and r["shape"]["rows"] == r["shape"]["T"] * 6
        assert r["shape"]["layout_rows"] % 128 == 0 and r["flops"] > 0
