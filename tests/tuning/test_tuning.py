"""The tuning table (``musa-attn tune`` writes it, ``prefill_config`` reads it) and the tuner's search."""

import json
import multiprocessing
from dataclasses import asdict

import pytest

from musa_attn_backend import tuning
from musa_attn_backend.cli import main as cli_main
from musa_attn_backend.platform import get_platform


@pytest.fixture()
def cache(tmp_path, use_settings):
    use_settings(cache_dir=tmp_path)
    tuning._loaded.clear()
    yield tmp_path
    tuning._loaded.clear()


def test_record_then_lookup_roundtrip(cache):
    key = tuning.shape_key(d=128, dv=128, pages="p128")
    assert tuning.lookup("prefill", key) is None
    path = tuning.record("prefill", key, {"block_N": 64}, 1.25, details={"seqlen": 8192})
    assert path.parent == cache / "tuning" and "tilelang" in path.name
    assert tuning.lookup("prefill", key) == {"block_N": 64}
    assert tuning.lookup("decode", key) is None
    entry = json.loads(path.read_text())["entries"]["prefill"][key]
    assert entry["ms"] == 1.25 and entry["seqlen"] == 8192
    # a second record for the same key replaces the choice
    tuning.record("prefill", key, {"block_N": 128}, 1.0)
    assert tuning.lookup("prefill", key) == {"block_N": 128}


def test_tables_are_per_device_and_tilelang_version(cache):
    p = get_platform()
    assert tuning.table_path(p, "0.1.12") != tuning.table_path(p, "0.1.15")


def test_unreadable_table_means_defaults(cache):
    path = tuning.table_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning.lookup("prefill", "anything") is None


def _writer(args):
    cache_dir, worker = args
    import os

    os.environ["MUSA_ATTN_CACHE_DIR"] = cache_dir  # a fresh process: read on its first use of the settings
    from musa_attn_backend import tuning as t

    for i in range(15):
        t.record("prefill", f"w{worker}-k{i}", {"i": i}, float(i))


def test_concurrent_writers_lose_nothing(cache):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        pool.map(_writer, [(str(cache), w) for w in range(4)])
    entries = tuning.load(refresh=True)["prefill"]
    assert len(entries) == 60 and entries["w3-k14"]["config"] == {"i": 14}


def test_prefill_config_follows_a_valid_entry_and_ignores_others(cache, use_settings):
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(target="sm_90a")  # a platform with TMA, so both load paths are candidates
    default = ti.prefill_config(128, 128, page_size=128)
    assert default.tma and default.block_N == 128
    key = ti.prefill_shape_class(128, 128, False, 128, False)
    gathered = ti.PrefillConfig(block_M=128, block_N=64, num_stages=1, threads=256, tma=False)
    assert gathered in ti.prefill_candidates(128, 128, page_size=128)
    tuning.record("prefill", key, asdict(gathered), 1.0)
    assert ti.prefill_config(128, 128, page_size=128) == gathered
    # an entry that is not valid for this shape class (TMA tiles on 1-token pages), or from another format
    key1 = ti.prefill_shape_class(128, 128, False, 1, False)
    tuning.record("prefill", key1, asdict(default), 1.0)
    assert not ti.prefill_config(128, 128, page_size=1).tma
    tuning.record("prefill", key, {"block_N": 64, "unknown_knob": 3}, 1.0)
    assert ti.prefill_config(128, 128, page_size=128) == default
    # windows and FP8 caches never get TMA candidates
    assert not any(c.tma for c in ti.prefill_candidates(128, 128, page_size=128, has_window=True))
    assert all(c.num_stages == 1 and not c.tma for c in ti.prefill_candidates(128, 128, True, 128))


