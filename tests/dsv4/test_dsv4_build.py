"""The DeepSeek-V4 kernels' launch glue against the programs' signatures (on the CPU: the programs are built,
not compiled, and every argument the launcher passes is checked against the parameter it lands in), the MUSA
programs' TIR (P from shared memory), and real sm_90a builds with nvcc."""

import re

import pytest
import torch

from musa_attn_backend import _tilelang, config
from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels._tir import gemm_operands, register_a_gemms
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.kernels.dsv4.model import tilelang_impl as mti
from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as ti
from musa_attn_backend.kernels.dsv4.writers import tilelang_impl as wti
from musa_attn_backend.testing.toolchain import HOPPER, in_ci, nvcc_path

TORCH_OF = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "int64": torch.int64,
            "uint8": torch.uint8,
            "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}


class SignatureCheck:
    """Stands in for a compiled kernel: checks each call's arguments against the prim_func's parameters (count,
    tensor dtypes and ranks, scalars where scalars go) and records the call."""

    def __init__(self, func):
        self.func, self.calls = func, []

    def __call__(self, *args):
        params = list(self.func.params)
        assert len(args) == len(params), f"{len(args)} arguments for {len(params)} parameters"
        for p, a in zip(params, args):
            buf = self.func.buffer_map.get(p)
            if buf is None:
                assert isinstance(a, (int, float)), f"{p.name}: a scalar parameter got {type(a).__name__}"
                continue
            assert isinstance(a, torch.Tensor), f"{buf.name}: a tensor parameter got {type(a).__name__}"
            assert a.dtype == TORCH_OF[str(buf.dtype)], f"{buf.name}: {a.dtype} for {buf.dtype}"
            assert a.dim() == len(buf.shape), f"{buf.name}: rank {a.dim()} for {len(buf.shape)}"
        self.calls.append(args)


def _batch(T=3, H=64, K1=128, K2=512, device="cpu"):
    cache = L.new_kv_cache(4, 256, device)
    extra = L.new_kv_cache(6, 64, device, page_stride=93888)
    q = torch.randn(T, H, 512).to(torch.bfloat16)
    idx = torch.randint(-1, 1024, (T, K1), dtype=torch.int32)
    xidx = torch.randint(-1, 384, (T, K2), dtype=torch.int32)
    return q, cache, idx, extra, xidx


@pytest.mark.parametrize("T,split", [(2, True), (400, False)])
def test_launch_glue_matches_the_programs(use_settings, T, split):
    """The portable program's glue, split and whole (the scheduled one's: test_dsv4_sched.py)."""
    use_settings(target="sm_90a", dsv4_program="portable")
    kernels = {}

    def capture(key, build, target, pass_configs):
        name = key[0] + ("_split" if key[0] == "dsv4_sparse_mqa" and key[4] else "")
        return kernels.setdefault(name, SignatureCheck(build()))

    q, cache, idx, extra, xidx = _batch(T)
    with _tilelang.intercepting(capture):
        out, lse = ti.sparse_mqa_tilelang(q, cache, idx, torch.full((T,), 100, dtype=torch.int32),
                                          extra_cache=extra, extra_indices=xidx, sink=torch.zeros(64),
                                          return_lse=True)
    assert out.shape == q.shape and lse.shape == (T, 64)
    names = set(kernels)
    assert names == ({"dsv4_sparse_mqa_split", "dsv4_combine"} if split else {"dsv4_sparse_mqa"})
    assert all(len(k.calls) == 1 for k in kernels.values())


