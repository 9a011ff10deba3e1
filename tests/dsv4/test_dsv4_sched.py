"""The scheduled sparse MQA program on the CPU: its plan (every key tile visited once, by the part the docstring
says, pieces and partial rows consistent, the combine list complete) on random and degenerate batches, the
conversion of e4m3 bytes to bf16 by bit moves (bit for bit against torch's e4m3 over every byte and every scale
exponent), the launch glue against the programs' signatures, the program choice, FlashMLA's scheduler-metadata
contract, and real sm_90a builds with nvcc (the warp groups' register split, the GEMM forms, shared memory)."""

import random

import pytest
import torch

from musa_attn_backend import _tilelang, config
from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4.sparse import flash_mla
from musa_attn_backend.kernels.dsv4.sparse import schedule
from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
from musa_attn_backend.kernels.dsv4.sparse.sched_kernel import TWO_POW_120, nope_bytes_to_bf16
from musa_attn_backend.testing.toolchain import HOPPER, in_ci, nvcc_path

from test_dsv4_build import SignatureCheck, _batch


def _tiles(T, K1, l1, K2, l2):
    n = (l1.clamp(0, K1) + 63) // 64 if l1 is not None else torch.full((T,), (K1 + 63) // 64)
    if K2:
        n = n + ((l2.clamp(0, K2) + 63) // 64 if l2 is not None else (K2 + 63) // 64)
    return n.clamp_min(1)


def check_plan(plan, T, n):
    """Every tile ``(t, j)`` visited by exactly one part, in the part the line cut puts it; pieces contiguous;
    partial rows distinct and within the buffers; the combine list exactly the split tokens, in order, and its
    length counted."""
    assert plan.tiles.tolist() == n.tolist()
    owner = {}
    for p, pieces in enumerate(schedule.visits(plan)):
        for t, a, b in pieces:
            assert 0 <= a < b <= n[t], (p, t, a, b)
            for j in range(a, b):
                assert (t, j) not in owner
                owner[(t, j)] = p
    assert len(owner) == int(n.sum())
    first, split_row, comb = plan.first_part.tolist(), plan.split_row.tolist(), plan.combine.tolist()
    rows, listed = set(), []
    for t in range(T):
        parts = sorted({owner[(t, j)] for j in range(int(n[t]))})
        assert parts == list(range(parts[0], parts[-1] + 1)) and parts[0] == first[t]
        if len(parts) == 1:
            assert split_row[t] == -1
            continue
        listed.append([t, len(parts)])
        for p in parts:
            r = split_row[t] + p - first[t]
            assert 0 <= r < plan.num_partials and r not in rows
            rows.add(r)
    assert comb[:len(listed)] == listed and all(c[0] == -1 for c in comb[len(listed):])
    assert plan.num_split.tolist() == [len(listed)] and plan.num_split.dtype == torch.int32  # the merge walks these
    assert len(listed) <= plan.parts - 1 or plan.parts == 1 and not listed


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("slack", [0, schedule.OVERHEAD_TILES])
def test_plan_visits_every_tile_once(monkeypatch, seed, slack):
    monkeypatch.setattr(schedule, "PLAN_SLACK", slack)  # parts' spans longer than an even cut: the last ones idle
    rng = random.Random(seed)
    T = rng.choice([1, 2, 3, 4, 7, 31, 64, 128, 300])
    K1 = rng.choice([0, 1, 64, 100, 128, 640])
    K2 = rng.choice([0, 64, 70, 512, 2048])
    parts = rng.choice([1, 2, 3, 5, 66, 132])
    g = torch.Generator().manual_seed(seed)
    l1 = torch.randint(-3, K1 + 5, (T,), generator=g, dtype=torch.int32) if rng.random() < 0.7 else None
    l2 = torch.randint(-3, K2 + 5, (T,), generator=g) if K2 and rng.random() < 0.7 else None
    plan = schedule.plan_sparse_mqa(T, K1, l1, K2, l2, parts=parts)
    check_plan(plan, T, _tiles(T, K1, l1, K2, l2))


@pytest.mark.parametrize("T,lengths,parts", [
    (1, [0], 132),  # no valid entry: still one tile (the output and LSE are written)
    (1, [2048], 132),  # decode B 1: the token's 32 tiles over 32 parts, the rest idle
    (4, [640] * 4, 132),
    (128, [640] * 128, 132),  # decode B 128: about one token a part
    (300, None, 1),  # one part does everything
])
def test_plan_of_typical_batches(T, lengths, parts):
    l1 = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    plan = schedule.plan_sparse_mqa(T, 2048, l1, parts=parts)
    n = _tiles(T, 2048, l1, 0, None)
    check_plan(plan, T, n)
    visits = schedule.visits(plan)
    busy = sum(1 for pieces in visits if pieces)
    per = -(-(int(n.sum()) + schedule.OVERHEAD_TILES * T) // parts)  # places a part
    assert max(sum(b - a for _, a, b in pieces) for pieces in visits) <= per
    if T == 1 and lengths == [2048]:
        assert busy == 32 and plan.combine[0].tolist() == [0, 32]
    if T == 128:  # 15 places a token, 15 a part (1920 over 132 parts): one whole token a part, none split
        assert busy == 128 and max(len(pieces) for pieces in visits) == 1 and (plan.split_row == -1).all()


def test_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        schedule.plan_sparse_mqa(-1, 64, parts=4)
    with pytest.raises(ValueError, match="lengths must be an integer tensor of 3 entries"):
        schedule.plan_sparse_mqa(3, 64, torch.zeros(2, dtype=torch.int32), parts=4)
    with pytest.raises(ValueError, match="extra_lengths without an extra set"):
        schedule.plan_sparse_mqa(3, 64, None, 0, torch.zeros(3, dtype=torch.int32), parts=4)
    plan = schedule.plan_sparse_mqa(3, 64, parts=4)
    with pytest.raises(ValueError, match="the plan was made for 3 tokens and index lists of 64 \\+ 0 entries"):
        plan.check_matches("op", 3, 128, 0, "cpu")


def _byte_perm(x, y, sel):
    """A model of CUDA's ``__byte_perm``: result byte ``i`` is byte ``sel >> 4i & 7`` of ``y:x``."""
    b = [(x >> (8 * i)) & 255 for i in range(4)] + [(y >> (8 * i)) & 255 for i in range(4)]
    return sum(b[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def test_e4m3_bytes_become_bf16_by_bit_moves_bit_for_bit():
    """The producer's conversion (the selectors of the program's own function, run on a model of the byte
    permute), then ``x 2^120`` and ``x 2^(e - 127)`` in bf16, equals torch's e4m3 value times ``2^(e - 127)``
    rounded to bf16, bit for bit, over every byte and scale exponent (-0.0 included); NaN bytes (no writer makes
    them) decode to 480 times the scale."""
    words = []
    for i in range(0, 256, 4):
        w = i | (i + 1) << 8 | (i + 2) << 16 | (i + 3) << 24
        lo, hi = nope_bytes_to_bf16(w, _byte_perm)
        words += [lo & 0xFFFFFFFF, hi & 0xFFFFFFFF]
    got = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.bfloat16)
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    nan = torch.isnan(e4m3)
    assert torch.equal(got.float()[~nan], e4m3[~nan] * 2.0 ** -120)
    two120 = torch.tensor([TWO_POW_120], dtype=torch.int16).view(torch.bfloat16)
    for e in range(255):
        fac = torch.tensor([0x40 if e == 0 else e * 128], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        scaled = (got * two120) * fac
        want = (e4m3 * 2.0 ** (e - 127)).to(torch.bfloat16)
        assert torch.equal(scaled[~nan].view(torch.int16), want[~nan].view(torch.int16)), e
    assert torch.equal(((got * two120)[nan]).float().abs(), torch.full((2,), 480.0))


@pytest.mark.parametrize("T", [2, 400])
def test_scheduled_launch_glue_matches_the_programs(use_settings, T):
    """Both launches (the program and its combine) get arguments matching their parameters, with a plan made
    per call or passed in, and the shapes a plan was made for are enforced."""
    use_settings(target="sm_90a", dsv4_program="scheduled")
    kernels = {}

    def capture(key, build, target, pass_configs):
        return kernels.setdefault(key[0], SignatureCheck(build()))

    q, cache, idx, extra, xidx = _batch(T)
    lens = torch.full((T,), 100, dtype=torch.int32)
    with _tilelang.intercepting(capture):
        out, lse = ti.sparse_mqa_tilelang(q, cache, idx, lens, extra_cache=extra, extra_indices=xidx,
                                          sink=torch.zeros(64), return_lse=True)
        plan = dsv4.sparse_mqa_plan(q, idx, lens, xidx, None)
        ti.sparse_mqa_tilelang(q, cache, idx, lens, extra_cache=extra, extra_indices=xidx, plan=plan)
        with pytest.raises(ValueError, match="the plan was made for"):
            ti.sparse_mqa_tilelang(q, cache, idx[:, :64].contiguous(), lens, extra_cache=extra, extra_indices=xidx,
                                   plan=plan)
    assert out.shape == q.shape and lse.shape == (T, 64)
    assert set(kernels) == {"dsv4_sparse_mqa_sched", "dsv4_sparse_combine"}
    assert all(len(k.calls) == 2 for k in kernels.values())
    assert plan.parts == schedule.default_parts(64, 132) and plan.num_partials == 2 * (plan.parts - 1)


def test_program_choice_follows_the_setting_and_refuses_what_the_target_cannot_run(use_settings):
    use_settings(target="sm_90a")
    assert ti.sparse_mqa_program() == "scheduled"  # auto
    use_settings(dsv4_program="paired")
    assert ti.sparse_mqa_program() == "paired"
    use_settings(target="mp_31", dsv4_program="scheduled")
    with pytest.raises(ValueError, match="the scheduled program needs warp specialisation"):
        ti.sparse_mqa_kernel(64, True, True, False, "bfloat16")
    use_settings(dsv4_program="auto")
    assert ti.sparse_mqa_program() == "portable"


def test_flash_mla_sched_meta_keeps_one_plan_per_batch():
    """FlashMLA's contract: the first call records its shapes and makes the plan, later ones reuse it and a call
    of other shapes is refused."""
    meta, _ = dsv4.get_mla_metadata()
    made = []

    def make():
        made.append(object())
        return schedule.plan_sparse_mqa(2, 64, parts=4)

    a = flash_mla._sched_plan(meta, "op", (2, 1, 64, 64, 0), make)
    b = flash_mla._sched_plan(meta, "op", (2, 1, 64, 64, 0), make)
    assert a is b and len(made) == 1 and meta.have_initialized
    with pytest.raises(ValueError, match="tile_scheduler_metadata was made for"):
        flash_mla._sched_plan(meta, "op", (3, 1, 64, 64, 0), make)
    assert flash_mla._sched_plan(None, "op", (3, 1, 64, 64, 0), make) is not a


NVCC = nvcc_path()


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("H,extra", [(64, True), (128, True), (8, False)])
def test_scheduled_program_compiles_for_sm90a(use_settings, H, extra):
    """The three warp groups and their register split, Q K^T as two GEMMs from shared memory, O's halves with P
    from registers (group 0) and from shared memory (group 1), the byte permutes of the conversion, the query rows
    by predicated cp.async; the combine builds."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    use_settings(dsv4_program="scheduled")
    src = ti.sched_kernel(H, extra, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert "warpgroup_reg_alloc<192>" in src and "warpgroup_reg_dealloc<160>" in src
    assert "warpgroup_reg_dealloc<152>" in src
    assert src.count("tl::wgmma_ss<") == 3 and src.count("tl::wgmma_rs<") == 1
    assert "__byte_perm" in src and "cp_async_gs_conditional<16>" in src
    assert "__syncthreads" not in src.split("warpgroup_reg_alloc")[1]  # no block-wide barrier in a group's code
    comb = ti.sched_combine_kernel(H, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert "__global__" in comb



@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
def test_scheduled_program_variants_build_for_sm90a(use_settings, monkeypatch, tmp_path):
    """SCHED_PDL='end': one thread of the scores group triggers the combine's launch once its part's last token's
    tiles are done (before that token's epilogue), none at the start; every block of the combine, launched as the
    dependent, waits for the program's grid before it reads anything (so the merge never completes before the
    program). SCHED_LOAD_HINT: every cache-row load through the hinted device function (an L1 evict-last and a
    256-byte L2 prefetch), the slot split by an unsigned division, no more spill than the default build.
    SCHED_PREFETCH (with the hints): the next tile's rows asked of L2 once their indices are read. Off, the program
    is the default's: no trigger, plain loads."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from test_dsv4_build import _ptxas_spills

    from musa_attn_backend.kernels.dsv4.sparse.rows import LOAD_HINT_HEADER

    use_settings(dsv4_program="scheduled", pdl=True)
    base = ti.sched_kernel(64, True, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert "TriggerProgrammatic" not in base and "musa_attn_ld16_hint" not in base
    monkeypatch.setattr(ti, "SCHED_PDL", "end")
    src = ti.sched_kernel(64, True, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert src.count("cudaTriggerProgrammaticLaunchCompletion()") == 1
    scores = src.split("warpgroup_reg_alloc<192>")[1].split("warpgroup_reg_dealloc<160>")[0]
    trigger = scores.index("cudaTriggerProgrammaticLaunchCompletion()")
    assert scores.rindex("tl::wait_wgmma<0>()", 0, trigger) and "split_row[" in scores[trigger:]
    comb = ti.sched_combine_kernel(64, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert comb.count("cudaGridDependencySynchronize()") == 1
    head = comb.split("cudaGridDependencySynchronize()")[0].split("sparse_combine_kernel(")[-1]
    assert "num_split[" not in head and "L_part[" not in head and "return" not in head  # every block waits first
    monkeypatch.setattr(ti, "SCHED_PDL", "")
    monkeypatch.setattr(ti, "SCHED_LOAD_HINT", True)
    hinted = ti.sched_kernel(64, True, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert hinted.count("musa_attn_ld16_hint(") == 2  # the main and the extra cache's unrolled loads
    assert "(uint)idx" in hinted and "TriggerProgrammatic" not in hinted
    spills, regs = _ptxas_spills(hinted, tmp_path, headers=(LOAD_HINT_HEADER,))
    base_spills, _ = _ptxas_spills(base, tmp_path)
    assert regs == 168 and spills <= base_spills, (spills, base_spills)
    monkeypatch.setattr(ti, "SCHED_PREFETCH", True)
    fetching = ti.sched_kernel(64, True, True, "bfloat16", target=HOPPER).get_kernel_source()
    # each of the next tile's rows (the same token's next tile, or the next piece's first; main or extra cache):
    # its data row and its scale line
    assert fetching.count("musa_attn_prefetch_l2(") == 8 and fetching.count(", 576);") == 4
    spills, regs = _ptxas_spills(fetching, tmp_path, headers=(LOAD_HINT_HEADER,))
    assert regs == 168 and spills <= base_spills + 8, (spills, base_spills)
@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("H", [128, 96])
def test_clustered_scheduled_program_builds_for_sm90a(use_settings, monkeypatch, tmp_path, H):
    """The 65-128-head form whose two head blocks run as a cluster: launched in clusters of two, both blocks'
    consumers releasing each stage on both blocks' barrier, each producer making its half of a tile's rows (one
    row a thread) and storing every 16 bytes of it into both blocks' stage (five st.async stores per row and lane,
    one for its flag), the local half's arrival carrying the peer's bytes; the same register split, (almost) no
    spill."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from test_dsv4_build import _ptxas_spills

    from musa_attn_backend.kernels.dsv4.sparse.rows import CLUSTER_STORE_HEADER
    from musa_attn_backend.kernels.dsv4.sparse.sched_kernel import PEER_BYTES

    use_settings(dsv4_program="scheduled")
    monkeypatch.setattr(ti, "SCHED_CLUSTER", True)
    kernel = ti.sched_kernel(H, True, True, "bfloat16", target=HOPPER)  # through the launcher: the header included
    src = kernel.get_kernel_source()
    assert src.count("musa_attn_st_async_v4(") == 5 and src.count("musa_attn_st_async_b32(") == 1
    assert f"arrive_and_expect_tx({PEER_BYTES})" in src and PEER_BYTES == 32 * 1024 + 32 * 4
    assert "cluster_sync" in src and src.count("tl::wgmma_ss<") == 3
    assert "warpgroup_reg_alloc<192>" in src and "warpgroup_reg_dealloc<152>" in src
    spills, regs = _ptxas_spills(src, tmp_path, headers=(CLUSTER_STORE_HEADER,))
    assert regs == 168 and spills <= 16, (regs, spills)  # one row of bytes a producer thread (the unclustered
    # program holds two and spills 28-144 bytes at 64-128 heads)
    assert ti._sched_cluster(64, HOPPER) is False and ti._sched_cluster(129, HOPPER) is False
    # by the call's query tokens: the clustered form from SCHED_CLUSTER_MIN_TOKENS on (faster there on the H200)
    assert ti._sched_cluster(H, HOPPER, ti.SCHED_CLUSTER_MIN_TOKENS) is True
    assert ti._sched_cluster(H, HOPPER, ti.SCHED_CLUSTER_MIN_TOKENS - 1) is False
    monkeypatch.setattr(ti, "SCHED_CLUSTER", False)
    plain = ti.sched_kernel(H, True, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert "musa_attn_st_async" not in plain and "cluster" not in plain


def test_scheduled_program_fits_hopper_shared_memory():
    """The query block, two 64-row stages, P and the small arrays: within sm_90's 227 KB."""
    from musa_attn_backend.kernels.dsv4.sparse.sched_kernel import build_sparse_mqa_sched

    lowered = _tilelang.lower(build_sparse_mqa_sched(128, True, True), HOPPER, ti._ws_pass_configs())
    assert 190 * 1024 < lowered.shared_bytes <= 227 * 1024


def test_plans_without_lengths_are_kept_per_shape(use_settings):
    """A call without lengths (vLLM's layer) plans once per shape; lengths make a plan per call (their values are
    the batch's, read on the device)."""
    use_settings(target="sm_90a")
    q, cache, idx, extra, xidx = _batch(5)
    a = ti.sparse_mqa_plan(q, idx, None, xidx, None)
    assert ti.sparse_mqa_plan(q, idx, None, xidx, None) is a
    assert ti.sparse_mqa_plan(q, idx[:, :64], None, xidx, None) is not a
    lens = torch.full((5,), 7, dtype=torch.int32)
    assert ti.sparse_mqa_plan(q, idx, lens, xidx, None) is not ti.sparse_mqa_plan(q, idx, lens, xidx, None)
    use_settings(target="sm_90a", poison=True)  # a settings change empties the kept plans
    assert ti.sparse_mqa_plan(q, idx, None, xidx, None) is not a


def test_flash_mla_checks_once_per_batch_signature_and_every_cache():
    """The first call with a metadata object runs every argument check; later calls with the same shapes, dtypes and
    devices skip them, but each call's caches are checked (a bad cache on a later layer is refused) and a call of
    other shapes is checked again."""
    from musa_attn_backend.kernels.dsv4 import layout as L

    cache = L.new_kv_cache(3, 64, "cpu")
    dsv4.write_kv_v4(torch.randn(150, 512).to(torch.bfloat16), cache, torch.arange(150), impl="reference")
    q = torch.randn(2, 1, 8, 512).to(torch.bfloat16)
    idx = torch.randint(0, 150, (2, 1, 64), dtype=torch.int32)
    meta = dsv4.get_mla_metadata()[0]
    out, lse = dsv4.flash_mla_with_kvcache(q, cache.view(3, 64, 1, 584), indices=idx, tile_scheduler_metadata=meta)
    assert meta.checked is not None and out.shape == q.shape and lse.shape == (2, 8, 1)
    again, _ = dsv4.flash_mla_with_kvcache(q, cache.view(3, 64, 1, 584), indices=idx, tile_scheduler_metadata=meta)
    assert torch.equal(again, out)
    bad = torch.zeros(3, 64, 1, 580, dtype=torch.uint8)  # rows of 580 bytes
    with pytest.raises(ValueError, match="cache must be"):
        dsv4.flash_mla_with_kvcache(q, bad, indices=idx, tile_scheduler_metadata=meta)
    with pytest.raises(ValueError, match="q must be"):
        dsv4.flash_mla_with_kvcache(q[..., :256], cache.view(3, 64, 1, 584), indices=idx,
                                    tile_scheduler_metadata=meta)


def test_a_plan_a_graph_captured_is_never_evicted(monkeypatch):
    """Plans of calls without lengths are kept per shape, the least recently used dropped; one used while a graph
    was being captured is kept for good (the graph reads its tensors at every replay, so freeing it would let the
    allocator hand its memory to something else)."""
    from musa_attn_backend.platform import stream_capturing

    assert stream_capturing(torch.device("cpu")) is False
    monkeypatch.setattr(ti, "_SHAPE_PLANS_KEPT", 3)
    monkeypatch.setattr(ti, "_SHAPE_PLANS", {})
    monkeypatch.setattr(ti, "_CAPTURED_PLANS", {})
    q = lambda T: torch.randn(T, 64, 512).to(torch.bfloat16)  # noqa: E731
    idx = lambda T: torch.zeros(T, 128, dtype=torch.int32)  # noqa: E731
    eager_first = ti.sparse_mqa_plan(q(5), idx(5))
    monkeypatch.setattr(ti, "stream_capturing", lambda device: True)
    captured = ti.sparse_mqa_plan(q(5), idx(5))  # the eager plan of the shape, now pinned
    captured_new = ti.sparse_mqa_plan(q(6), idx(6))
    assert captured is eager_first and set(ti._CAPTURED_PLANS.values()) == {captured, captured_new}
    monkeypatch.setattr(ti, "stream_capturing", lambda device: False)
    for T in range(7, 17):  # eager shapes enough to evict everything unpinned
        ti.sparse_mqa_plan(q(T), idx(T))
    assert len(ti._SHAPE_PLANS) == 3
    assert ti.sparse_mqa_plan(q(5), idx(5)) is captured and ti.sparse_mqa_plan(q(6), idx(6)) is captured_new
    assert ti.sparse_mqa_plan(q(7), idx(7)) is not ti.sparse_mqa_plan(q(8), idx(8))


def test_cache_views_are_made_once_per_buffer_geometry_and_dropped_with_the_buffer():
    """Engines pass fresh views of persistent caches on every call (FlashMLA's entry: ``unsqueeze``, a dtype view):
    the scheduled program's word views are memoised by the buffer that owns the memory and the view's geometry,
    hold no reference to that buffer, and go when it goes."""
    import gc

    pool = torch.zeros(2, 4, 256 * 584, dtype=torch.uint8)  # an engine pool: two layers of four pages
    layer = [pool[i].view(4, 256, 584) for i in range(2)]
    first = ti._cache_word_views(layer[0].unsqueeze(2), "cpu", "t", "cache")
    assert ti._cache_word_views(pool[0].view(4, 256, 584).unsqueeze(2), "cpu", "t", "cache") is first
    second = ti._cache_word_views(layer[1].unsqueeze(2), "cpu", "t", "cache")
    assert second is not first and second[0][0].data_ptr() == pool[1].data_ptr()
    assert first[1] == (256, 584 * 256 // 16, 1024)  # rows, page stride in 16-byte units, slots
    assert len(ti._WORD_VIEWS[id(pool)][1]) == 2
    key = id(pool)
    del pool, layer
    gc.collect()
    assert key not in ti._WORD_VIEWS  # the views referenced the storage only: the pool's death dropped them


def test_full_lengths_are_kept_on_the_plan_outside_graph_capture(monkeypatch):
    q = torch.randn(3, 64, 512).to(torch.bfloat16)
    idx = torch.zeros(3, 128, dtype=torch.int32)
    plan = ti.sparse_mqa_plan(q, idx)
    a = ti._plan_lengths(plan, 128, q.device)
    assert a.tolist() == [128] * 3 and ti._plan_lengths(plan, 128, q.device) is a
    assert ti._plan_lengths(plan, 0, q.device).tolist() == [0] * 3
    assert ti._plan_lengths(None, 128, q.device).numel() == 0  # no tokens, no plan
    monkeypatch.setattr(ti, "stream_capturing", lambda device: True)
    assert ti._plan_lengths(plan, 128, q.device) is not a  # a captured fill has no values until replay


def test_a_call_refused_for_another_plan_leaves_the_plans_lengths_alone(use_settings):
    """A plan made for 3 tokens, handed to a call of 5: refused before its kept lengths are made or used, so the
    plan's later calls still get lengths of 3."""
    use_settings(target="sm_90a", dsv4_program="scheduled")
    q3 = torch.randn(3, 64, 512).to(torch.bfloat16)
    plan = ti.sparse_mqa_plan(q3, torch.zeros(3, 128, dtype=torch.int32))
    q5 = torch.randn(5, 64, 512).to(torch.bfloat16)
    cache = dsv4.new_kv_cache(2, 256, "cpu")
    with pytest.raises(ValueError, match="the plan was made for 3 tokens"):
        ti.sparse_mqa_tilelang(q5, cache, torch.zeros(5, 128, dtype=torch.int32), plan=plan)
    assert plan.full_lengths == {} and ti._plan_lengths(plan, 128, q3.device).tolist() == [128] * 3


def _same_launch(a, b) -> bool:
    """Two launches' arguments equal: tensors in shape, dtype and values (NaN equal to NaN), scalars as they are."""
    return len(a) == len(b) and all(
        (isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
         and torch.equal(x.float().nan_to_num(7.0), y.float().nan_to_num(7.0)))
        if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("extra,sink,lengths", [(True, True, True), (False, False, False), (True, False, False)])
def test_a_batchs_later_calls_launch_what_the_checked_call_launched(use_settings, monkeypatch, extra, sink,
                                                                     lengths):
    """FlashMLA's entry on the scheduled program: after a batch's first (checked) call, its later calls with the same
    signature go straight to the launches (``FlashMLASchedMeta.planned``), with the same arguments as a checked
    call's; a later call's bad cache is still refused, another program makes the call the checked path's again, and
    nothing is recorded while a graph is being captured."""
    use_settings(target="sm_90a", dsv4_program="scheduled", poison=True)  # outputs NaN-filled: comparable
    monkeypatch.setattr(flash_mla, "resolve_impl", lambda impl, device, op: "tilelang")
    kernels = {}

    def capture(key, build, target, pass_configs):
        return kernels.setdefault(key[0], SignatureCheck(build()))

    b, h = 3, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, 1, h, 512, generator=g).to(torch.bfloat16)
    cache, xcache = dsv4.new_kv_cache(4, 256), dsv4.new_kv_cache(6, 64, page_stride=93888)
    idx = torch.randint(-1, 1024, (b, 1, 128), generator=g, dtype=torch.int32)
    xidx = torch.randint(-1, 384, (b, 1, 512), generator=g, dtype=torch.int32)
    kw = dict(indices=idx, attn_sink=torch.randn(h, generator=g) if sink else None,
              topk_length=torch.tensor([5, 128, 0], dtype=torch.int32) if lengths else None)
    if extra:
        kw.update(extra_k_cache=xcache.unsqueeze(2), extra_indices_in_kvcache=xidx,
                  extra_topk_length=torch.tensor([512, 1, 300], dtype=torch.int32) if lengths else None)
    with _tilelang.intercepting(capture):
        meta = dsv4.get_mla_metadata()[0]
        out, lse = dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), tile_scheduler_metadata=meta, **kw)
        assert meta.planned is not None and out.shape == q.shape and lse.shape == (b, h, 1)
        out2, lse2 = dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), tile_scheduler_metadata=meta, **kw)
        assert out2.shape == q.shape and lse2.shape == (b, h, 1)
        calls = {name: k.calls for name, k in kernels.items()}
        assert set(calls) == {"dsv4_sparse_mqa_sched", "dsv4_sparse_combine"}
        for name in calls:  # the planned call's launches equal the checked call's, argument for argument
            assert len(calls[name]) == 2 and _same_launch(*calls[name]), name
        bad = torch.zeros(4, 256, 1, 580, dtype=torch.uint8)
        with pytest.raises(ValueError, match="cache must be"):
            dsv4.flash_mla_with_kvcache(q, bad, tile_scheduler_metadata=meta, **kw)
        use_settings(dsv4_program="paired")  # the later call takes the checked path: the paired program's launch
        dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), tile_scheduler_metadata=meta, **kw)
        assert "dsv4_sparse_mqa_paired" in kernels
        use_settings(dsv4_program="scheduled")
        # a call of another signature (no sink, or another sink) is checked and drops the old record
        other = dict(kw, attn_sink=None if sink else torch.randn(h, generator=g))
        dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), tile_scheduler_metadata=meta, **other)
        assert meta.planned is not None and meta.planned[1] == (not sink)
        monkeypatch.setattr(flash_mla, "stream_capturing", lambda device=None: True)
        dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), tile_scheduler_metadata=meta, **kw)
        assert meta.planned is None  # checked again while capturing: nothing recorded, nothing stale kept
        fresh = dsv4.get_mla_metadata()[0]
        dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), tile_scheduler_metadata=fresh, **kw)
        assert fresh.checked is not None and fresh.planned is None


