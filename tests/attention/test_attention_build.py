"""CI proves the kernel toolchain works: TileLang lowers the attention kernels and nvcc compiles them for
sm_90a, here, without a GPU (the GPU tests run them)."""

import re

import pytest

from musa_attn_backend.testing.toolchain import HOPPER, in_ci, nvcc_path

NVCC = nvcc_path()

pytestmark = pytest.mark.skipif(not NVCC and not in_ci(), reason="nvcc not installed (CI requires it)")


@pytest.mark.parametrize("block_n", [128, 64])
def test_prefill_tma_tiles_compile_for_sm90a(block_n):
    """The whole-page prefill path (pages of 64+ tokens) lowers its tile loads to TMA on Hopper."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend._tilelang import compile_cached
    from musa_attn_backend.kernels.attention.prefill_kernel import build_prefill

    lay = (2 * 128, 2 * 128, 128)  # 2 KV heads, head dim 128, SGLang pool rows
    key = ("test_prefill_tma", block_n)
    kernel = compile_cached(key, lambda: build_prefill.__wrapped__(
        8, 2, 128, 128, "bfloat16", "bfloat16", True, False, False, False, False, lay, lay,
        128, block_n, 2, 256, True), target=HOPPER)
    src = kernel.get_kernel_source()
    assert "tma_load" in src, "tile loads did not lower to TMA"
    assert "cp_async" not in src  # no row gathers left in this variant


@pytest.mark.parametrize("block_n,causal,softcap", [(128, True, False), (64, False, True)])
def test_prefill_pingpong_compiles_for_sm90a(block_n, causal, softcap):
    """The warp-specialised ping-pong prefill: TMA producer, asynchronous WGMMAs waited on by count (the P V
    of the previous tile stays in flight during the softmax), turns taken through named barriers."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend._tilelang import compile_cached
    from musa_attn_backend.kernels.attention.prefill_pingpong_kernel import build_prefill_pingpong

    lay = (2 * 128, 2 * 128, 128)
    key = ("test_prefill_pingpong", block_n, causal, softcap)
    kernel = compile_cached(key, lambda: build_prefill_pingpong.__wrapped__(
        8, 2, 128, 128, "bfloat16", causal, softcap, True, lay, lay, block_n, 2), target=HOPPER)
    src = kernel.get_kernel_source()
    assert "__launch_bounds__(384" in src
    assert src.count("tma_load") >= 3 and "cp_async" not in src
    assert "wait_wgmma<1>" in src, "no MMA left in flight across the softmax"
    assert "warpgroup_reg_alloc<240>" in src and "warpgroup_reg_dealloc<24>" in src
    assert re.search(r"__sync_thread_partial\(5, 256\)", src) and re.search(r"__named_barrier_arrive\(6, 256\)", src)
    # the page table: read once per 32 tiles, a tile's cache row per lane of the producer warp, handed to the
    # lane issuing the tile's copies by a shuffle (not one dependent read per tile before its copies)
    assert src.count("page_table[") == 1 and re.search(r"if \(\(k % 32\) == 0\)", src) and "__shfl_sync(" in src