def test_prefill_defaults_per_platform(cache, use_settings):
    """Hopper (sm_90a): the ping-pong kernel wherever pages hold whole key tiles and the head dim is 64/128;
    MUSA MP31: TMA tiles without it (its warp-specialisation lowering is unverified); row gathers otherwise."""
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(target="sm_90a")
    # three K/V stages where they fit the SM's 228 KB and were measured faster (hd 128, 128-key tiles: 224 KB);
    # two stay a candidate there, and elsewhere the default with three as a candidate
    assert ti.prefill_config(128, 128, page_size=128) == ti.PrefillConfig(128, 128, 3, 384, True, True)
    assert ti.PrefillConfig(128, 128, 2, 384, True, True) in ti.prefill_candidates(128, 128, page_size=128)
    assert ti.PrefillConfig(128, 64, 2, 384, True, True) in ti.prefill_candidates(64, 64, page_size=64)
    assert ti.PrefillConfig(128, 64, 3, 384, True, True) in ti.prefill_candidates(64, 64, page_size=64)
    assert ti.pingpong_smem_fits(128, 128, 128, 3, 228 * 1024)
    assert not ti.pingpong_smem_fits(128, 128, 128, 3, 225 * 1024)  # 1 KB short of 224 + 2: two stages
    assert not ti.pingpong_smem_fits(128, 128, 128, 2, 0)  # unknown shared memory: no extra stage
    assert ti.prefill_config(128, 128, page_size=256).pingpong
    for kw in (dict(page_size=128, has_window=True), dict(page_size=128, is_fp8=True)):
        assert not any(c.pingpong for c in ti.prefill_candidates(128, 128, **kw)), kw
    assert not any(c.pingpong for c in ti.prefill_candidates(256, 256, page_size=128))
    assert not any(c.pingpong for c in ti.prefill_candidates(96, 96, page_size=128))
    # pages that hold no whole key tile: the ping-pong kernel with a gathering producer (default)
    for ps in (1, 16, 32):
        assert ti.prefill_config(128, 128, page_size=ps) == ti.PrefillConfig(128, 128, 2, 384, False, True)
    assert ti.prefill_config(128, 128, page_size=128) == ti.PrefillConfig(128, 128, 3, 384, True, True)
    assert not any(c.pingpong for c in ti.prefill_candidates(128, 128, page_size=16, has_window=True))
    # pages of a multiple of 16 that hold no whole key tile: 128-key TMA tiles copied in page chunks. 64-row
    # chunks are the default (first); 16/32-row chunks (measured slower) tuning candidates, last
    # (3 stages first at hd 128, where they were measured faster; 2 first elsewhere)
    for ps, rows in ((16, 16), (32, 32), (48, 16), (64, 64), (192, 64)):
        cands = ti.prefill_candidates(128, 128, page_size=ps)
        chunked = ti.PrefillConfig(128, 128, 3, 384, True, True, rows)
        assert chunked in cands and ti.PrefillConfig(128, 128, 2, 384, True, True, rows) in cands, ps
        assert (cands[0] == chunked) == (rows == 64) and (cands[-1].tma_rows == rows) == (rows != 64), ps
        assert ti.prefill_config(128, 128, page_size=ps) == (
            chunked if rows == 64 else ti.PrefillConfig(128, 128, 2, 384, False, True)), ps
    assert ti.prefill_config(64, 64, page_size=64) == ti.PrefillConfig(128, 128, 2, 384, True, True, 64)
    assert ti.PrefillConfig(128, 128, 3, 384, True, True, 64) in ti.prefill_candidates(64, 64, page_size=64)
    assert not any(c.tma_rows for c in ti.prefill_candidates(128, 128, page_size=8))
    assert not any(c.tma_rows for c in ti.prefill_candidates(128, 128, page_size=256))
    assert not any(c.tma_rows for c in ti.prefill_candidates(256, 256, page_size=64))  # no ping-pong at hd 256
    use_settings(tma_chunks=False)  # MUSA_ATTN_TMA_CHUNKS=0 takes them out: 64-key whole-page tiles at page 64
    assert not any(c.tma_rows for c in ti.prefill_candidates(128, 128, page_size=64))
    assert ti.prefill_config(128, 128, page_size=64) == ti.PrefillConfig(128, 64, 2, 384, True, True)
    use_settings(tma_chunks=True)
    # MUSA_ATTN_PINGPONG_GATHER=0 takes it out: the row-gather kernel again
    use_settings(pingpong_gather=False)
    assert not any(c.pingpong and not c.tma for c in ti.prefill_candidates(128, 128, page_size=16))
    assert ti.prefill_config(128, 128, page_size=1) == ti.PrefillConfig(128, 128, 2, 256, False)
    assert ti.prefill_config(128, 128, page_size=16) == ti.PrefillConfig(128, 128, 2, 256, False)
    use_settings(pingpong_gather=True, target="mp_31")
    musa = ti.prefill_config(128, 128, page_size=128)
    assert musa.tma and not musa.pingpong
    use_settings(target="sm_80")
    assert not ti.prefill_config(128, 128, page_size=128).tma


def test_search_takes_the_fastest_correct_candidate():
    times = {"a": 3.0, "b": 1.0, "c": 0.5, "d": 2.0}

    def check(cfg):
        if cfg["n"] == "c":
            return "max relative error 0.4"
        if cfg["n"] == "d":
            raise RuntimeError("does not compile")
        return None

    best, ms, rows = tuning.search([{"n": n} for n in times], check, lambda c: times[c["n"]], log=lambda s: None)
    assert best == {"n": "b"} and ms == 1.0
    assert "wrong result" in rows[2]["error"] and "does not compile" in rows[3]["error"]
    assert "ms" not in rows[2]  # a wrong candidate is never timed


def test_tune_needs_a_gpu(capsys):
    if get_platform().has_gpu:
        pytest.skip("this machine has a GPU")
    assert cli_main(["tune", "--heads", "32", "--kv-heads", "8", "--head-dim", "128"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_prefill_on_gpu(gpu_device, cache):
    """Every candidate is correct on the GPU, the fastest is recorded and then chosen by prefill_config."""
    from musa_attn_backend.kernels.attention import tilelang_impl as ti
    from musa_attn_backend.tune_attention import tune_prefill

    res = tune_prefill(8, 2, 128, page_size=128, seqlen=2048, log=lambda s: None)
    assert res["best"] is not None and res["table"]
    assert not [r for r in res["rows"] if "error" in r], res["rows"]
    tuning._loaded.clear()
    assert asdict(ti.prefill_config(128, 128, page_size=128)) == res["best"]