class _FakeEntry:
    """A compiled entry stand-in: a handle once launched, every launch's arguments recorded."""

    def __init__(self, handle):
        self.h, self.calls, self.launched = handle, [], False

    def __call__(self, *args):
        self.calls.append(args)
        self.launched = True

    def handle(self, device):
        return self.h if self.launched else None


def _compiled_pair(monkeypatch):
    """The compiled launch forced on over a fake kernel pair (handles 11 and 22 once launched), the TileLang path
    taken on this CPU."""
    from musa_attn_backend.kernels.dsv4.sparse import flash_mla

    monkeypatch.setattr(flash_mla, "resolve_impl", lambda impl, device, op: "tilelang")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    program, combine = _FakeEntry(11), _FakeEntry(22)
    monkeypatch.setattr(ti, "_sched_kernels", lambda *a: (program, combine))
    monkeypatch.setattr(ti, "SCHED_COMPILED_LAUNCH", True)
    return program, combine


def _decode_batch(b: int, h: int):
    """``(swa, c4, q, indices, extra_indices, sink)`` of a ``b``-request decode batch, CPU."""
    from musa_attn_backend.kernels.dsv4 import layout as L

    swa, c4 = L.new_kv_cache(4, 256, "cpu"), L.new_kv_cache(64, 64, "cpu")
    q = torch.randn(b, 1, h, 512).to(torch.bfloat16)
    i1 = torch.randint(0, 4 * 256, (b, 1, 128), dtype=torch.int32)
    i2 = torch.randint(0, 64 * 64, (b, 1, 512), dtype=torch.int32)
    return swa, c4, q, i1, i2, torch.randn(h)