@pytest.mark.parametrize("program", ["paired", "paired_ws"])
@pytest.mark.parametrize("extra", [True, False])
def test_paired_program_glue_matches_its_signature(use_settings, extra, program):
    """The paired programs' launch: one kernel (paired_ws: after a gather of the workspace's rows from each
    cache), every argument where its parameter is (with and without the extra set, and with FlashMLA's LSE
    convention)."""
    use_settings(target="sm_90a", dsv4_program=program)
    kernels = {}

    def capture(key, build, target, pass_configs):
        return kernels.setdefault(key[0], SignatureCheck(build()))

    q, cache, idx, xcache, xidx = _batch(5)
    kw = dict(extra_cache=xcache, extra_indices=xidx) if extra else {}
    with _tilelang.intercepting(capture):
        out, lse = ti.sparse_mqa_tilelang(q, cache, idx, None, sink=torch.zeros(64), return_lse=True,
                                          empty_lse_inf=True, **kw)
    assert out.shape == q.shape and lse.shape == (5, 64)
    name = f"dsv4_sparse_mqa_{program}"
    assert set(kernels) == {name} | ({"dsv4_workspace_rows"} if program == "paired_ws" else set())
    assert len(kernels[name].calls) == 1
    args = kernels[name].calls[0]
    assert float("inf") in [a for a in args if not isinstance(a, torch.Tensor)]  # the empty LSE the program writes
    if program == "paired_ws":
        assert len(kernels["dsv4_workspace_rows"].calls) == (2 if extra else 1)  # a gather a cache
        assert args[2].shape == (5, 128 + (512 if extra else 0))  # one rebased list a token


def test_musa_dsv4_programs_read_p_from_shared_memory(use_settings):
    use_settings(target="mp_31")
    programs = []
    with _tilelang.intercepting(lambda key, build, target, pc: programs.append(build())):
        for split in (False, True):
            for H in (8, 64, 128):
                ti.sparse_mqa_kernel(H, True, True, split, "bfloat16")
    assert len(programs) == 6
    for func in programs:
        assert not register_a_gemms(func)
        ops = gemm_operands(func)
        assert len(ops) == 2 and ops[1].a == "P_s" and all(g.b_scope.startswith("shared") for g in ops)


NVCC = nvcc_path()


@pytest.mark.parametrize("target,program", [("sm_90a", "scheduled"), ("sm_90", "portable"),
                                            ("sm_80", "portable"), ("mp_31", "portable"), ("mp_22", "portable")])
def test_each_target_runs_the_program_it_can(use_settings, target, program):
    """The scheduled and paired programs need warp specialisation (sm_90a), GEMMs reading A from registers and an
    FP8 conversion (sm_90a runs the scheduled one); everything else, MUSA included, runs the portable one, and
    forcing another is refused, as is a program that does not exist (the warp-specialised one, removed)."""
    use_settings(target=target)
    assert ti.sparse_mqa_program() == program
    if program == "portable":
        for other in ti.HOPPER_PROGRAMS:
            with pytest.raises(ValueError, match=f"the {other} program needs warp specialisation"):
                ti.sparse_mqa_kernel(64, True, True, False, "bfloat16", program=other)
    with pytest.raises(ValueError, match="program must be one of"):
        ti.sparse_mqa_kernel(64, True, True, False, "bfloat16", program="warp_specialized")
    use_settings(shared_p=True)  # MUSA_ATTN_SHARED_P: no register A operand anywhere, so no register P
    assert ti.sparse_mqa_program() == "portable"


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("split", [False, True])
def test_portable_sparse_mqa_compiles_for_sm90a(split):
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    src = ti.sparse_mqa_kernel(64, True, True, split, "bfloat16", target=HOPPER,
                               program="portable").get_kernel_source()
    assert src.count("tl::wgmma_ss<") >= 2  # Q K^T and P V, both from shared memory
    if split:
        comb = ti.combine_kernel(64, True, "bfloat16", target=HOPPER).get_kernel_source()
        assert "__global__" in comb


def test_tilelang_path_refuses_non_bf16_q():
    q, cache, idx, extra, xidx = _batch()
    with config.override(target="sm_90a"), pytest.raises(ValueError, match="q must be bfloat16"):
        ti.sparse_mqa_tilelang(q.half(), cache, idx)
    assert dsv4.MAX_HEADS == 128


