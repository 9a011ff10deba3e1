"""The README's generated blocks match what their sources give, and the README stays short."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import update_readme  # noqa: E402


def test_generated_blocks_are_current():
    text = (ROOT / "README.md").read_text()
    new, changed = update_readme.render(text)
    assert not changed, f"README blocks stale: {changed}; run python scripts/update_readme.py"
    assert new == text


def test_render_replaces_a_stale_block():
    begin = update_readme.BLOCKS["settings-table"][0]
    stale = f"intro\n{begin}\n| old |\n<!-- /settings-table -->\n"
    new, changed = update_readme.render(stale)
    assert "settings-table" in changed and "MUSA_ATTN_PDL" in new and "| old |" not in new
    assert any("perf-table" in c and "missing" in c for c in changed)


def test_every_switch_is_in_the_readme():
    from musa_attn_backend import config

    text = (ROOT / "README.md").read_text()
    assert all(f"`{s.env}`" in text for s in config.SWITCHES)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README has {lines} lines; keep it under ~250 (history goes to docs/)"


def test_dsv4_table_takes_the_newest_run_with_the_peer_and_the_default_program(tmp_path):
    """The V4 table reads the newest run that timed FlashMLA (a newer run without it is passed over), and our time
    is the scheduled program's where the run timed it beside the one it ran."""
    import json

    import perf_table

    row = {"op": "decode", "shape": {"config": "flash", "tokens": 32, "s_q": 1}, "ours_ms": 0.06,
           "scheduled_ms": 0.04, "peers": {"flashmla": 0.03}, "roofline_frac": 0.1}
    doc = {"device": "NVIDIA H100", "commit": "abcdef0", "date": "2026-12-06T00:00:00", "rows": [row]}
    (tmp_path / "dsv4-attention-20261206T000000Z.json").write_text(json.dumps(doc))
    newer = dict(doc, rows=[dict(row, peers={"flashmla": {"error": "absent"}}, scheduled_ms=0.5)])
    (tmp_path / "dsv4-attention-20261207T000000Z.json").write_text(json.dumps(newer))
    table = perf_table.dsv4_table(tmp_path)
    assert "dsv4-attention-20261206T000000Z.json" in table and "20261207" not in table
    line = next(x for x in table.splitlines() if x.startswith("| V4 sparse decode, Flash, batch 32 "))
    assert "| 40.0 µs | FlashMLA 30.0 µs | 0.75x | 15% |" in line, line


def test_dsv4_table_takes_each_line_from_the_newest_run_that_timed_it(tmp_path):
    """A quick run (fewer shapes) updates its lines and leaves the others as the last full run timed them; both
    runs are named, and a line no run timed is left out."""
    import json

    import perf_table

    def row(tokens, ours, peer):
        return {"op": "decode", "shape": {"config": "flash", "tokens": tokens, "s_q": 1}, "ours_ms": ours,
                "peers": {"flashmla": peer}, "roofline_frac": 0.1}

    full = {"device": "NVIDIA H100", "commit": "aaaaaaa", "date": "2026-12-06T00:00:00",
            "rows": [row(1, 0.04, 0.02), row(32, 0.05, 0.03)]}
    quick = dict(full, commit="bbbbbbb", rows=[row(1, 0.025, 0.02)])
    (tmp_path / "dsv4-attention-20261206T000000Z.json").write_text(json.dumps(full))
    (tmp_path / "dsv4-attention-20261207T000000Z.json").write_text(json.dumps(quick))
    table = perf_table.dsv4_table(tmp_path)
    lines = {x.split(" | ")[0][2:]: x for x in table.splitlines() if x.startswith("| V4")}
    assert "| 25.0 µs | FlashMLA 20.0 µs | 0.80x |" in lines["V4 sparse decode, Flash, batch 1"]
    assert "| 50.0 µs | FlashMLA 30.0 µs | 0.60x |" in lines["V4 sparse decode, Flash, batch 32"]
    assert set(lines) == {"V4 sparse decode, Flash, batch 1", "V4 sparse decode, Flash, batch 32"}
    assert "20261207T000000Z" in table and "20261206T000000Z" in table


def test_dsv4_table_shows_the_kernel_on_flashmlas_prefill_inputs(tmp_path):
    """A prefill row that timed our program on FlashMLA's own bf16 rows gives that line beside the scheduled
    program's (the same FlashMLA time, the same roofline); a row without the key leaves the line out."""
    import json

    import perf_table

    row = {"op": "prefill", "shape": {"config": "flash", "tokens": 4096}, "ours_ms": 1.4, "scheduled_ms": 1.4,
           "paired_ws_on_flashmla_inputs_ms": 1.2, "peers": {"flashmla": 0.75}, "roofline_frac": 0.5}
    pro = {"op": "prefill", "shape": {"config": "pro", "tokens": 4096}, "ours_ms": 4.0, "peers": {"flashmla": 2.2},
           "roofline_frac": 0.5}
    doc = {"device": "NVIDIA H100", "commit": "abcdef0", "date": "2026-12-07T00:00:00", "rows": [row, pro]}
    (tmp_path / "dsv4-attention-20261207T000000Z.json").write_text(json.dumps(doc))
    lines = {x.split(" | ")[0][2:]: x for x in perf_table.dsv4_table(tmp_path).splitlines() if x.startswith("| V4")}
    assert "| 1.400 ms | FlashMLA 0.750 ms | 0.54x | 50% |" in lines["V4 sparse prefill, Flash, 4k tokens"]
    assert "| 1.200 ms | FlashMLA 0.750 ms | 0.62x | 58% |" in lines["V4 prefill on FlashMLA's bf16 rows, Flash, 4k"]
    assert "V4 prefill on FlashMLA's bf16 rows, Pro, 4k" not in lines
    # a ws_variants.py run (kernels alone from graphs) replaces that line in place and adds the MUSA form's, with
    # the attention bench's roofline of the shape
    ws = {"op": "prefill", "shape": {"config": "flash", "tokens": 4096}, "flashmla_graph_ms": 0.9,
          "default_variant": "a+b", "first_variant": "a", "a_kernel_ms": 2.0, "a+b_kernel_ms": 1.0,
          "portable_ws_musa_kernel_ms": 1.8}
    doc = dict(doc, commit="1234567", rows=[ws])
    (tmp_path / "ws-variants-20261207T000000Z.json").write_text(json.dumps(doc))
    table = perf_table.dsv4_table(tmp_path).splitlines()
    v4 = [x.split(" | ")[0][2:] for x in table if x.startswith("| V4")]
    lines = {x.split(" | ")[0][2:]: x for x in table if x.startswith("| V4")}
    assert "| 1.000 ms | FlashMLA 0.900 ms | 0.90x | 70% |" in lines["V4 prefill on FlashMLA's bf16 rows, Flash, 4k"]
    assert "| 1.800 ms | FlashMLA 0.900 ms | 0.50x | 39% |" in lines["V4 prefill, MUSA's form, Flash, 4k"]
    assert v4.index("V4 prefill, MUSA's form, Flash, 4k") == v4.index(
        "V4 prefill on FlashMLA's bf16 rows, Flash, 4k") + 1