def test_compiled_launch_passes_the_python_paths_arguments(monkeypatch):
    """``SCHED_COMPILED_LAUNCH``: after a kernel pair's first launch (through Python, which makes the entries),
    FlashMLA's entry hands ``_ffi_launch.run`` the two kernels' handles and the same argument lists the Python
    path passes, the LSE, the partials and the output as placeholders of the tensors it asks for, in the
    kernels' order; the results come back as the entry's (out, lse)."""
    from musa_attn_backend import _ffi_launch

    program, combine = _compiled_pair(monkeypatch)
    runs = []

    def fake_run(calls, allocs, like):
        made = [torch.full(shape, float(i), dtype=dtype) for i, (shape, dtype) in enumerate(allocs)]
        runs.append((calls, allocs, made))
        return made

    monkeypatch.setattr(_ffi_launch, "run", fake_run)
    b, h = 3, 64
    swa, c4, q, i1, i2, sink = _decode_batch(b, h)
    with config.override(target="sm_90a", dsv4_program="scheduled"):
        meta = dsv4.get_mla_metadata()[0]
        call = lambda: dsv4.flash_mla_with_kvcache(  # noqa: E731
            q, swa.unsqueeze(2), None, None, 512, meta, indices=i1, attn_sink=sink, extra_k_cache=c4.unsqueeze(2),
            extra_indices_in_kvcache=i2)
        call()  # the first launch: through Python
        assert len(program.calls) == 1 and len(combine.calls) == 1 and not runs
        out, lse = call()
    assert len(program.calls) == 1 and len(runs) == 1
    (calls, allocs, made) = runs[0]
    assert [c[0] for c in calls] == [11, 22]
    T = b
    assert [(tuple(s), d) for s, d in allocs[:3]] == [((T, h), torch.float32), ((allocs[1][0][0], h, 512),
                                                                                 torch.float32),
                                                       ((allocs[1][0][0], h), torch.float32)]
    assert len(allocs) == 4 and tuple(allocs[3][0]) == (T, h, 512) and allocs[3][1] == torch.bfloat16
    assert out.shape == (b, 1, h, 512) and torch.equal(out.reshape(T, h, 512), made[3])
    assert torch.equal(lse.reshape(T, h), made[0])

    def same(python_args, compiled_args):
        assert len(python_args) == len(compiled_args)
        for p, c in zip(python_args, compiled_args):
            if isinstance(c, _ffi_launch.Alloc):  # the Python path's own scratch tensor of the same shape
                assert isinstance(p, torch.Tensor) and tuple(p.shape) == tuple(made[c[0]].shape)
                assert p.dtype == made[c[0]].dtype
            elif isinstance(c, torch.Tensor):
                assert isinstance(p, torch.Tensor) and torch.equal(p, c) and p.dtype == c.dtype
            else:
                assert p == c and type(p) is type(c)

    same(program.calls[0], calls[0][1])
    same(combine.calls[0], calls[1][1])
    placeholders = [a[0] for a in calls[0][1] if isinstance(a, _ffi_launch.Alloc)]
    assert placeholders == [3, 0, 1, 2]  # out, lse, o_part, l_part: the program's last four arguments
    assert [a[0] for a in calls[1][1] if isinstance(a, _ffi_launch.Alloc)] == [1, 2, 3, 0]


