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