def test_writer_glue_matches_the_programs(use_settings):
    use_settings(target="sm_90a")
    kernels = {}
    with _tilelang.intercepting(lambda key, build, target, pc: kernels.setdefault(key[0], SignatureCheck(build()))):
        cache = L.new_kv_cache(3, 64, page_stride=93888)
        wti.write_kv_v4_tilelang(torch.randn(5, 512).to(torch.bfloat16), cache, torch.arange(5))
        icache = dsv4.paged_view(torch.zeros(3, L.index_page_bytes(64), dtype=torch.uint8), 64, dsv4.INDEX_ROW_BYTES)
        wti.write_index_k_tilelang(torch.randn(5, 128).to(torch.bfloat16), icache, torch.arange(5, dtype=torch.int32))
    assert set(kernels) == {"dsv4_write_kv", "dsv4_write_index_k"}
    assert all(len(k.calls) == 1 for k in kernels.values())


def unguarded_cache_stores(source: str, caches=("C8", "CH", "CS", "CF")) -> list:
    """The lines of lowered CUDA ``source`` that store into a cache buffer with no enclosing ``if`` on the row's
    slot (``base_s``): the stores a skipped token (negative slot, block tail) would make."""
    store = re.compile(r"^\s*(\*\([^)]*\*\)\()?(%s)[\[ +]" % "|".join(caches))
    guard = re.compile(r"\(int64_t\)0 <= base_s\w*\[")  # the slot test itself, not a bounds check on an offset
    opened, bad = [], []  # the statement that opened each enclosing brace
    for line in source.splitlines():
        if store.match(line) and "=" in line and not any(guard.search(o) for o in opened):
            bad.append(line.strip())
        for ch in line:
            if ch == "{":
                opened.append(line)
            elif ch == "}" and opened:
                opened.pop()
    return bad


def test_unguarded_store_checker_sees_a_store_outside_the_guard():
    guarded = "if ((int64_t)0 <= base_s[i]) {\n  *(fp8_e4_16_t*)(C8 + u) = v;\n}\n"
    assert unguarded_cache_stores(guarded) == []
    # a bounds check on the unit (base_s plus an offset) is not the slot guard: a skipped row passes it
    bounds_only = "if ((int64_t)0 <= (u + base_s[i])) {\n  *(fp8_e4_16_t*)(C8 + u) = v;\n}\n"
    assert unguarded_cache_stores(bounds_only) == ["*(fp8_e4_16_t*)(C8 + u) = v;"]


# the default tilings, the ones the bench sweeps, and the shape TileLang 0.1.15 once lowered with the cast guarded
# but the store not (32 x 256)
WRITER_TILINGS = [(4, 128), (8, 128), (16, 256), (32, 256), (64, 256), (64, 512), (128, 512), (1, 64), (1, 32),
                  wti.WRITE_KV_TILING, wti.WRITE_INDEX_K_TILING]


@pytest.mark.parametrize("tiling", sorted(set(WRITER_TILINGS)))
def test_writer_tilings_lower_with_every_store_guarded(tiling):
    """Each writer tiling lowers for sm_90a, and every store into the cache in the lowered code sits under the
    row's slot guard: a skipped token writes nothing."""
    from musa_attn_backend.kernels.dsv4.writers.kernel import build_write_index_k, build_write_kv_v4

    for build in (build_write_kv_v4, build_write_index_k):
        src = _tilelang.lower(build("bfloat16", *tiling), HOPPER, wti._no_race_check()).source
        assert "__global__" in src
        assert unguarded_cache_stores(src) == [], f"{build.__name__} {tiling}"


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
def test_writers_compile_for_sm90a():
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    src = wti.write_kv_v4_kernel("bfloat16", target=HOPPER).get_kernel_source()
    assert "ceilf(log2f(" in src and "fp8_e4_t" in src  # the exponent rule, the e4m3 conversion
    assert "__global__" in wti.write_index_k_kernel("bfloat16", target=HOPPER).get_kernel_source()


