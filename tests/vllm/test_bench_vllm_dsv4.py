"""benchmarks/bench_vllm_dsv4.py --smoke on a CPU: the harness builds vLLM's packed block layout, runs the layer's
slot translation and sparse MQA (references) and writes the documented JSON."""

import json


def test_smoke_writes_json(tmp_path, load_bench):
    bench = load_bench("bench_vllm_dsv4")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("vllm-dsv4-smoke-*.json")
    doc = json.loads(path.read_text())
    for key in ("device", "commit", "date", "versions", "rows"):
        assert key in doc, key
    assert {r["shape"]["compress_ratio"] for r in doc["rows"]} == {0, 4, 128}
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert r["layer_ms"] > 0 and r["kernel_ms"] > 0 and r["peers"]["standalone_kernel"] == r["kernel_ms"]
