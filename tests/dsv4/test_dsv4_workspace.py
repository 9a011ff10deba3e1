"""The bf16 workspace of the paired_ws program (:mod:`musa_attn_backend.kernels.dsv4.sparse.workspace`) on the CPU:
its rows and rebased lists select exactly what the caches' lists select, and attention over it is the reference's;
the program's launch against its signature; its sm_90a build (the producer's copies and barriers, registers)."""

import random
import re

import pytest
import torch

from musa_attn_backend import _tilelang
from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
from musa_attn_backend.kernels.dsv4.sparse.reference import valid_entries
from musa_attn_backend.kernels.dsv4.sparse.workspace import build_workspace
from musa_attn_backend.testing.toolchain import HOPPER, in_ci, nvcc_path

from test_dsv4_build import SignatureCheck, _batch, _ptxas_spills
from test_dsv4_reference import nan_cache, random_rows


def filled(pages, rows, stride, seed):
    """A NaN-filled cache with random rows written at half its slots (the others must never be read)."""
    cache = nan_cache(pages, rows, stride)
    n = pages * rows
    slots = torch.tensor(random.Random(seed).sample(range(n), max(n // 2, 1)))
    dsv4.write_kv_v4(random_rows(len(slots), seed), cache, slots)
    return cache, slots


def lists(slots, T, K, num_slots, seed):
    """Index lists drawn from the written slots (repeats across tokens), 20% invalid, some at or past the end."""
    g = torch.Generator().manual_seed(seed)
    idx = slots[torch.randint(0, len(slots), (T, K), generator=g)].to(torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    idx[0, 0] = num_slots
    idx[-1, -1] = num_slots + 77
    return idx


def attention(q, rows, idx, n, sink, scale=512 ** -0.5):
    """Sparse MQA over workspace rows in float64 (the program's contract): entry ``j`` of token ``t`` counts if
    ``j < n[t]`` and ``idx >= 0``."""
    ok = (idx >= 0) & (torch.arange(idx.shape[1])[None, :] < n[:, None])
    kv = rows.double()[idx.clamp(min=0).long()]  # [T, K, 512]
    s = torch.einsum("thd,tkd->thk", q.double(), kv) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.double()[None, :])
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink.double()[None, :] - m)
    return torch.einsum("thk,tkd->thd", p, kv) / den[..., None]


@pytest.mark.parametrize("main,extra", [((5, 64, 93888), (7, 2, 0)), ((3, 256, 0), None), ((9, 2, 0), (6, 64, 0)),
                                        ((4, 2, 93888), (0, 64, 0))])
def test_workspace_selects_what_the_lists_select(main, extra):
    """Every valid entry's workspace row is its cache row (bit for bit), every invalid one is -1 (negative, past
    the slots, past its length), each selected row is there once (no NaN row of the unwritten slots), the extra
    set's after the main set's, the lengths by the module's rule; attention over the workspace is the reference's."""
    T, K1, K2 = 7, 70, 9
    cache, slots = filled(*main, seed=1)
    idx = lists(slots, T, K1, main[0] * main[1], seed=2)
    lens = torch.tensor([70, 3, 0, 64, 65, 17, 1], dtype=torch.int32)
    kw, xlens, parts = {}, None, [(cache, idx, lens, main[0] * main[1])]
    if extra is not None:
        xcache = nan_cache(*extra)
        xslots = torch.arange(0)
        if extra[0]:
            xcache, xslots = filled(*extra, seed=3)
        xidx = (lists(xslots, T, K2, extra[0] * extra[1], seed=4) if len(xslots)
                else torch.randint(-3, 3, (T, K2), dtype=torch.int32))  # a cache of no pages: nothing selects
        xlens = torch.tensor([9, 0, 0, 4, 1, 2, 9], dtype=torch.int32)
        kw = dict(extra_cache=xcache, extra_indices=xidx, extra_lengths=xlens)
        parts.append((xcache, xidx, xlens, extra[0] * extra[1]))
    ws = build_workspace(cache, idx, lens, **kw)
    assert ws.rows.dtype == torch.bfloat16 and not ws.rows.isnan().any()
    assert ws.indices.shape == (T, K1 + (K2 if extra else 0)) and ws.indices.dtype == torch.int32
    col, base = 0, 0
    for c, i, n, num_slots in parts:
        ok = valid_entries(i, n, num_slots)
        got = ws.indices[:, col:col + i.shape[1]]
        assert torch.equal(got >= 0, ok)
        distinct = torch.unique(i[ok]).numel()
        assert torch.equal(torch.unique(got[ok]), torch.arange(base, base + distinct))  # each row once, in order
        if ok.any():
            assert torch.equal(ws.rows[got[ok].long()].view(torch.int16),
                               dsv4.read_kv_v4(c, i[ok]).view(torch.int16))
        col, base = col + i.shape[1], base + distinct
    assert ws.rows.shape[0] == base
    if extra is not None:
        assert torch.equal(ws.lengths, torch.where(xlens > 0, K1 + xlens, lens))
    else:
        assert torch.equal(ws.lengths, lens)
    k = torch.arange(ws.indices.shape[1])[None, :]
    assert (ws.indices[k >= ws.lengths[:, None]] == -1).all()  # nothing valid past a token's length

    g = torch.Generator().manual_seed(5)
    q = (torch.randn(T, 8, 512, generator=g) * 3).to(torch.bfloat16)
    sink = torch.randn(8, generator=g)
    ref = dsv4.sparse_mqa(q, cache, idx, lens, sink=sink, impl="reference", **kw)
    got = attention(q, ws.rows, ws.indices, ws.lengths, sink)
    torch.testing.assert_close(got, ref.double(), atol=2e-2, rtol=2e-2)  # bf16 reference output


def test_workspace_without_lengths_counts_every_entry():
    cache, slots = filled(6, 64, 0, seed=9)
    idx = lists(slots, 4, 128, 384, seed=10)
    ws = build_workspace(cache, idx)
    assert torch.equal(ws.lengths, torch.full((4,), 128, dtype=torch.int32))
    assert torch.equal(ws.indices >= 0, valid_entries(idx, None, 384))


def test_paired_ws_block_n_is_the_hopper_programs():  # its glue: test_dsv4_build.py's paired glue test
    assert ti.sparse_mqa_block_n(program="paired_ws") == 64


def test_paired_ws_is_refused_where_the_target_cannot_run_it(use_settings):
    use_settings(target="mp_31", dsv4_program="paired_ws")
    q, cache, idx, _, _ = _batch(2)
    with pytest.raises(ValueError, match="paired_ws"):
        ti.sparse_mqa_tilelang(q, cache, idx)


NVCC = nvcc_path()


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
def test_paired_ws_program_builds_for_sm90a(tmp_path):
    """The producer copies each half's rows by predicated 16-byte cp.async (32 a tile, both stages: 64 in the
    code) and completes each half's barrier by a cp.async arrive (noinc) plus an ordinary arrive after the row
    flags, without waiting for its copies in the key loop; the math groups at 208 registers, the producer at 88,
    no spill."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw

    src = _tilelang.compile_cached(("test_paired_ws", 64, True), lambda: pw.build_sparse_mqa_paired_ws(64, True),
                                   target=HOPPER, pass_configs=ti._ws_pass_configs()).get_kernel_source()
    assert "warpgroup_reg_alloc<208>" in src and "warpgroup_reg_dealloc<88>" in src
    producer = src.split("warpgroup_reg_dealloc<88>")[1]
    loop = producer.split("for (int j = 0;")[1]
    assert loop.count("cp_async_gs_conditional<16>") == 4 and loop.count("mbarrier_cp_async_arrive_noinc(") == 4
    assert "cp_async_wait" not in loop  # the copies land on the barriers, the producer never waits for them
    for bar in ("full_l[0]", "full_l[1]", "full_r[0]", "full_r[1]"):
        assert f"{bar}.init(256);" in src and loop.count(f"{bar}.arrive();") == 1
    # the flags before the first half's ordinary arrive, in both stages
    assert loop.index("ok_s[") < loop.index("full_l[0].arrive()") and loop.rindex("ok_s[") < loop.index(
        "full_r[1].arrive()")
    spills, regs = _ptxas_spills(src, tmp_path)
    assert spills == 0 and regs == 168


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
def test_paired_ws_pipelined_groups_build_for_sm90a(tmp_path):
    """The pipelined math groups (FlashMLA's prefill order): group 0 issues the next pair's Q K^T while the other
    tile's P V runs (a wait for all but one WGMMA group, then the stage 1 left half released), the four named
    barriers of the maximum and P exchanges, the producer unchanged. ptxas: 168 registers; 20 bytes of spill
    stores at 208 / 88 registers since the first pair's Q K^T moved into the loop (540 before: its descriptors
    were hoisted out of the loop with the later pairs'; docs/dsv4.md), bounded here so that a growth shows."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw

    src = _tilelang.compile_cached(("test_paired_ws_pipelined", 64, True),
                                   lambda: pw.build_sparse_mqa_paired_ws(64, True, "bfloat16", True),
                                   target=HOPPER, pass_configs=ti._ws_pass_configs()).get_kernel_source()
    group0 = src.split("warpgroup_reg_alloc<208>")[1]  # up to group 1's code
    after_remote_pv = group0.split(f"__sync_thread_partial({pw.S1_READY}, 256)")[1]
    assert after_remote_pv.index("full_l[0].wait(") < after_remote_pv.index("tl::wait_wgmma<1>();") < \
        after_remote_pv.index("empty_l[1].arrive();")
    for bar in (pw.BUNCH0, pw.BUNCH1, pw.S0_READY, pw.S1_READY):
        assert f"({bar}, 256)" in src
    assert src.split("warpgroup_reg_dealloc<88>")[1].count("mbarrier_cp_async_arrive_noinc(") == 4
    spills, regs = _ptxas_spills(src, tmp_path)
    assert regs == 168 and spills <= 64, spills


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("row_copy,group_copy", [(False, False), (True, False), (True, True)],
                         ids=["hint", "rowcopy", "groupcopy"])
def test_paired_ws_copy_hints_and_staged_output_build_for_sm90a(tmp_path, row_copy, group_copy):
    """``COPY_HINT``: the producer's 32 copies a tile go through the hinted cp.async (an evict-last policy made once,
    before the key loop), still completing the halves' barriers by the cp.async arrive (``ROW_COPY``: from each
    entry's row, the list read from the token's first entry; ``GROUP_COPY``: 8 lanes a row, 4 index reads a thread a
    tile); ``SMEM_EPILOGUE``: each group writes its output
    columns into its half of the query's shared memory, syncs its 128 threads on its own named barrier and stores
    16-byte pieces. ptxas: 168 registers, no spill."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw
    from musa_attn_backend.kernels.dsv4.sparse.rows import LOAD_HINT_HEADER

    src = _tilelang.compile_cached(("test_paired_ws_hint_smem_out", 64, True, row_copy, group_copy),
                                   lambda: pw.build_sparse_mqa_paired_ws(64, True, "bfloat16", False, True, True,
                                                                         False, row_copy, group_copy),
                                   target=HOPPER, pass_configs=ti._ws_pass_configs(),
                                   headers=(LOAD_HINT_HEADER,)).get_kernel_source()
    producer = src.split("warpgroup_reg_dealloc<88>")[1]
    before, loop = producer.split("for (int j = 0;")
    assert "musa_attn_evict_last_policy()" in before and "musa_attn_evict_last_policy" not in loop
    copy = "musa_attn_cp_async16_row(" if row_copy else "musa_attn_cp_async16_hint("
    assert loop.count(copy) == 4 and "cp_async_gs_conditional" not in loop
    assert ("musa_attn_ldg_i32(" in loop) == row_copy
    assert ("for (int c = 0; c < 4; ++c)" in loop) == group_copy  # a lane's four 16-byte pieces of each half
    assert loop.count("mbarrier_cp_async_arrive_noinc(") == 4
    for w, q_s in enumerate(("Ql_s", "Qr_s")):
        group = src.split("warpgroup_reg_alloc<208>")[1 + w]
        staged = group.split(f"__sync_thread_partial({pk.OUT_READY[w]}, 128)")
        assert len(staged) == 2 and f"((bfloat16_t*){q_s})" in staged[0].split(f"__sync_thread_partial("
                                                                                f"{pk.EPILOGUE}, 256)")[1]
        assert "*(uint4*)(O + " in staged[1]
    spills, regs = _ptxas_spills(src, tmp_path, headers=(LOAD_HINT_HEADER,))
    assert spills == 0 and regs == 168


def test_workspace_rows_program_keeps_mp31s_rules_and_builds_for_sm90a(use_settings):
    """The workspace's gather (a portable program: element loops, bounds-checked vector reads) breaks none of
    MP31's lowering rules in either FP8 form, and compiles for sm_90a (exact dequantisation: the GPU test
    compares it with the reference reader bit for bit)."""
    from musa_attn_backend.kernels._tir import RULES, violations
    from musa_attn_backend.kernels.dsv4.sparse.workspace_kernel import build_workspace_rows

    musa = {flag: False for flag in RULES}  # a target lacking every capability the rules name
    for fp8 in (True, False):
        assert violations(build_workspace_rows.__wrapped__(fp8), musa) == []
    if NVCC or in_ci():
        src = ti.workspace_rows_kernel(target=HOPPER).get_kernel_source()
        assert "workspace_rows_kernel" in src and "exp2" in src


def test_flash_mla_sparse_fwd_runs_the_paired_ws_program(use_settings):
    """FlashMLA's sparse prefill entry's kernel path (``impl`` auto on a GPU): the paired_ws program over the
    caller's bf16 rows, no workspace built (the rows are one), FlashMLA's empty LSE (+inf), the topk lengths
    passed, the three outputs returned in FlashMLA's order; on MUSA the portable program over the same rows."""
    use_settings(target="sm_90a")
    kernels = {}

    def capture(key, build, target, pass_configs):
        return kernels.setdefault(key[0], SignatureCheck(build()))

    S, H, S_kv, K = 6, 64, 300, 96
    q = torch.randn(S, H, 512).to(torch.bfloat16)
    kv = torch.randn(S_kv, 1, 512).to(torch.bfloat16)
    idx = torch.randint(-1, S_kv, (S, 1, K), dtype=torch.int32)
    lens = torch.tensor([96, 0, 5, 64, 65, 1], dtype=torch.int32)
    with _tilelang.intercepting(capture):  # what flash_mla_sparse_fwd calls on a GPU (its tensors on the CPU here)
        out, max_logits, lse = ti.sparse_prefill_bf16(q, kv.reshape(S_kv, 512), idx[:, 0], lens, torch.zeros(H),
                                                      0.04)
    assert set(kernels) == {"dsv4_sparse_mqa_paired_ws"}
    (call,) = kernels["dsv4_sparse_mqa_paired_ws"].calls
    assert call[1].shape == (S_kv, 512) and call[2].shape == (S, K) and torch.equal(call[3], lens)
    assert float("inf") in [a for a in call if not isinstance(a, torch.Tensor)]
    assert out is call[-3] and lse is call[-2] and max_logits is call[-1]
    use_settings(target="mp_31")  # MUSA: the portable program over the same rows, in MUSA's form
    kernels.clear()
    with _tilelang.intercepting(capture):
        ti.sparse_prefill_bf16(q, kv.reshape(S_kv, 512), idx[:, 0], None, None, 0.04)
    assert set(kernels) == {"dsv4_sparse_mqa_portable_ws"}
    with pytest.raises(ValueError, match="impl='tilelang' needs the tensors on a CUDA or MUSA device"):
        dsv4.flash_mla_sparse_fwd(q, kv, idx, 0.04, impl="tilelang")


def _one_ws_launch(program: str):
    """A V4 batch through ``sparse_mqa_tilelang`` with the kernels intercepted (the settings name ``program``):
    the workspace's gather and one launch of the program, each argument where its parameter is. Returns the
    kernels by name, the built prim_funcs in order and the interceptor (for more calls)."""
    kernels, funcs = {}, []

    def capture(key, build, target, pass_configs):
        funcs.append(build())
        return kernels.setdefault(key[0], SignatureCheck(funcs[-1]))

    q, cache, idx, xcache, xidx = _batch(4)
    with _tilelang.intercepting(capture):
        ti.sparse_mqa_tilelang(q, cache, idx, None, extra_cache=xcache, extra_indices=xidx, sink=torch.zeros(64),
                               return_lse=True)
    assert set(kernels) == {"dsv4_workspace_rows", f"dsv4_sparse_mqa_{program}"}
    assert len(kernels[f"dsv4_sparse_mqa_{program}"].calls) == 1
    return kernels, funcs, capture


@pytest.mark.parametrize("prefetch", [False, True], ids=["gather", "prefetch"])
@pytest.mark.parametrize("target,musa", [("sm_90a", False), ("mp_31", True)])
def test_portable_ws_glue_and_musa_rules(use_settings, monkeypatch, target, musa, prefetch):
    """MUSA_ATTN_DSV4_PROGRAM=portable_ws: the workspace's gathers and one program launch, every argument where its
    parameter is; MUSA's form (K and V tiles of their own, 32 rows) breaks none of MP31's lowering rules, with the
    rows gathered in turn or prefetched into registers (``portable_ws_kernel.PREFETCH``)."""
    from musa_attn_backend.kernels._tir import RULES, violations
    from musa_attn_backend.kernels.dsv4.sparse import portable_ws_kernel

    monkeypatch.setattr(portable_ws_kernel, "PREFETCH", prefetch)
    use_settings(target=target, dsv4_program="portable_ws")
    kernels, funcs, capture = _one_ws_launch("portable_ws")
    program = funcs[-1]
    assert bool(re.search(r"(?<!K)V_s\b", str(program))) == musa  # a V tile of its own on MUSA only
    flags = {flag: not musa for flag in RULES}
    assert all(violations(f, flags) == [] for f in funcs)


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
def test_portable_ws_program_builds_for_sm90a(use_settings):
    use_settings(dsv4_program="portable_ws")
    src = ti.portable_ws_kernel(64, True, "bfloat16", target=HOPPER).get_kernel_source()
    assert "sparse_mqa_portable_ws_kernel" in src


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
def test_portable_ws_prefetch_form_builds_for_sm90a(use_settings, monkeypatch, tmp_path):
    """``PREFETCH`` in MUSA's tiles: each tile stored from registers between two block barriers, then the next
    tile's loads issued (guarded by the tile count) before this tile's first GEMM; ptxas: no spill."""
    from musa_attn_backend.kernels.dsv4.sparse import portable_ws_kernel

    monkeypatch.setattr(portable_ws_kernel, "PREFETCH", True)
    use_settings(dsv4_program="portable_ws", musa_forms=True)
    src = ti.portable_ws_kernel(64, True, "bfloat16", target=HOPPER).get_kernel_source()
    loop = src.split("for (int it = 0;")[1]
    stored, rest = loop.split("__syncthreads();")[1:3]
    assert "buf + (" in stored and "V_s" in stored  # the key and V tiles from the registers
    assert rest.index("*(uint4*)(buf + (") < rest.index("wgmma")  # the next tile's loads before the math
    spills, _ = _ptxas_spills(src, tmp_path)
    assert spills == 0, spills


@pytest.mark.parametrize("overlap", [False, True], ids=["waited", "overlap"])
@pytest.mark.parametrize("target,musa", [("sm_90a", False), ("mp_31", True)])
def test_staged_ws_glue_and_musa_rules(use_settings, monkeypatch, target, musa, overlap):
    """MUSA_ATTN_DSV4_PROGRAM=staged_ws: the workspace's gathers and one program launch, every argument where its
    parameter is; one form within every MP31 lowering rule on both targets (its tiles are MUSA's everywhere), the
    proxy fence and the register reallocation only where the target has them; FlashMLA's prefill entry runs it
    where the setting names it."""
    from musa_attn_backend.kernels._tir import RULES, violations
    from musa_attn_backend.kernels.dsv4.sparse import staged_ws_kernel

    monkeypatch.setattr(staged_ws_kernel, "OVERLAP", overlap)
    use_settings(target=target, dsv4_program="staged_ws")
    kernels, funcs, capture = _one_ws_launch("staged_ws")
    program = str(funcs[-1])
    assert violations(funcs[-1], {flag: False for flag in RULES}) == []
    assert ("fence_proxy_async" in program) == (not musa)
    assert ("set_max_nreg" in program) == (not musa)
    assert "sync_threads(" not in program.split("if tx < 128")[-1]  # no named barrier in the groups' code
    kernels.clear()
    S, S_kv, K = 6, 300, 96
    kv = torch.randn(S_kv, 512).to(torch.bfloat16)
    with _tilelang.intercepting(capture):
        ti.sparse_prefill_bf16(torch.randn(S, 64, 512).to(torch.bfloat16), kv,
                               torch.randint(-1, S_kv, (S, K), dtype=torch.int32), None, None, 0.04)
    assert set(kernels) == {"dsv4_sparse_mqa_staged_ws"}


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("overlap", [False, True], ids=["waited", "overlap"])
def test_staged_ws_program_builds_for_sm90a(use_settings, monkeypatch, tmp_path, overlap):
    """The staged program for sm_90a, in both orders of group 0's GEMMs: the barriers' arrival counts the protocol
    model assumes (one group of 128 a barrier, both math groups on ``v_empty``:
    tests/dsv4/test_dsv4_staged_ws_protocol.py), the groups' registers reallocated (232 / 176 / 96: within the launch's 3 x 168), and ptxas spills nothing."""
    from musa_attn_backend.kernels.dsv4.sparse import staged_ws_kernel as sws

    monkeypatch.setattr(sws, "OVERLAP", overlap)
    use_settings(dsv4_program="staged_ws")
    src = ti.staged_ws_kernel(64, True, "bfloat16", target=HOPPER).get_kernel_source()
    # OVERLAP: group 0's scores issued, then waited for by count (this tile's P V0 first, then the scores)
    assert (src.count("wait_wgmma<1>") > 0) == overlap
    inits = {}
    for name, count in re.findall(r"(\w+)\[\d\]\.init\((\d+)\)", src):
        inits.setdefault(name, set()).add(int(count))
    assert inits == {"k_full": {128}, "k_empty": {128}, "v_full": {128}, "v_empty": {256}, "p_full": {128},
                     "p_empty": {128}, "done": {128}}
    assert [int(n) for n in re.findall(r"warpgroup_reg_(?:de)?alloc<(\d+)>", src)] == list(sws.REGS)
    assert sum(sws.REGS) <= 3 * 168
    spills, _ = _ptxas_spills(src, tmp_path)
    assert spills == 0, spills


def test_paired_ws_adjacent_heads_grid(use_settings):
    """``ADJACENT_HEADS``: one grid dimension of (token, head block) pairs, a token's head blocks adjacent (128 heads:
    block ``2 t`` and ``2 t + 1``); the token and head block read from it, and no other grid dimension."""
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw

    func = pw.build_sparse_mqa_paired_ws(128, True, "bfloat16", True, True, True, True, True, True, True)
    text = func.script()
    assert 'thread="blockIdx.x"' in text and "num_tokens * 2" in text
    assert re.search(r'T\.thread_binding\(1, thread="blockIdx\.y"\)', text)
    assert "t: T.int32 = bx // 2" in text and "bh: T.int32 = bx % 2" in text
    plain = pw.build_sparse_mqa_paired_ws(128, True, "bfloat16", True, True, True, True, True, True, False).script()
    assert re.search(r'T\.thread_binding\(num_tokens, thread="blockIdx\.x"\)', plain)
    assert re.search(r'T\.thread_binding\(2, thread="blockIdx\.y"\)', plain)
