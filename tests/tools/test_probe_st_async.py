"""The per-thread remote store issue 37's next design needs (``scripts/probe_st_async.py``): a device function in a
force-included header, called from a TileLang cluster kernel, builds for sm_90a through TileLang's own compile
(nvcc and ptxas accept ``mapa`` + ``st.async ... complete_tx``), and the kernel's source calls it with the stage
element's and the barrier's shared addresses. Its run on a GPU is ``--run`` (the device)."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (TileLang compiles the probe for sm_90a)")
def test_the_st_async_probe_builds_for_sm90a(capsys):
    import probe_st_async

    assert probe_st_async.main([]) == 0
    src = capsys.readouterr().out
    assert "musa_attn_st_async_v4((&(S[" in src and "(&(bar[0])))" in src
    assert "arrive_and_expect_tx(2048)" in src and src.count("tl::cluster_sync()") == 2