@pytest.mark.parametrize("d,causal", [(128, True), (64, False)])
def test_prefill_pingpong_gather_compiles_for_sm90a(d, causal):
    """The ping-pong prefill with a gathering producer (any page size; the default where pages hold no whole key
    tile), built through the launcher with its compile options: explicit cp.async row copies that arrive on the
    full barriers, unpredicated (rows are clamped into the sequence, so TileLang's bounds checks are compiled
    out), a proxy fence before the consumers' WGMMAs read them, and no syncs besides the producer's one per tile
    and the consumers' turn-taking."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    lay = (2 * d, 2 * d, d)
    spec = ti.AttnSpec(8, 2, d, d, "bfloat16", "bfloat16", False, False, True, lay, lay)
    cfg = ti.PrefillConfig(block_M=128, block_N=128, num_stages=2, threads=384, tma=False, pingpong=True)
    src = ti.prefill_kernel(spec, causal, 16, target=HOPPER, cfg=cfg).get_kernel_source()
    assert "cp_async_gs<16>" in src and "mbarrier_cp_async_arrive_noinc" in src
    assert "cp_async_gs_conditional" not in src
    assert "tma_load(Q_desc" in src and "tma_load(KC_desc" not in src
    assert "fence_proxy_async" in src and "wait_wgmma<1>" in src
    assert "warpgroup_reg_alloc<232>" in src and "warpgroup_reg_dealloc<40>" in src
    assert set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", src)) == {("5", "256"), ("6", "256"), ("7", "128")}


@pytest.mark.parametrize("pdl", [True, False])
def test_decode_and_combine_compile_for_sm90a(pdl, use_settings):
    """The split-KV decode kernel and its combine, as the launcher builds them for sm_90a: the row copies of a
    tile follow each other with no block barrier between them (the resolved rows live in static shared memory,
    apart from the tiles), and the combine is a programmatic dependent launch of the decode (the decode
    triggers it as it starts, the combine waits for the decode grid before it reads a partial), unless
    ``MUSA_ATTN_PDL=0``."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(pdl=pdl)
    lay = (2 * 128, 2 * 128, 128)
    spec = ti.AttnSpec(8, 2, 128, 128, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)
    src = ti.decode_kernel(spec, ti.decode_config(1, 4), True, target=HOPPER).get_kernel_source()
    assert src.count("cp_async_gs_conditional<16>") >= 2
    assert not re.search(r"__syncthreads\(\);\s*tl::cp_async_gs", src), "a barrier before a row copy"
    assert re.search(r"__shared__ [^;]*int slot_s\[512\];", src), "rows in static shared memory"
    assert ("cudaTriggerProgrammaticLaunchCompletion();" in src) == pdl
    comb = ti.combine_kernel(spec, target=HOPPER).get_kernel_source()
    assert ("cudaGridDependencySynchronize();" in comb) == pdl
    if pdl:  # before the first read of a partial
        assert comb.index("cudaGridDependencySynchronize") < comb.index("L_part[")
    # the default combine: LSEs at once, partials 8 splits at a time; MUSA_ATTN_CHUNKED_COMBINE=0: one by one
    assert "lse_s[" in comb and re.search(r"for \(int j\w* = 0; j\w* < 8; \+\+j\w*\)", comb)
    use_settings(chunked_combine=False)
    serial = ti.combine_kernel(spec, target=HOPPER).get_kernel_source()
    assert "lse_s[" not in serial and ("cudaGridDependencySynchronize();" in serial) == pdl
    use_settings(chunked_combine=True)
    unsplit = ti.decode_kernel(spec, ti.decode_config(1, 4), False, target=HOPPER).get_kernel_source()
    assert "cudaTriggerProgrammaticLaunchCompletion" not in unsplit  # nothing depends on it