def test_mp22_programs_decode_e4m3_without_fp8(use_settings):
    """MP22 has no FP8 conversion: its sparse MQA program reads the nope bytes as uint8 and decodes them by
    integer arithmetic (no e4m3 buffer anywhere), with P from shared memory; the writers say they are not
    supported there."""
    use_settings(target="mp_22")
    programs = []
    with _tilelang.intercepting(lambda key, build, target, pc: programs.append(build())):
        ti.sparse_mqa_kernel(64, True, True, False, "bfloat16")
    (func,) = programs
    assert "float8" not in func.script() and "uint8" in str(func.buffer_map[func.params[1]].dtype)
    assert not register_a_gemms(func)
    with pytest.raises(ValueError, match="need an FP8 conversion, which mp_22 lacks"):
        wti.write_kv_v4_tilelang(torch.zeros(1, 512, dtype=torch.bfloat16), L.new_kv_cache(1, 64), torch.arange(1))


@pytest.mark.parametrize("fp8_convert", [True, False])
def test_e4m3_decode_by_integer_arithmetic_compiles_for_sm90a(fp8_convert):
    """Both decodings build for sm_90a (the integer one is what MP22 runs; the GPU tests run it on the H200)."""
    if not NVCC and not in_ci():
        pytest.skip("nvcc not installed")
    from musa_attn_backend.kernels.dsv4.sparse.mqa_kernel import build_sparse_mqa

    kernel = _tilelang.compile_cached(("test_dsv4_int_decode", fp8_convert), lambda: build_sparse_mqa(
        64, True, True, False, fp8_convert=fp8_convert), target=HOPPER)
    src = kernel.get_kernel_source()
    assert ("fp8_e4_t" in src) == fp8_convert


# ---- the indexer's programs -------------------------------------------------------------------------------


def test_indexer_glue_matches_the_programs(use_settings):
    """Both logits launches hand their programs arguments of the parameters' dtypes and ranks, with the cache
    as views of its storage (a packed page stride)."""
    from musa_attn_backend.kernels.dsv4.indexer import tilelang_impl as it

    use_settings(target="sm_90a")
    kernels = {}
    with _tilelang.intercepting(lambda key, build, target, pc: kernels.setdefault(key, SignatureCheck(build()))):
        q = torch.randn(5, 64, 128).to(torch.float8_e4m3fn)
        k = torch.randn(70, 128).to(torch.float8_e4m3fn)
        se = torch.zeros(5, dtype=torch.int32)
        out = it.indexer_logits_tilelang(q, torch.randn(5, 64), k, torch.ones(70), se, se + 70, True)
        assert out.shape == (5, 70)
        buf = torch.zeros(3 * 93888, dtype=torch.uint8)
        cache = buf.as_strided((3, 64, L.INDEX_ROW_BYTES), (93888, L.INDEX_ROW_BYTES, 1))
        q4 = torch.randn(2, 2, 64, 128).to(torch.float8_e4m3fn)
        out = it.paged_indexer_logits_tilelang(q4, torch.randn(4, 64), cache, torch.ones(2, 2, dtype=torch.int32),
                                               torch.zeros(2, 3, dtype=torch.int32), 150, False)
        assert out.shape == (4, 150)
        logits = torch.randn(3, 700)[:, :600]  # a row stride past the columns
        lens = torch.full((3,), 600, dtype=torch.int32)
        assert it.indexer_topk_tilelang(logits, lens, 512, None, None, 64, None).shape == (3, 512)
        table = torch.zeros(3, 10, dtype=torch.int32)
        out = torch.empty(3, 1024, dtype=torch.int32)
        assert it.indexer_topk_tilelang(logits, lens, 1024, lens * 0, table, 64, out) is out
    assert {key[0] for key in kernels} == {"dsv4_indexer_logits", "dsv4_paged_indexer_logits", "dsv4_indexer_topk"}
    assert {key[1:] for key in kernels if key[0] == "dsv4_indexer_topk"} == {(512, 0), (1024, 64)}
    assert all(len(k.calls) == 1 for k in kernels.values())


