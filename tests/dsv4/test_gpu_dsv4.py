"""DeepSeek-V4 sparse MQA on the GPU: the TileLang kernel against the float32 reference on the same caches.
Caches in both engines' geometries (SGLang's 256-row SWA pages, vLLM's 64-row pages packed in larger physical
blocks, C4's 64 rows, C128's 2), NaN in every byte of every row no entry selects, 20% invalid entries plus some at
or past the slot count, ragged lengths, NaN-poisoned outputs. Tolerances: bf16 output against the float32
reference, atol = rtol = 2e-2 (values of order 1); LSE atol 2e-3."""

import random

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L

pytestmark = pytest.mark.gpu


def filled_cache(pages, rows, device, seed, stride=0, fill=0.5):
    """A cache whose bytes are all 0xFF (NaN) but for ``fill`` of its slots, written with random rows; returns
    (cache, written slots)."""
    cache = L.new_kv_cache(pages, rows, device, page_stride=stride)
    torch.as_strided(cache, (cache.untyped_storage().nbytes(),), (1,), 0).fill_(0xFF)
    n = pages * rows
    slots = torch.tensor(random.Random(seed).sample(range(n), max(1, int(n * fill))), device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = torch.randn(len(slots), 512, generator=g).to(torch.bfloat16).to(device)
    dsv4.write_kv_v4(kv, cache, slots, impl="reference")
    return cache, slots


def make_indices(slots, T, K, n_slots, seed, device):
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(slots), (T, K), generator=g)
    idx = slots.cpu()[pick].to(torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    if K > 2:
        idx[:, 0] = n_slots  # at the slot count: invalid
        idx[0, 1] = n_slots + 12345
    lens = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
    lens[0] = K
    return idx.to(device), lens.to(device)


CASES = [
    # heads, tokens, (swa pages, rows, stride), K1, (extra pages, rows, stride) or None, K2, sink
    (64, 3, (8, 256, 0), 128, (40, 64, 0), 512, True),  # SGLang, C4 decode
    (128, 2, (20, 64, 93888), 128, (60, 2, 93888), 1024, True),  # vLLM packed blocks, C128-like rows
    (16, 37, (20, 64, 93888), 128, (40, 64, 93888), 2048, True),
    (32, 6, (20, 64, 93888), 128, (40, 64, 93888), 512, True),  # V4-Flash's heads a rank at TP 2, 64-token blocks
    (8, 5, (8, 256, 0), 128, None, 0, False),  # SWA-only layer, no sink
    (64, 300, (8, 256, 0), 128, (40, 64, 0), 512, True),  # prefill-like: many tokens, no split
    (24, 9, (8, 256, 0), 100, (40, 64, 0), 70, True),  # K1/K2 not multiples of 64, odd heads
    (96, 7, (8, 256, 0), 128, (40, 64, 0), 512, True),  # two head blocks, the second half padded
    (128, 1, (4, 256, 0), 128, (30, 64, 0), 1024, True),  # Pro decode, one token: many splits
    (8, 16384, (80, 256, 0), 128, None, 0, True),  # a 16k-token prefill
    # FlashMLA's sinks: +inf (output 0, LSE of the keys alone) and -inf in some heads, split at a small batch
    (64, 4, (8, 256, 0), 128, (40, 64, 0), 512, "inf"),
    (128, 3, (20, 64, 93888), 128, (60, 2, 93888), 1024, "inf"),
]
# program[:producer]; "portable:musa": the portable program in MUSA's form (K and V tiles of their own, 32 rows:
# MUSA_ATTN_MUSA_FORMS, docs/musa.md)
PROGRAMS = ("scheduled", "scheduled:cluster", "paired", "paired:rows1", "paired_ws", "paired_ws:plain",
            "portable", "portable:musa", "portable_ws", "portable_ws:musa", "portable_ws:gather",
            "portable_ws:musa_gather", "staged_ws", "staged_ws:overlap")


@pytest.fixture(params=PROGRAMS)
def program(request, monkeypatch, use_settings):
    """Each sparse MQA program on this GPU (the portable one is what MUSA runs; all build here), the scheduled
    one's clustered form (its 65-128-head cases), both producers of the paired one, the paired division over a bf16
    workspace (its default build, and ``plain``: every build switch off, the paired order of its math groups),
    the portable one in MUSA's form (over the workspace: its rows prefetched into registers by default, or
    ``gather``ed in turn), and the staged one (MUSA's rules on every target)."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    name, _, producer = request.param.partition(":")
    if producer.endswith("gather"):  # the portable_ws program's rows gathered in turn (its default prefetches)
        from musa_attn_backend.kernels.dsv4.sparse import portable_ws_kernel

        monkeypatch.setattr(portable_ws_kernel, "PREFETCH", False)
        producer = producer[:-len("gather")].rstrip("_")
    if producer == "overlap":  # the staged program's next scores issued beside its P V (OVERLAP)
        from musa_attn_backend.kernels.dsv4.sparse import staged_ws_kernel

        monkeypatch.setattr(staged_ws_kernel, "OVERLAP", True)
        producer = ""
    if producer == "musa":
        use_settings(musa_forms=True)
        producer = ""
    if producer == "cluster":  # the scheduled program's 65-128-head form: the two head blocks a cluster, at
        monkeypatch.setattr(tilelang_impl, "SCHED_CLUSTER", True)  # every token count
        monkeypatch.setattr(tilelang_impl, "SCHED_CLUSTER_MIN_TOKENS", 0)
        producer = ""
    elif name == "scheduled":  # the unclustered form at every token count
        monkeypatch.setattr(tilelang_impl, "SCHED_CLUSTER", False)
    if producer == "rows1":  # the paired program's producer holding one row of bytes at a time
        from musa_attn_backend.kernels.dsv4.sparse import paired_kernel

        monkeypatch.setattr(paired_kernel, "PRODUCER_ROWS_AT_ONCE", 1)
        producer = ""
    if producer == "plain":  # the paired_ws program with every build switch off
        _ws_variant(monkeypatch, "paired")
        producer = ""
    monkeypatch.setattr(tilelang_impl, "sparse_mqa_program", lambda target=None: name)
    return request.param


@pytest.mark.parametrize("heads,T,swa,K1,extra,K2,with_sink", CASES)
def test_sparse_mqa_matches_reference(gpu_device, program, heads, T, swa, K1, extra, K2, with_sink):
    check_case(gpu_device, heads, T, swa, K1, extra, K2, with_sink)


def check_case(dev, heads, T, swa, K1, extra, K2, with_sink):
    cache, slots = filled_cache(*swa[:2], dev, seed=heads + T, stride=swa[2])
    idx, lens = make_indices(slots, T, K1, swa[0] * swa[1], seed=T, device=dev)
    kw = {}
    if extra is not None:
        xcache, xslots = filled_cache(*extra[:2], dev, seed=K2, stride=extra[2])
        xidx, xlens = make_indices(xslots, T, K2, extra[0] * extra[1], seed=K2 + 1, device=dev)
        kw = dict(extra_cache=xcache, extra_indices=xidx, extra_lengths=xlens)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(T, heads, 512, generator=g).to(torch.bfloat16).to(dev)
    sink = torch.randn(heads, generator=g).to(dev) if with_sink else None
    if with_sink == "inf":
        sink[::3] = float("inf")
        sink[1::3] = float("-inf")
    ref, ref_lse = dsv4.sparse_mqa(q, cache, idx, lens, sink=sink, return_lse=True, impl="reference", **kw)
    out = torch.full_like(q, float("nan"))
    got, lse = dsv4.sparse_mqa(q, cache, idx, lens, sink=sink, return_lse=True, out=out, impl="tilelang", **kw)
    assert got is out and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("pages,rows,stride", [(80, 256, 0), (60, 2, 93888), (40, 64, 93888)])
def test_workspace_rows_kernel_is_the_reference_reader(gpu_device, pages, rows, stride):
    """The paired_ws program's gather of cache rows (``workspace_kernel``) against the reference reader, bit for
    bit, with repeated slots; invalid ones (negative, past the slots) read as zeros."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl
    from musa_attn_backend.kernels.dsv4.writers.reference import read_kv_v4_reference

    cache, written = filled_cache(pages, rows, gpu_device, seed=pages, stride=stride)
    n = pages * rows
    slots = written[torch.randint(0, len(written), (3001,), generator=torch.Generator().manual_seed(1))].to(gpu_device)
    got = tilelang_impl._read_rows("test")(cache, slots.int(), "cache")
    assert torch.equal(got.view(torch.int16), read_kv_v4_reference(cache, slots.long()).view(torch.int16))
    bad = torch.tensor([-1, n, n + 5, -(1 << 30)], dtype=torch.int32, device=gpu_device)
    assert (tilelang_impl._read_rows("test")(cache, bad, "cache") == 0).all()


def _ws_variant(monkeypatch, variant: str) -> None:
    from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel

    on = set() if variant == "paired" else set(variant.split("+"))  # paired_ws_kernel.SWITCHES' names
    for name, attr in paired_ws_kernel.SWITCHES.items():
        monkeypatch.setattr(paired_ws_kernel, attr, name in on)


def _flash_mla_prefill_case(gpu_device, H, S, S_kv, K):
    """A FlashMLA sparse prefill call's arguments ``((q, kv, indices, scale), sink, topk_length)``: ragged topk
    lengths (some zero), invalid entries (negative, at or past s_kv), NaN rows nobody selects, sinks of +-inf in
    some heads."""
    g = torch.Generator().manual_seed(H + S)
    q = torch.randn(S, H, 512, generator=g).to(torch.bfloat16).to(gpu_device)
    kv = torch.randn(S_kv + 50, 1, 512, generator=g).to(torch.bfloat16)
    kv[S_kv:] = float("nan")  # past s_kv as the kernel sees it below: never read
    kv = kv.to(gpu_device)
    idx = torch.randint(-1, S_kv + 3, (S, 1, K), generator=g, dtype=torch.int32).to(gpu_device)
    lens = torch.randint(0, K + 1, (S,), generator=g, dtype=torch.int32).to(gpu_device)
    lens[0] = 0
    sink = torch.randn(H, generator=g).to(gpu_device)
    sink[::5] = float("inf")
    sink[1::5] = float("-inf")
    return (q, kv[:S_kv], idx, 512 ** -0.5), sink, lens


PREFILL_CASES = [(64, 300, 5000, 640), (128, 37, 700, 1152), (16, 9, 130, 70)]


@pytest.mark.parametrize("variant", ["paired", "pipelined", "hint+smem_out+qasync", "pipelined+hint+smem_out+qasync",
                                     "pipelined+hint+smem_out+qasync+rowcopy",
                                     "pipelined+hint+smem_out+qasync+rowcopy+groupcopy",
                                     "pipelined+hint+smem_out+qasync+rowcopy+groupcopy+adjacent"])
@pytest.mark.parametrize("H,S,S_kv,K", PREFILL_CASES)
def test_flash_mla_sparse_fwd_kernel_matches_reference(gpu_device, monkeypatch, variant, H, S, S_kv, K):
    """FlashMLA's sparse prefill entry on the paired_ws program (each order of its math groups, with and without
    the copy hints, the staged output and the query's barrier completed by its copies) against its reference
    (:func:`_flash_mla_prefill_case`)."""
    _ws_variant(monkeypatch, variant)
    args, sink, lens = _flash_mla_prefill_case(gpu_device, H, S, S_kv, K)
    ref = dsv4.flash_mla_sparse_fwd(*args, attn_sink=sink, topk_length=lens, impl="reference")
    got = dsv4.flash_mla_sparse_fwd(*args, attn_sink=sink, topk_length=lens, impl="tilelang")
    torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(got[1:], ref[1:]):  # max_logits, lse: +-inf where no entry is valid
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        fin = torch.isfinite(b)
        torch.testing.assert_close(a[fin], b[fin], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("H,S,S_kv,K", PREFILL_CASES)
def test_flash_mla_sparse_fwd_on_staged_ws_matches_reference(gpu_device, use_settings, H, S, S_kv, K):
    """FlashMLA's sparse prefill entry on the staged program (MUSA_ATTN_DSV4_PROGRAM=staged_ws: a producer warp group
    staging 32-row tiles beside two math groups, within MP31's rules) against its reference."""
    use_settings(dsv4_program="staged_ws")
    args, sink, lens = _flash_mla_prefill_case(gpu_device, H, S, S_kv, K)
    ref = dsv4.flash_mla_sparse_fwd(*args, attn_sink=sink, topk_length=lens, impl="reference")
    got = dsv4.flash_mla_sparse_fwd(*args, attn_sink=sink, topk_length=lens, impl="tilelang")
    torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(got[1:], ref[1:]):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        fin = torch.isfinite(b)
        torch.testing.assert_close(a[fin], b[fin], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("variant", ["hint", "smem_out", "hint+smem_out", "hint+smem_out+qasync",
                                     "hint+smem_out+qasync+rowcopy", "hint+smem_out+qasync+rowcopy+groupcopy"])
@pytest.mark.parametrize("H,S,S_kv,K", [PREFILL_CASES[0], PREFILL_CASES[2]])
def test_paired_ws_switches_change_no_value(gpu_device, monkeypatch, variant, H, S, S_kv, K):
    """The copies' cache hints (and their row addressing), the output through shared memory and the query's barrier
    completed by its copies move the same bytes: every output, LSE and maximum equals the plain build's bit for bit (64 heads, and 16
    padded into a block of 64)."""
    args, sink, lens = _flash_mla_prefill_case(gpu_device, H, S, S_kv, K)
    _ws_variant(monkeypatch, "paired")
    plain = dsv4.flash_mla_sparse_fwd(*args, attn_sink=sink, topk_length=lens, impl="tilelang")
    _ws_variant(monkeypatch, variant)
    got = dsv4.flash_mla_sparse_fwd(*args, attn_sink=sink, topk_length=lens, impl="tilelang")
    for a, b in zip(got, plain):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


def test_sparse_mqa_no_valid_entry_and_empty_cache(gpu_device, program):
    """Tokens whose entries are all invalid (and a cache of no pages): zeros, LSE -inf, nothing read."""
    dev = gpu_device
    cache = L.new_kv_cache(0, 64, dev)
    q = torch.randn(4, 64, 512, device=dev).to(torch.bfloat16)
    idx = torch.randint(-5, 5, (4, 128), device=dev, dtype=torch.int32)
    out, lse = dsv4.sparse_mqa(q, cache, idx, sink=torch.randn(64, device=dev), return_lse=True, impl="tilelang")
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
@pytest.mark.parametrize("heads,T", [(64, 1), (128, 37)])
def test_scheduled_program_through_its_entry_equals_tilelangs_wrapper(gpu_device, heads, T, compiled, monkeypatch):
    """The scheduled program and its combine launched through ``_tilelang.launcher`` (the compiled entry without
    TileLang's Python wrapper, on CUDA) write bit for bit what the same kernels launched through the wrapper
    write, over three launches (the first one on a device goes through the wrapper), graph capture included;
    ``compiled``: the launches after the first through one call into C++ (``_ffi_launch``,
    ``SCHED_COMPILED_LAUNCH``), the LSE and partials made there."""
    from musa_attn_backend import _tilelang
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    monkeypatch.setattr(tilelang_impl, "SCHED_COMPILED_LAUNCH", compiled)
    compiled_calls = []
    if compiled:
        from musa_attn_backend import _ffi_launch

        _ffi_launch.load()  # built before the kernels (30-60 s the first time)
        real_run = _ffi_launch.run
        monkeypatch.setattr(_ffi_launch, "run", lambda *a, **k: compiled_calls.append(1) or real_run(*a, **k))

    dev = gpu_device
    cache, slots = filled_cache(4, 64, dev, seed=heads)
    idx, _ = make_indices(slots, T, 128, 256, seed=T, device=dev)  # no lengths: -1 entries, a plan by shapes
    q = torch.randn(T, heads, 512, device=dev).to(torch.bfloat16)
    sink = torch.randn(heads, device=dev)
    monkeypatch.setattr(tilelang_impl, "sparse_mqa_program", lambda target=None: "scheduled")

    def run(out):
        dsv4.sparse_mqa(q, cache, idx, sink=sink, out=out, impl="tilelang")
        return out

    tilelang_impl._SCHED_KERNELS.clear()
    monkeypatch.setattr(tilelang_impl, "launcher", lambda k: k)
    wrapped = run(torch.full_like(q, float("nan"))).clone()
    tilelang_impl._SCHED_KERNELS.clear()
    monkeypatch.setattr(tilelang_impl, "launcher", _tilelang.launcher)
    outs = [run(torch.full_like(q, float("nan"))).clone() for _ in range(3)]
    program, combine = tilelang_impl._sched_kernels(heads, False, True, T)  # the cached pair the runs launched
    assert isinstance(program, _tilelang._Entry) and isinstance(combine, _tilelang._Entry)
    static = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(static)
    graph.replay()
    torch.cuda.synchronize()
    for out in outs + [static]:
        assert torch.equal(out, wrapped)
    assert len(compiled_calls) == (3 if compiled else 0)  # the second and third runs and the captured one


@pytest.mark.parametrize("heads,B,s_q,given", [(64, 1, 1, "none"), (128, 5, 1, "out"), (64, 3, 2, "lengths")])
def test_flash_mla_entrys_recorded_launches_equal_the_checked_path(gpu_device, heads, B, s_q, given, monkeypatch):
    """FlashMLA's entry over a batch's layers (one metadata object; each layer its own caches, queries and
    indices in the same geometry) with the compiled launch on, so the later layers go through the launches the
    first compiled call recorded (``_ffi_launch.prepare``), equals the same calls with it off bit for bit, the
    caches passed as float8 views (SGLang) for the extra set; then the recorded launches captured in a CUDA graph
    and replayed over new query values."""
    from musa_attn_backend import _ffi_launch
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    _ffi_launch.load()
    monkeypatch.setattr(tilelang_impl, "sparse_mqa_program", lambda target=None: "scheduled")
    dev = gpu_device
    T = B * s_q
    layers = []
    for layer in range(4):
        swa, swa_slots = filled_cache(4, 64, dev, seed=100 + layer)
        c4, c4_slots = filled_cache(20, 64, dev, seed=200 + layer, stride=93888)
        i1, _ = make_indices(swa_slots, T, 128, 256, seed=layer, device=dev)
        i2, _ = make_indices(c4_slots, T, 512, 1280, seed=10 + layer, device=dev)
        q = torch.randn(B, s_q, heads, 512, device=dev).to(torch.bfloat16)
        layers.append((q, swa, c4, i1.view(B, s_q, 128), i2.view(B, s_q, 512), torch.randn(heads, device=dev)))
    lengths = torch.randint(0, 129, (B,), dtype=torch.int32, device=dev) if given == "lengths" else None

    def step(meta, out=None):
        res = []
        for q, swa, c4, i1, i2, sink in layers:
            o = None if out is None else out.fill_(float("nan"))
            r = dsv4.flash_mla_with_kvcache(q, swa.unsqueeze(2), None, None, 512, meta, indices=i1, attn_sink=sink,
                                            extra_k_cache=c4.unsqueeze(2).view(torch.float8_e4m3fn),
                                            extra_indices_in_kvcache=i2, topk_length=lengths, out=o)
            res.append((r[0].clone(), r[1].clone()))
        return res

    out = torch.empty(B, s_q, heads, 512, device=dev, dtype=torch.bfloat16) if given == "out" else None
    monkeypatch.setattr(tilelang_impl, "SCHED_COMPILED_LAUNCH", False)
    step(dsv4.get_mla_metadata()[0], out)  # the entries made
    want = step(dsv4.get_mla_metadata()[0], out)
    monkeypatch.setattr(tilelang_impl, "SCHED_COMPILED_LAUNCH", True)
    meta = dsv4.get_mla_metadata()[0]
    got = step(meta, out)
    # recorded unless a launch takes a copy of the caller's tensor (per-token lengths, s_q > 1)
    assert (meta.fast is not None) == (given != "lengths" or s_q == 1)
    for (o1, l1), (o2, l2) in zip(want, got):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    if meta.fast is None:
        return
    q0 = layers[0][0]
    static_out = torch.empty(B, s_q, heads, 512, device=dev, dtype=torch.bfloat16) if out is None else out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = dsv4.flash_mla_with_kvcache(q0, layers[0][1].unsqueeze(2), None, None, 512, meta, indices=layers[0][3],
                                        attn_sink=layers[0][5],
                                        extra_k_cache=layers[0][2].unsqueeze(2).view(torch.float8_e4m3fn),
                                        extra_indices_in_kvcache=layers[0][4], topk_length=lengths, out=out)
        static_out.copy_(r[0])
    q0.copy_(torch.randn_like(q0, dtype=torch.float32))
    graph.replay()
    fresh = step(dsv4.get_mla_metadata()[0], None)[0][0]  # the new values through the checked path
    torch.cuda.synchronize()
    assert torch.equal(static_out, fresh)


def _raw(cache):
    return torch.as_strided(cache, (cache.untyped_storage().nbytes(),), (1,), 0)


@pytest.mark.parametrize("pages,rows,stride,T", [(3, 256, 0, 700), (9, 64, 93888, 333), (50, 2, 0, 97),
                                                 (600, 64, 0, 16384)])
def test_write_kv_v4_kernel_is_byte_exact(gpu_device, pages, rows, stride, T):
    """The TileLang writer's bytes equal the reference writer's, every byte of the storage (so nothing outside
    the written rows is touched), on values from 1e-3 to 1e2 with zero tiles and negative slots."""
    dev = gpu_device
    T = min(T, pages * rows)
    g = torch.Generator().manual_seed(T)
    mag = torch.exp(torch.empty(T, 1).uniform_(-7, 4.6, generator=g))
    kv = (torch.randn(T, 512, generator=g) * mag).to(torch.bfloat16)
    kv[0, :64] = 0
    kv = kv.to(dev)
    slots = torch.randperm(pages * rows, generator=g)[:T].to(dev)
    slots[torch.rand(T, generator=g).to(dev) < 0.1] = -1
    slots[1] = pages * rows  # past the cache: skipped
    slots[2] = 1 << 40
    a, b = (L.new_kv_cache(pages, rows, dev, page_stride=stride) for _ in range(2))
    _raw(a).fill_(0xA5)
    _raw(b).fill_(0xA5)
    dsv4.write_kv_v4(kv, a, slots, impl="tilelang")
    dsv4.write_kv_v4(kv, b, slots, impl="reference")
    diff = (_raw(a) != _raw(b)).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:5].flatten().tolist()}"


@pytest.mark.parametrize("pages,T", [(4, 200), (300, 16384)])
def test_write_index_k_kernel_is_byte_exact(gpu_device, pages, T):
    dev = gpu_device
    rows = 64
    T = min(T, pages * rows)
    g = torch.Generator().manual_seed(pages)
    k = (torch.randn(T, 128, generator=g) * torch.exp(torch.empty(T, 1).uniform_(-7, 4.6, generator=g)))
    k = k.to(torch.bfloat16).to(dev)
    slots = torch.randperm(pages * rows, generator=g)[:T].to(dev)
    slots[:3] = -1
    slots[3] = pages * rows  # past the cache: skipped
    bufs = [torch.full((pages, L.index_page_bytes(rows) + 192), 0x5A, dtype=torch.uint8, device=dev) for _ in "ab"]
    views = [dsv4.paged_view(buf, rows, dsv4.INDEX_ROW_BYTES) for buf in bufs]
    dsv4.write_index_k(k, views[0], slots, impl="tilelang")
    dsv4.write_index_k(k, views[1], slots, impl="reference")
    assert torch.equal(bufs[0], bufs[1])
    # SGLang's exact scale, from float32 keys
    for buf in bufs:
        buf.fill_(0x5A)
    k32 = k.float() * 1.37
    dsv4.write_index_k(k32, views[0], slots, scale="exact", impl="tilelang")
    dsv4.write_index_k(k32, views[1], slots, scale="exact", impl="reference")
    assert torch.equal(bufs[0], bufs[1])


@pytest.mark.parametrize("kv_tiling,k_tiling", [((4, 128), (8, 128)), ((128, 512), (64, 512)), ((1, 64), (1, 32))])
def test_writers_byte_exact_at_other_tilings(gpu_device, monkeypatch, kv_tiling, k_tiling):
    """The writers at the tilings the bench's sweep measures (tokens per block, threads): the same bytes."""
    from musa_attn_backend.kernels.dsv4.writers import tilelang_impl

    monkeypatch.setattr(tilelang_impl, "WRITE_KV_TILING", kv_tiling)
    monkeypatch.setattr(tilelang_impl, "WRITE_INDEX_K_TILING", k_tiling)
    test_write_kv_v4_kernel_is_byte_exact(gpu_device, 9, 64, 93888, 333)
    test_write_index_k_kernel_is_byte_exact(gpu_device, 4, 200)


def test_sparse_mqa_integer_e4m3_decode(gpu_device, monkeypatch):
    """The decoding of e4m3 bytes by integer arithmetic (what targets without an FP8 conversion, MP22, run),
    forced here on the H200: the same results as the reference."""
    from musa_attn_backend.kernels.dsv4 import _glue
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    monkeypatch.setattr(_glue, "_fp8_convert", lambda target: False)
    monkeypatch.setattr(tilelang_impl, "sparse_mqa_program", lambda target=None: "portable")
    check_case(gpu_device, *CASES[0])
    check_case(gpu_device, *CASES[2])


@pytest.mark.parametrize("s_q", [1, 2])
def test_flash_mla_with_kvcache_matches_reference(gpu_device, program, s_q):
    """FlashMLA's decode entry with s_q 1 and 2 (MTP): [B, s_q, H, 512] queries, per-batch index rows."""
    dev = gpu_device
    B, H = 5, 64
    cache, slots = filled_cache(8, 256, dev, seed=3)
    xcache, xslots = filled_cache(40, 64, dev, seed=4)
    idx, lens = make_indices(slots, B * s_q, 128, 8 * 256, seed=5, device=dev)
    xidx, xlens = make_indices(xslots, B * s_q, 512, 40 * 64, seed=6, device=dev)
    q = torch.randn(B, s_q, H, 512, device=dev).to(torch.bfloat16)
    sink = torch.randn(H, device=dev)
    kw = dict(indices=idx.view(B, s_q, -1), extra_k_cache=xcache.unsqueeze(2),
              extra_indices_in_kvcache=xidx.view(B, s_q, -1), topk_length=lens.view(B, s_q)[:, 0].contiguous(),
              extra_topk_length=xlens.view(B, s_q)[:, 0].contiguous(), attn_sink=sink, is_fp8_kvcache=True)
    meta = dsv4.get_mla_metadata()[0]
    out, lse = dsv4.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, 512, meta, **kw)
    ref, ref_lse = dsv4.sparse_mqa(q.flatten(0, 1), cache, idx, lens.view(B, s_q)[:, :1].expand(B, s_q).flatten(),
                                   extra_cache=xcache, extra_indices=xidx,
                                   extra_lengths=xlens.view(B, s_q)[:, :1].expand(B, s_q).flatten(), sink=sink,
                                   return_lse=True, impl="reference")
    torch.testing.assert_close(out.flatten(0, 1).float(), ref.float(), atol=2e-2, rtol=2e-2)
    lse = lse.transpose(1, 2).flatten(0, 1)  # FlashMLA's [B, H, s_q]
    fin = torch.isfinite(ref_lse)
    assert torch.isposinf(lse[~fin]).all()  # FlashMLA: +inf for a query with no valid entry
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-3, rtol=1e-4)