def test_prefill_pingpong_page_chunks_compile_for_sm90a(use_settings):
    """The ping-pong prefill with TMA copies of page chunks (for pages of 16 tokens a tuning candidate; the
    default for 64 with 64-row chunks): per 128-key tile the producer takes 8 cache rows (read from the page
    table for 4 tiles at once, one per lane) before the stage is free, then issues 16-row boxes (one per 64-column swizzle block) into the tile's rows,
    with the same 128-byte swizzle as the whole-tile copies the consumers' WGMMAs expect."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(target="sm_90a")
    lay = (2 * 2 * 128, 2 * 2 * 128, 128)  # vLLM's K|V rows: K and V share a row, V 128 elements in
    spec = ti.AttnSpec(8, 2, 128, 128, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)
    cfg = next(c for c in ti.prefill_candidates(128, 128, page_size=16) if c.tma_rows and c.num_stages == 2)
    assert cfg.tma and cfg.pingpong and cfg.tma_rows == 16 and cfg.block_N == 128
    src = ti.prefill_kernel(spec, True, 16, target=HOPPER, cfg=cfg).get_kernel_source()
    assert "int rows[8];" in src
    assert src.count("expect_transaction(2048)") == 2  # K and V: one 16 x 64 box per copy
    k_loads = re.findall(r"tma_load\(KC_desc, k_full\[[^\]]*\], \(&\(\(\(bfloat16_t\*\)K_s\)\[([^\]]*)\]\)\)", src)
    assert len(k_loads) == 1 and "* 1024)" in k_loads[0] and "* 8192)" in k_loads[0]  # chunk row / column block
    # the rows are read before the producer waits for the stage
    assert src.index("rows[c] =") < src.index("k_empty[(k & 1)].wait(")
    assert "warpgroup_reg_dealloc<40>" in src
    # page 64 (the default there): 64-row chunks, two per 128-key tile, 64 x 64 boxes, 3 stages
    cfg64 = ti.prefill_config(128, 128, page_size=64)
    assert cfg64.tma_rows == 64 and cfg64.block_N == 128 and cfg64.num_stages == 3
    src = ti.prefill_kernel(spec, True, 64, target=HOPPER, cfg=cfg64).get_kernel_source()
    assert "int rows[2];" in src and src.count("expect_transaction(8192)") == 2
    assert src.count("page_table[") == 1 and re.search(r"if \(\(k % 16\) == 0\)", src)  # 2 chunks / tile


def test_prefill_new_kv_compiles_for_sm90a(use_settings):
    """The prefill reading the batch's new K/V rows instead of the cache, for batches without cached prefixes
    (default; ``MUSA_ATTN_NEW_KV_PREFILL=0`` turns it off): the TMA ping-pong kernel of pages of 128, its K/V
    tiles copied from row ``cu_seqlens_q[b] + 128 k`` of the new K/V (SGLang's strided views of a fused QKV
    projection too), the page table not read."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    import dataclasses

    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(target="sm_90a", new_kv_prefill=False)
    assert ti.new_kv_prefill_config(128, 128) is None  # switched off
    use_settings(new_kv_prefill=True)  # the default
    cfg = ti.new_kv_prefill_config(128, 128)
    assert cfg == ti.prefill_config(128, 128, page_size=128) and cfg.tma and cfg.pingpong and not cfg.tma_rows
    assert ti.new_kv_prefill_config(128, 128, has_window=True) is None
    wide = ti.new_kv_prefill_config(256, 256)  # no ping-pong kernel at head dim 256: TMA tiles
    assert wide == ti.prefill_config(256, 256, page_size=128) and wide.tma and not wide.pingpong
    lay = (8 * 128 + 2 * 2 * 128, 8 * 128 + 2 * 2 * 128, 128)  # rows of a fused [q | k | v] projection
    spec = ti.AttnSpec(8, 2, 128, 128, "bfloat16", "bfloat16", k_layout=lay, v_layout=lay)
    src = ti.prefill_kernel(spec, True, 1, target=HOPPER, cfg=cfg, ragged=True).get_kernel_source()
    paged = ti.prefill_kernel(dataclasses.replace(spec), True, 128, target=HOPPER, cfg=cfg).get_kernel_source()
    assert "page_table[" in paged and "page_table[" not in src
    # K and V: two 64-column boxes per tile, at row q0 (the request's first new token) + 128 k
    loads = re.findall(r"tma_load\([KV]C_desc, [kv]_full\[[^\]]*\], [^;]*;", src)
    assert len(loads) == 4 and all(x.endswith(", ((k * 128) + q0));") for x in loads), loads
    assert src.count("tma_load") == paged.count("tma_load") and "cp_async" not in src
    # the TMA-tile kernel of other platforms (TileLang's own warp specialisation; MUSA MP31's TME tiles) the same
    spec256 = ti.AttnSpec(8, 2, 256, 256, "bfloat16", "bfloat16", k_layout=(512, 2 * 512 + 8 * 256, 256),
                          v_layout=(512, 2 * 512 + 8 * 256, 256))
    src = ti.prefill_kernel(spec256, True, 1, target=HOPPER, cfg=wide, ragged=True).get_kernel_source()
    assert "page_table[" not in src and "tma_load" in src and "cp_async" not in src
    loads = re.findall(r"tma_load\([KV]C_desc, [^;]*;", src)  # 4 boxes of 64 columns each for K and V
    assert len(loads) == 8 and all(x.endswith(", ((k * 64) + q0));") for x in loads), loads
    use_settings(target="mp_31")
    musa = ti.new_kv_prefill_config(128, 128)
    assert musa is not None and musa.tma and not musa.pingpong
    use_settings(target="sm_80")
    assert ti.new_kv_prefill_config(128, 128) is None  # no bulk copies: the cache path


@pytest.mark.parametrize("kind", ["prefill_tma", "prefill_fp8_gather", "decode_64_rows"])
def test_shared_p_variants_compile_for_sm90a(kind, use_settings):
    """The programs MUSA gets (P through shared memory before the P V product), built for sm_90a through the
    launcher with ``MUSA_ATTN_SHARED_P=1``, so CI compiles them with nvcc and the H200 runs them: the scores are
    written to the shared P tile and the second WGMMA reads both operands from shared memory."""
    assert NVCC, "nvcc is required in CI to compile TileLang kernels for sm_90a"
    from musa_attn_backend.kernels.attention import tilelang_impl as ti

    use_settings(target="sm_90a", shared_p=True)
    lay = (2 * 128, 2 * 128, 128)
    fp8 = kind == "prefill_fp8_gather"
    spec = ti.AttnSpec(8, 2, 128, 128, "bfloat16", "float8_e4m3" if fp8 else "bfloat16", k_layout=lay, v_layout=lay)
    if kind == "decode_64_rows":
        dcfg = ti.decode_config(8, 4)  # 8 tokens x 4 heads a KV head
        assert dcfg.block_M == 64
        src = ti.decode_kernel(spec, dcfg, True, target=HOPPER).get_kernel_source()
    else:
        page = 128 if kind == "prefill_tma" else 16
        cfg = ti.prefill_config(128, 128, fp8, page)
        assert not cfg.pingpong and cfg.tma == (kind == "prefill_tma")
        src = ti.prefill_kernel(spec, True, page, target=HOPPER, cfg=cfg).get_kernel_source()
    # both products are warp-group MMAs from shared memory (ss; with P in registers the second is rs), the
    # second reading the P tile
    assert src.count("tl::wgmma_ss<") >= 2 and "wgmma_rs" not in src
    assert "initialize_wgmma_descriptor<1, 1, 64>(desc_a_1, (&(((bfloat16_t*)P_s)[0])))" in src