@pytest.mark.parametrize("kind,args", [("prefill", (64, True)), ("prefill", (32, False)), ("paged", (64, 1, True)),
                                       ("paged", (64, 2, False))])
def test_indexer_programs_lower_for_sm90a_with_shared_operands(kind, args):
    """The logits programs lower for sm_90a with FP8 tensor-core GEMMs whose operands are both in shared memory
    (what MUSA MP31 lowers), and their key loads are bounds-checked copies."""
    from musa_attn_backend.kernels.dsv4.indexer.logits_kernel import build_indexer_logits, build_paged_indexer_logits

    func = (build_indexer_logits if kind == "prefill" else build_paged_indexer_logits)(*args)
    ops = gemm_operands(func)
    assert len(ops) == 1 and ops[0].a_scope.startswith("shared") and ops[0].b_scope.startswith("shared")
    src = _tilelang.lower(func, HOPPER, wti._no_race_check()).source
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3" in src
    assert "cp_async_gs_conditional" in src


@pytest.mark.parametrize("k,page_rows", [(512, 0), (1024, 64)])
def test_topk_program_lowers_for_sm90a(k, page_rows):
    """The top-k program lowers for sm_90a with its hand-placed barriers only (TileLang's automatic placement
    off), its histogram and output-slot atomics in shared memory, and NaN told apart on the bits."""
    from musa_attn_backend.kernels.dsv4.indexer import tilelang_impl as it
    from musa_attn_backend.kernels.dsv4.indexer.topk_kernel import build_indexer_topk

    src = _tilelang.lower(build_indexer_topk(k, page_rows), HOPPER, it._topk_pass_configs()).source
    assert src.count("__syncthreads()") == 16 and "AtomicAddRet((&(count[0]))" in src
    # every returning atomic is stored once and its value reused: a let-bound result is inlined by TileLang
    # 0.1.12 into each use, each use a new atomic
    rets = [line.strip() for line in src.splitlines() if "AtomicAddRet" in line]
    assert len(rets) == 6 and all(re.fullmatch(r"slot\[0\] = AtomicAddRet\(\(&\(count\[[012]\]\)\), 1\);", r)
                                  for r in rets), rets
    # the NaN test survived simplification
    assert re.search(r"\(uint\)2139095040 < \(bits\[\w+\] & \(uint\)2147483647\)", src)
    assert ("table[" in src) == (page_rows > 0)


