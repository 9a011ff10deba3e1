"""benchmarks/bench_vllm_dsv4.py --smoke on a CPU: the harness builds vLLM's packed block layout, runs the layer's
slot translation and sparse MQA (references) and writes the documented JSON."""


def test_smoke_writes_json(smoke_doc):
    doc = smoke_doc("bench_vllm_dsv4", "vllm-dsv4-smoke")
    assert {r["shape"]["compress_ratio"] for r in doc["rows"]} == {0, 4, 128}
    for r in doc["rows"]:
        assert "errors" not in r, r
        assert r["layer_ms"] > 0 and r["kernel_ms"] > 0 and r["peers"]["standalone_kernel"] == r["kernel_ms"]