def test_recorded_launches_stand_for_the_batchs_later_calls(monkeypatch):
    """``SCHED_COMPILED_LAUNCH``: the batch's first compiled call records its launches (``_ffi_launch.prepare``)
    with the caller's tensors as slots, each launch tensor a view of its slot (the caches' word views included)
    or one of the batch's own (the plan's); later calls hand ``run`` their tensors in the slots' order and get
    its results back. A call that differs (its scale, which optional tensors it passes, a tensor ``run`` refuses,
    a changed setting) takes the checked path, launching through ``_ffi_launch.run`` as before."""
    from musa_attn_backend import _ffi_launch

    _compiled_pair(monkeypatch)
    runs, prepared = [], []

    def made_for(allocs):
        return [torch.full(shape, float(i + 1), dtype=dtype) for i, (shape, dtype) in enumerate(allocs)]

    class FakePrepared:
        def __init__(self, calls, allocs, slots):
            self.calls, self.allocs, self.slots, self.runs, self.refuse = calls, allocs, slots, [], False

        def run(self, tensors):
            self.runs.append(tensors)
            return None if self.refuse else made_for(self.allocs)

    monkeypatch.setattr(_ffi_launch, "run", lambda calls, allocs, like: runs.append(calls) or made_for(allocs))
    monkeypatch.setattr(_ffi_launch, "prepare", lambda *a: prepared.append(FakePrepared(*a)) or prepared[-1])
    b, h = 3, 64
    swa, c4, q, i1, i2, sink = _decode_batch(b, h)
    lengths = torch.tensor([5, 128, 0], dtype=torch.int32)
    k4, x4 = swa.unsqueeze(2).view(torch.float8_e4m3fn), c4.unsqueeze(2)  # SGLang passes float8 views
    with config.override(target="sm_90a", dsv4_program="scheduled"):
        meta = dsv4.get_mla_metadata()[0]

        def call(**kw):
            args = dict(indices=i1, attn_sink=sink, extra_k_cache=x4, extra_indices_in_kvcache=i2,
                        topk_length=lengths)
            return dsv4.flash_mla_with_kvcache(q, k4, None, None, 512, meta, **{**args, **kw})

        call()  # through Python (the entries made)
        call()  # compiled, and recorded
        assert len(runs) == 1 and len(prepared) == 1
        rec = prepared[0]
        slots = [q, k4, i1, lengths, sink, x4, i2]
        assert len(rec.slots) == len(slots) and all(a is b for a, b in zip(rec.slots, slots))
        for (handle, args), (_, python_args) in zip(rec.calls, runs[0]):
            assert len(args) == len(python_args)
            for a, p in zip(args, python_args):
                if isinstance(a, _ffi_launch.SlotView):  # a view of its slot, the very tensor the launch took
                    k, view = a
                    assert view.untyped_storage().data_ptr() == slots[k].untyped_storage().data_ptr()
                    assert torch.equal(view, p) and view.dtype == p.dtype and view.stride() == p.stride()
                elif isinstance(a, torch.Tensor):  # the batch's own: none shares a slot's memory
                    assert all(a.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for s in slots)
                else:
                    assert a == p
        word_views = {a[0] for _, args in rec.calls for a in args if isinstance(a, _ffi_launch.SlotView)}
        assert word_views == {0, 1, 2, 3, 4, 5, 6}  # every slot feeds a launch
        out, lse = call()  # a later layer: the recorded launches only
        assert len(runs) == 1 and len(rec.runs) == 1 and all(a is b for a, b in zip(rec.runs[0], slots))
        assert out.shape == (b, 1, h, 512) and torch.equal(out.reshape(b, h, 512), torch.full((b, h, 512), 4.0))
        assert lse.shape == (b, h, 1) and torch.equal(lse, torch.ones(b, h, 1))
        rec.refuse = True  # run() refuses a tensor (as the C++ side does on a shape, stride or dtype change)
        call()
        assert len(runs) == 2 and len(rec.runs) == 2
        rec.refuse = False
        call(softmax_scale=0.05)  # another scale: checked, launched through run(), a new record for it
        assert len(rec.runs) == 2 and len(runs) == 3 and meta.fast is None
        call(softmax_scale=0.05)
        assert len(prepared) == 2 and len(runs) == 4
        call(softmax_scale=0.05)
        assert len(prepared[1].runs) == 1 and len(runs) == 4
        with config.override(target="sm_90a", dsv4_program="scheduled"):  # a setting changed: checked again
            call(softmax_scale=0.05)
        assert len(prepared[1].runs) == 1
        out_given = torch.empty(b, 1, h, 512, dtype=torch.bfloat16)
        before = len(runs)
        res, _ = call(softmax_scale=0.05, out=out_given)  # out passed where the record made it: checked path
        assert len(runs) == before + 1 and res.data_ptr() == out_given.data_ptr()