def test_indexer_kernels_refuse_a_target_without_fp8(use_settings):
    from musa_attn_backend.kernels.dsv4.indexer import tilelang_impl as it

    use_settings(target="mp_22")
    q = torch.randn(1, 64, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 GEMMs, which mp_22 lacks"):
        it.indexer_logits_tilelang(q, torch.randn(1, 64), q[0], torch.ones(64), torch.zeros(1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), True)


# ---- the compressors' programs ----------------------------------------------------------------------------


@pytest.mark.parametrize("ratio,d,state_dims", [(4, 512, 3), (128, 128, 2)])
def test_compressor_glue_matches_the_programs(use_settings, ratio, d, state_dims):
    """The compressor's two launches get arguments of their parameters' dtypes and ranks (the state as a flat
    view of a packed 3-D buffer or a 2-D ring)."""
    from musa_attn_backend.kernels.dsv4.compressor.tilelang_impl import compress_tilelang

    use_settings(target="sm_90a")
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * d
    T = 8
    state = (torch.zeros(6 * (4 * width + 16)).as_strided((6, 4, width), (4 * width + 16, width, 1))
             if state_dims == 3 else torch.zeros(300, width))  # vLLM's packed blocks, SGLang's ring
    cache = L.new_kv_cache(2, 64) if d == 512 else dsv4.paged_view(
        torch.zeros(2, L.index_page_bytes(64), dtype=torch.uint8), 64, L.INDEX_ROW_BYTES)
    kernels = {}
    with _tilelang.intercepting(lambda key, build, target, pc: kernels.setdefault(key[0], SignatureCheck(build()))):
        rows = compress_tilelang(
            torch.randn(T, width), torch.zeros(ratio, coff * d), ratio, torch.arange(T),
            torch.zeros(T, dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32),
            torch.tensor([T], dtype=torch.int32), state, torch.zeros(1, 4, dtype=torch.int32), 4, 4, torch.ones(d), 1e-6,
            torch.ones(16, 32), torch.zeros(16, 32), cache, torch.arange(T), state_rows=None, state_has_ape=True,
            rotate=d == 128, index_scale="exact", return_rows=True)
    assert rows.shape == (T, d)
    assert set(kernels) == {"dsv4_compress_rows", "dsv4_save_state"}
    assert all(len(k.calls) == 1 for k in kernels.values())


@pytest.mark.parametrize("args", [(512, 4, False, True, "bfloat16"), (512, 128, False, False, "bfloat16"),
                                  (128, 4, True, False, "float32"), (128, 4, False, True, "bfloat16")])
def test_compressor_programs_lower_for_sm90a(args):
    from musa_attn_backend.kernels.dsv4.compressor.kernel import build_compress_rows, build_save_state
    from musa_attn_backend.kernels.dsv4.compressor.tilelang_impl import _pass_configs

    src = _tilelang.lower(build_compress_rows(*args), HOPPER, _pass_configs()).source
    # the hand-placed barriers only: after the window's slots are located, before the row's store (the row may
    # share the slots' memory), two for the norm, one for RoPE, and one more for the Hadamard
    assert src.count("__syncthreads()") == (7 if args[2] else 6)
    for from_table in (False, True):
        assert "__global__" in _tilelang.lower(build_save_state(2 * (2 if args[1] == 4 else 1) * args[0], args[1],
                                                                args[3], from_table), HOPPER).source


def test_exact_scale_index_writer_lowers_with_every_store_guarded():
    from musa_attn_backend.kernels.dsv4.writers.kernel import build_write_index_k

    src = _tilelang.lower(build_write_index_k("float32", *wti.WRITE_INDEX_K_TILING, exact=True), HOPPER,
                          wti._no_race_check()).source
    assert unguarded_cache_stores(src) == [] and "log2f" not in src  # no power-of-two rounding


@pytest.mark.parametrize("rotate,pow2,bf16_rope", [(True, False, False), (False, True, True)])
def test_indexer_q_program_lowers_and_matches_its_glue(use_settings, rotate, pow2, bf16_rope):
    from musa_attn_backend.kernels.dsv4.indexer import tilelang_impl as it
    from musa_attn_backend.kernels.dsv4.indexer.q_kernel import build_indexer_q

    src = _tilelang.lower(build_indexer_q(64, "bfloat16", rotate, pow2, bf16_rope), HOPPER,
                          it._topk_pass_configs()).source
    assert src.count("__syncthreads()") == (6 if rotate else 5) and ("log2f" in src) == pow2
    use_settings(target="sm_90a")
    kernels = {}
    with _tilelang.intercepting(lambda key, build, target, pc: kernels.setdefault(key, SignatureCheck(build()))):
        q8, w = it.indexer_q_tilelang(torch.randn(3, 64, 128).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16),
                                      torch.arange(3), torch.ones(8, 32), torch.zeros(8, 32), 0.01, rotate,
                                      "pow2" if pow2 else "exact", bf16_rope)
    assert q8.dtype == torch.float8_e4m3fn and w.shape == (3, 64)
    assert [len(k.calls) for k in kernels.values()] == [1]