def test_scheduled_plan_is_reused_across_layers_and_captured_in_a_graph(gpu_device, monkeypatch):
    """The scheduled program with one plan for several calls (FlashMLA's metadata object, as both engines pass it
    to every layer), then the plan and the launches captured in a CUDA graph and replayed over new index values
    and lengths of the same shapes: every result equal to the reference of its inputs."""
    from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl

    monkeypatch.setattr(tilelang_impl, "sparse_mqa_program", lambda target=None: "scheduled")
    dev = gpu_device
    B, H = 6, 64
    cache, slots = filled_cache(8, 256, dev, seed=13)
    xcache, xslots = filled_cache(40, 64, dev, seed=14)
    q = torch.randn(B, H, 512, device=dev).to(torch.bfloat16)
    sink = torch.randn(H, device=dev)
    idx, lens = make_indices(slots, B, 128, 8 * 256, seed=15, device=dev)
    xidx, xlens = make_indices(xslots, B, 512, 40 * 64, seed=16, device=dev)
    plan = dsv4.sparse_mqa_plan(q, idx, lens, xidx, xlens)
    kw = dict(extra_cache=xcache, extra_indices=xidx, extra_lengths=xlens, sink=sink, return_lse=True)
    ref = dsv4.sparse_mqa(q, cache, idx, lens, impl="reference", **kw)
    for _ in range(2):  # two "layers" on one plan
        got = dsv4.sparse_mqa(q, cache, idx, lens, plan=plan, impl="tilelang", **kw)
        torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
    out = torch.empty_like(q)
    dsv4.sparse_mqa(q, cache, idx, lens, out=out, impl="tilelang", **kw)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p = dsv4.sparse_mqa_plan(q, idx, lens, xidx, xlens)
        res = dsv4.sparse_mqa(q, cache, idx, lens, out=out, plan=p, impl="tilelang", **kw)
    for seed in (17, 18):
        nidx, nlens = make_indices(slots, B, 128, 8 * 256, seed=seed, device=dev)
        nx, nxl = make_indices(xslots, B, 512, 40 * 64, seed=seed + 100, device=dev)
        nxl[seed % B] = 0  # a token whose compressed set is empty
        idx.copy_(nidx), lens.copy_(nlens), xidx.copy_(nx), xlens.copy_(nxl)
        graph.replay()
        want, want_lse = dsv4.sparse_mqa(q, cache, idx, lens, impl="reference", **kw)
        torch.testing.assert_close(res[0].float(), want.float(), atol=2e-2, rtol=2e-2)
        fin = torch.isfinite(want_lse)
        torch.testing.assert_close(res[1][fin], want_lse[fin], atol=2e-3, rtol=1e-4)