def test_model_op_glue_matches_the_programs(use_settings):
    """The model-side ops' TileLang glue against the programs' signatures: q norm + RoPE, the in-place RoPE of a
    strided view, the K norm + RoPE, the SWA store's norm + RoPE, the clamped SwiGLU, mHC before a sublayer (with
    the fused norm), before the head, and after a sublayer."""
    from musa_attn_backend.kernels.dsv4 import model
    from musa_attn_backend.kernels.dsv4.model import tilelang_impl as mt

    use_settings(target="sm_90a")
    kernels = {}
    with _tilelang.intercepting(lambda key, build, target, pc: kernels.setdefault(key, SignatureCheck(build()))):
        T, H = 5, 8
        cos, sin, pos = torch.randn(64, 32), torch.randn(64, 32), torch.arange(T)
        y = mt.norm_rope_rows(torch.randn(T, H, 512).to(torch.bfloat16), None, 1e-6, cos, sin, pos, norm="plain",
                              round_mid=True, inverse=False, out_dtype=torch.bfloat16)
        assert y.shape == (T, H, 512) and y.is_contiguous()
        o = torch.randn(T, H, 512).to(torch.bfloat16)
        rot = mt.norm_rope_rows(o[..., -64:], None, None, cos, sin, pos, norm="none", round_mid=False,
                                inverse=True, out_dtype=torch.bfloat16)
        assert rot.shape == (T, H, 64)
        mt.norm_rope_rows(torch.randn(T, 1, 512), torch.ones(512), 1e-6, cos, sin, pos, norm="weight",
                          round_mid=False, inverse=False, out_dtype=torch.bfloat16)
        assert mt.silu_mul_clamp(torch.randn(T, 2 * 300).to(torch.bfloat16), 10.0).shape == (T, 300)
        R = torch.randn(T, 4, 256).to(torch.bfloat16)
        post, comb, y = mt.mhc_pre_rows(torch.randn(T, 24), torch.ones(3), torch.zeros(24), R, iters=20, head=False,
                                        pre_eps=1e-6, sk_eps=1e-6, post_mult=2.0, norm_weight=torch.ones(256),
                                        norm_eps=1e-6)
        assert post.shape == (T, 4) and comb.shape == (T, 4, 4) and y.shape == (T, 256)
        mt.mhc_pre_rows(torch.randn(T, 4), torch.ones(1), torch.zeros(4), R, iters=1, head=True, pre_eps=1e-6,
                        sk_eps=0.0, post_mult=0.0)
        assert mt.mhc_post_rows(y, R, post, comb).shape == R.shape
    assert {k[0] for k in kernels} == {"dsv4_norm_rope", "dsv4_silu_mul_clamp", "dsv4_mhc_pre", "dsv4_mhc_post"}
    assert len(kernels) == 7
    assert all(len(k.calls) == 1 for k in kernels.values())
    with pytest.raises(ValueError, match="impl='tilelang' needs the tensors on a CUDA or MUSA device"):
        model.silu_and_mul_clamp(torch.randn(2, 8), 10.0, impl="tilelang")


@pytest.mark.parametrize("args", [(512, 64, "bfloat16", "bfloat16", "plain", True, False),
                                  (64, 128, "bfloat16", "bfloat16", "none", False, True),
                                  (512, 1, "float32", "bfloat16", "weight", False, False)])
def test_model_programs_lower_for_sm90a(args):
    """The norm + RoPE program lowers for sm_90a with its hand-placed barriers only (the norm: the squares, the
    tree's loop, the read of the sum; the RoPE exchange: one); the SwiGLU program has none."""
    from musa_attn_backend.kernels.dsv4.model import tilelang_impl as mt
    from musa_attn_backend.kernels.dsv4.model.kernel import build_norm_rope, build_silu_mul_clamp

    from musa_attn_backend.kernels.dsv4.model.kernel import build_mhc_post, build_mhc_pre

    src = _tilelang.lower(build_norm_rope(*args), HOPPER, mt.pass_configs()).source
    D = args[0]
    assert src.count("__syncthreads()") == (4 if args[4] != "none" else 1)
    assert f"for (int s = 0; s < {D.bit_length() - 1}; ++s)" in src or args[4] == "none"
    silu = _tilelang.lower(build_silu_mul_clamp(2048, "bfloat16"), HOPPER).source
    assert "__global__" in silu and "__syncthreads()" not in silu
    # mHC: the fused norm's tree is the only exchange (two barriers in the text: before it and in its loop)
    for head, norm in ((False, True), (False, False), (True, False)):
        pre = _tilelang.lower(build_mhc_pre(4, 4096, 20, head, norm, "bfloat16"), HOPPER, mt.pass_configs()).source
        assert pre.count("__syncthreads()") == (2 if norm else 0)
    assert "__global__" in _tilelang.lower(build_mhc_post(4, 4096, "bfloat16"), HOPPER).source


def test_attention_slots_glue_matches_the_program(use_settings):
    """The slot translation's glue against its program's signature, for each mode (window only, C4, C128)."""
    use_settings(target="sm_90a")
    kernels = {}
    T = 5
    pos, req = torch.arange(T) * 40, torch.tensor([0, 1, 1, -1, 0], dtype=torch.int32)
    table = torch.randint(0, 9, (2, 4), dtype=torch.int32)
    with _tilelang.intercepting(lambda key, build, target, pc: kernels.setdefault(key, SignatureCheck(build()))):
        for ratio, extra in ((1, {}), (4, dict(main_table=table, main_rows=64, topk_local=torch.zeros(T, 16,
                                                                                                  dtype=torch.int32))),
                             (128, dict(main_table=table, main_rows=2, width=3))):
            win, comp = mti.attention_slots_tilelang(pos, req, table, 64, 128, ratio, extra.get("main_table"),
                                                    extra.get("main_rows", 0), extra.get("topk_local"),
                                                    extra.get("width", 0))
            assert win.shape == (T, 128) and (comp is None) == (ratio == 1)
            assert comp is None or comp.shape == (T, 16 if ratio == 4 else 3)
    assert {k[1:] for k in kernels} == {(128, 1), (128, 4), (128, 128)}
    assert all(len(k.calls) == 1 for k in kernels.values())


@pytest.mark.parametrize("mode", [4, 128])
def test_attention_slots_program_lowers_for_sm90a(mode):
    from musa_attn_backend.kernels.dsv4.model.slots_kernel import build_attention_slots

    src = _tilelang.lower(build_attention_slots(128, mode), HOPPER).source
    assert "attention_slots" in src and "__syncthreads()" not in src  # a pure map: no exchange


def _ptxas_spills(src: str, tmp_path, headers=()) -> tuple:
    """(spill store bytes, registers) ptxas reports for the CUDA source TileLang generated, built for sm_90a
    (``headers`` force-included)."""
    import os
    import subprocess

    import tilelang

    root = os.path.dirname(tilelang.__file__)
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    res = subprocess.run([nvcc_path(), "-arch=sm_90a", "-cubin", "-std=c++17", "-O3", "-w", "-I" + root + "/src",
                          "-I" + root + "/3rdparty/cutlass/include", "-DENABLE_BF16", "-DENABLE_FP8",
                          "--use_fast_math", "-Xptxas", "-v", *[f for h in headers for f in ("-include", str(h))],
                          str(cu), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    return (int(spills.group(1)) if spills else 0), int(regs.group(1))


@pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")
@pytest.mark.parametrize("rows_at_once", [2, 1])
def test_paired_program_builds_within_its_registers(tmp_path, rows_at_once):
    """The paired program for sm_90a at its default split: math groups at 200 registers, the producer at 104 (3 x
    168 in all), either producer order spilling at most 64 bytes (the 208/88 split spilled 248 with two rows held,
    what the H100's ncu showed)."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk

    func = pk.build_sparse_mqa_paired.__wrapped__(64, True, True, "bfloat16", rows_at_once)
    src = _tilelang.lower(func, HOPPER, ti._ws_pass_configs()).source
    assert "warpgroup_reg_alloc<200>" in src and "warpgroup_reg_dealloc<104>" in src
    spills, regs = _ptxas_spills(src, tmp_path)
    assert regs == 168
    assert spills <= 64, spills
