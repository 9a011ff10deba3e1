"""Degenerate batches for every public op of :mod:`musa_attn_backend.kernels`: the batches an engine really sends
besides the ordinary ones, and what each op's contract says of them.

- **zero tokens**: SGLang's IDLE batches on data-parallel attention ranks with no request, an empty prompt;
- **zero-length requests** and **all-invalid index sets**: a request with no new token or no key, a token whose
  every index is ``-1``, past its length or past the cache, a padding row of a CUDA-graph batch;
- **a single token**, and **the largest batch the engines' graphs capture** (:data:`GRAPH_MAX_BATCH`);
- **repeated or dropped expert ids**: a token naming one expert twice (the sum of both choices), ``-1``.

Each :class:`Case` runs one op on fresh random inputs (NaN in every cache row nobody should read, NaN-poisoned
outputs where the op takes ``out``) and asserts the contract: an empty result of the right shape, a zero row
with its documented LSE, bytes left as they were, the sum of both choices, or a ``ValueError`` naming the
argument. Where a degenerate token sits among ordinary ones, the ordinary tokens' results must equal those of
the same op run without it: no input may change another token's result. Under ``impl="tilelang"`` (a GPU)
every result is also compared with the op's reference on the same inputs.

:func:`public_ops` lists the public callables of the kernel families; ``tests/contract`` fails when one of them
has no case here and no entry in :data:`NOT_BATCH_OPS`, so a new op cannot skip the sweep.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

GRAPH_MAX_BATCH = 512  # the largest decode batch either engine captures by default (vLLM 0.33: 512; SGLang's
#                        cuda_graph_max_bs stays at or below it on every GPU it sizes for)


@dataclass(frozen=True)
class Case:
    op: str  # "<family>.<name>", as public_ops() names it
    name: str
    run: Callable[[str, str], None]  # run(device, impl): builds the inputs, runs the op, asserts

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}]"


CASES: list[Case] = []


def case(op: str, name: str):
    def register(fn):
        CASES.append(Case(op, name, fn))
        return fn

    return register


# public callables that take no batch: nothing degenerate to send them (each with its reason)
NOT_BATCH_OPS = {
    "attention.check_paged_attention_args": "the argument check of paged_attention, which every case runs",
    "attention.paged_attention_reference": "paged_attention under impl='reference', which every case runs",
    "kv_cache.check_write_kv_args": "the argument check of write_kv, which every case runs",
    "kv_cache.write_kv_reference": "write_kv under impl='reference'",
    "dsv4.paged_view": "a view of an engine's pool buffer: no tokens",
    "dsv4.new_kv_cache": "allocates a zeroed cache: no tokens",
    "dsv4.page_bytes": "a size in bytes",
    "dsv4.index_page_bytes": "a size in bytes",
    "dsv4.get_mla_metadata": "FlashMLA's planner stand-in: ignores its arguments, returns an empty plan",
    "dsv4.FlashMLASchedMeta": "the planner's result type: no tokens",
    "dsv4.SparseMQAPlan": "sparse_mqa_plan's result type: no tokens",
    "moe.fused_experts_reference": "fused_experts' float32 formula, the oracle of every fused_experts case",
    "moe.combine_reference": "combine_experts under impl='reference'",
    "moe.quantize_scatter_reference": "quantize_scatter under impl='reference'",
    "moe.route_masked_reference": "route_masked under impl='reference', the oracle of every route_masked case",
    "moe.swiglu_quant_reference": "swiglu_quant under impl='reference'",
    "moe.grouped_gemm_swiglu_contiguous_reference": "grouped_gemm_swiglu_fp8 under impl='reference'",
    "moe.grouped_gemm_swiglu_masked_reference": "grouped_gemm_swiglu_fp8_masked under impl='reference'",
    "moe.grouped_gemm_contiguous_reference": "grouped_gemm_fp8 under impl='reference'",
    "moe.grouped_gemm_masked_reference": "grouped_gemm_fp8_masked under impl='reference'",
    "moe.quantize_groups_reference": "quantize_groups' body",
    "moe.quantize_weight_blocks_reference": "quantises weights at load: no tokens",
    "moe.quantize_fp4_reference": "quantises weights at load: no tokens",
    "moe.dequantize_fp8_blocks": "dequantises weights: no tokens",
    "moe.dequantize_fp4": "dequantises weights: no tokens",
}


def public_ops() -> dict[str, object]:
    """``{"<family>.<name>": callable}``: the callables each kernel family exports (``__all__``), and the public
    functions of :mod:`..kernels.dsv4.model` (the model-side ops the engine hooks call)."""
    from ..kernels import attention, dsv4, kv_cache, moe
    from ..kernels.dsv4 import model

    out = {}
    for family, mod in (("attention", attention), ("kv_cache", kv_cache), ("dsv4", dsv4), ("moe", moe)):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not inspect.ismodule(obj):
                out[f"{family}.{name}"] = obj
    for name, obj in vars(model).items():
        if inspect.isfunction(obj) and obj.__module__ == model.__name__ and not name.startswith("_"):
            out[f"model.{name}"] = obj
    return out


# ---------------------------------------------------------------------------------------------------- helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, dev, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(dev)


def _raises(fn, *words: str) -> None:
    """``fn()`` raises a ValueError whose message holds every one of ``words``."""
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert all(w in msg for w in words), f"the refusal {msg!r} does not name {words}"
        return
    raise AssertionError(f"expected a ValueError naming {words}")


def _same(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 0.0, rtol: float = 0.0,
          of_max: float = 0.0) -> None:
    """``got`` equals ``want``: bytes exactly (FP8, uint8, or no tolerance: NaN where ``want`` has it), else NaN
    and infinities where ``want`` has them and ``|got - want| <= atol + rtol * |want| + of_max * max |want|``
    on the finite values (``of_max``: a sum's error is relative to its largest terms, not to the result)."""
    if of_max:
        fin = want.float()[torch.isfinite(want.float())]
        atol += of_max * (fin.abs().max().item() if fin.numel() else 0.0)
        of_max = 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype in (torch.float8_e4m3fn, torch.uint8) or (atol == 0 and rtol == 0):
        a, b = (got.view(torch.uint8), want.view(torch.uint8)) if got.dtype == torch.float8_e4m3fn else (got, want)
        ok = torch.equal(a, b) or (a.is_floating_point() and torch.equal(torch.nan_to_num(a, 7.0),
                                                                         torch.nan_to_num(b, 7.0))
                                   and torch.equal(a.isnan(), b.isnan()))
        assert ok, f"{what}: differs (exact comparison)"
        return
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"{what}: NaN where the expected result has none (or the reverse)"
    assert torch.equal(g.isinf() & (g > 0), w.isinf() & (w > 0)) and torch.equal(g.isinf() & (g < 0),
                                                                                 w.isinf() & (w < 0)), \
        f"{what}: infinities differ"
    fin = torch.isfinite(w)
    err = (g[fin] - w[fin]).abs()
    bound = atol + rtol * w[fin].abs()
    assert bool((err <= bound).all()), f"{what}: largest error {err.max().item():.3g} past atol {atol} rtol {rtol}"


def _l2(got: torch.Tensor, want: torch.Tensor, what: str, bound: float = 1e-2) -> None:
    """Relative L2 error below ``bound``, every value finite: the MoE layer against its float32 formula (an
    activation on an FP8 rounding boundary may round the other way in the GPU's order of sums, moving single
    elements by a quantisation step; tests/moe/test_gpu_moe.py bounds the layer the same way)."""
    assert got.shape == want.shape and bool(torch.isfinite(got.float()).all()), f"{what}: shape or non-finite"
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
    assert err.item() < bound, f"{what}: relative L2 error {err.item():.3g} >= {bound}"


def _tol(impl: str, bf16: bool = True) -> dict:
    """The tolerance of an implementation against the reference: none between two runs of the reference (the
    isolation checks), bf16 rounding plus float32 reordering for a GPU program."""
    if impl == "reference":
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=2e-2, rtol=2e-2) if bf16 else dict(atol=1e-4, rtol=1e-4)


def _vs_reference(impl: str, run: Callable[[str], object], what: str, **tol) -> object:
    """``run(impl)``; on a GPU implementation also ``run("reference")`` on the same inputs, compared."""
    got = run(impl)
    if impl != "reference":
        want = run("reference")
        for i, (g, w) in enumerate(zip(_tuple(got), _tuple(want))):
            if isinstance(g, torch.Tensor):
                _same(g, w, f"{what} (output {i}, against the reference)", **(tol or _tol(impl)))
    return got


def _tuple(x):
    return x if isinstance(x, (tuple, list)) else (x,)


# ------------------------------------------------------------------------------------- dense attention, KV cache


def _dense_batch(query_lens, prefix_lens, dev, keys=None, page_size=16, heads=(4, 2), d=64,
                 dtype=torch.bfloat16):
    """A paged batch with the given per-request query and prefix lengths: ``(q, k_cache, v_cache, meta)``.
    Request ``b``'s keys, values and queries come from the seed ``keys[b]`` (default ``b``), so one request gets
    the same data in two batches; its pages are shuffled through the pool, and every slot no request owns is
    NaN."""
    from ..metadata import PagedKVMeta

    B = len(query_lens)
    keys = list(range(B)) if keys is None else keys
    seq = [p + q for p, q in zip(prefix_lens, query_lens)]
    pages_of = [-(-n // page_size) for n in seq]
    num_pages = sum(pages_of) + 2
    perm = torch.randperm(num_pages, generator=_gen(sum(keys) + B)).tolist()
    width = max(max(pages_of, default=0), 1)
    table = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    hq, hkv = heads
    k_flat = torch.full((num_pages * page_size, hkv, d), float("nan"))
    v_flat = torch.full((num_pages * page_size, hkv, d), float("nan"))
    slots, qs = [], []
    for b in range(B):
        g = _gen(1000 + keys[b])
        at = table[b].long()[torch.arange(seq[b]) // page_size] * page_size + torch.arange(seq[b]) % page_size
        k_flat[at] = torch.randn(seq[b], hkv, d, generator=g)
        v_flat[at] = torch.randn(seq[b], hkv, d, generator=g)
        qs.append(torch.randn(query_lens[b], hq, d, generator=g))
        slots += at[prefix_lens[b]:].tolist()
    q = torch.cat(qs) if qs else torch.empty(0, hq, d)
    meta = PagedKVMeta.from_lengths(
        query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
        seqlens_k=torch.tensor(seq, dtype=torch.int32, device=dev),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=dev), page_table=table.to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), page_size=page_size,
        max_seqlen_q=max(query_lens, default=0), max_seqlen_k=width * page_size)
    shape = (num_pages, page_size, hkv, d)
    return (q.to(dtype).to(dev), k_flat.view(shape).to(dtype).to(dev), v_flat.view(shape).to(dtype).to(dev), meta)


def _attend(q, kc, vc, meta, impl, **kw):
    from ..kernels import paged_attention

    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    o, lse = paged_attention(q, kc, vc, meta, out=out, return_lse=True, impl=impl, **kw)
    assert o is out
    return o, lse


@case("attention.paged_attention", "zero tokens, zero requests")
def _(dev, impl):
    q, kc, vc, meta = _dense_batch([], [], dev)
    o, lse = _attend(q, kc, vc, meta, impl)
    assert o.shape == (0, 4, 64) and lse.shape == (0, 4)


@case("attention.paged_attention", "requests of zero new tokens and of no key among others: the others unchanged")
def _(dev, impl):
    for window in (None, 8):
        full = _dense_batch([5, 0, 3, 0], [20, 9, 0, 0], dev, keys=[1, 2, 3, 4])
        o, lse = _vs_reference(impl, lambda i: _attend(*full, i, sliding_window=window), "attention")
        o2, lse2 = _attend(*_dense_batch([5, 3], [20, 0], dev, keys=[1, 3]), impl, sliding_window=window)
        _same(o, o2, "rows beside empty requests", **_tol(impl))
        _same(lse, lse2, "their LSE", **_tol(impl, bf16=False))


@case("attention.paged_attention", "a decode batch padded as the engines' graphs pad it: trailing requests of no "
                                   "token and no key")
def _(dev, impl):
    full = _dense_batch([1, 1, 0, 0], [10, 33, 0, 0], dev, keys=[5, 6, 7, 8])
    o, lse = _vs_reference(impl, lambda i: _attend(*full, i), "attention")
    o2, lse2 = _attend(*_dense_batch([1, 1], [10, 33], dev, keys=[5, 6]), impl)
    _same(o, o2, "decode rows beside padding requests", **_tol(impl))
    _same(lse, lse2, "their LSE", **_tol(impl, bf16=False))


@case("attention.paged_attention", "a single decode token")
def _(dev, impl):
    batch = _dense_batch([1], [37], dev, keys=[2])
    o, _ = _vs_reference(impl, lambda i: _attend(*batch, i), "attention")
    assert torch.isfinite(o).all()


@case("attention.paged_attention", f"{GRAPH_MAX_BATCH} decode tokens")
def _(dev, impl):
    lens = [(7 * b) % 50 for b in range(GRAPH_MAX_BATCH)]
    batch = _dense_batch([1] * GRAPH_MAX_BATCH, lens, dev)
    o, _ = _vs_reference(impl, lambda i: _attend(*batch, i), "attention")
    assert torch.isfinite(o).all()


def _kv_write(dev, impl, slots, T, fp8=False, seed=0):
    from ..kernels import write_kv

    hkv, d = 2, 64
    k = _randn(T, hkv, d, seed=seed, dev=dev, dtype=torch.bfloat16)
    v = _randn(T, hkv, d, seed=seed + 1, dev=dev, dtype=torch.bfloat16)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kc = _randn(4, 16, hkv, d, seed=seed + 2, dev=dev).to(dtype)
    vc = _randn(4, 16, hkv, d, seed=seed + 3, dev=dev).to(dtype)
    before = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, torch.tensor(slots, dtype=torch.int64, device=dev), impl=impl)
    return k, v, kc, vc, before


@case("kv_cache.write_kv", "zero tokens; every slot negative (padding)")
def _(dev, impl):
    for fp8 in (False, True):
        for slots, T in (([], 0), ([-1, -1, -5], 3)):
            _, _, kc, vc, (k0, v0) = _kv_write(dev, impl, slots, T, fp8)
            _same(kc, k0, "k_cache written by a skipped slot")
            _same(vc, v0, "v_cache written by a skipped slot")


@case("kv_cache.write_kv", f"one token, then {GRAPH_MAX_BATCH} among padding")
def _(dev, impl):
    from ..kernels import write_kv

    for T in (1, GRAPH_MAX_BATCH):
        slots = [(s * 5) % 64 if s % 3 else -1 for s in range(T)] if T > 1 else [17]
        slots = list(dict.fromkeys(slots))  # one token a slot (duplicates land unspecified)
        T = len(slots)
        k, v, kc, vc, (k0, v0) = _kv_write(dev, impl, slots, T, seed=T)
        kr, vr = k0.clone(), v0.clone()
        write_kv(k, v, kr, vr, torch.tensor(slots, dtype=torch.int64, device=dev), impl="reference")
        _same(kc, kr, "k_cache")
        _same(vc, vr, "v_cache")


@case("kv_cache.quantize_fp8", "zero tokens")
def _(dev, impl):
    from ..kernels import quantize_fp8

    out = quantize_fp8(torch.empty(0, 2, 64, device=dev), 0.5)
    assert out.shape == (0, 2, 64) and out.dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------- DeepSeek-V4 caches


def _v4_cache(dev, pages=3, rows=64, filled=150, seed=0):
    """A MODEL1 cache with rows ``0 .. filled-1`` written from random ``kv`` and every other row NaN bytes."""
    from ..kernels import dsv4

    cache = dsv4.new_kv_cache(pages, rows, dev)
    cache[:] = 0xFF  # NaN in the FP8 values, the bf16 RoPE values and the scales
    kv = _randn(filled, 512, seed=seed, dev=dev, dtype=torch.bfloat16, scale=2.0)
    dsv4.write_kv_v4(kv, cache, torch.arange(filled, device=dev), impl="reference")
    return cache


def _sparse(dev, impl, T, H=8, K=64, K2=32, seed=0, bad=(), sink=True):
    """sparse_mqa over a window set (K) and an extra set (K2); tokens in ``bad`` have no valid entry (indices
    -1, past the cache, or past their lengths). Returns ``(o, lse)``."""
    from ..kernels import dsv4

    cache, extra = _v4_cache(dev, seed=seed), _v4_cache(dev, pages=2, filled=100, seed=seed + 1)
    q = _randn(T, H, 512, seed=seed + 2, dev=dev, dtype=torch.bfloat16)
    g = _gen(seed + 3)
    idx = torch.randint(0, 150, (T, K), generator=g).int()
    xidx = torch.randint(0, 100, (T, K2), generator=g).int()
    lens = torch.randint(1, K + 1, (T,), generator=g).int()
    xlens = torch.full((T,), K2, dtype=torch.int32)
    # entries past a token's length name rows nobody wrote (NaN bytes): they must never be read
    past = torch.arange(K)[None, :] >= lens[:, None]
    idx = torch.where(past, 150 + torch.arange(K)[None, :] % 42, idx).int()
    for n, t in enumerate(bad):
        if n % 3 == 0:
            idx[t], xidx[t] = -1, -1
        elif n % 3 == 1:
            idx[t], xidx[t] = 3 * 64 + 5, 2 * 64 + 9  # at and past each cache's slot count
        else:
            lens[t], xlens[t] = 0, 0
    s = _randn(H, seed=seed + 4, dev=dev) if sink else None
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=dev)

    def run(i):
        return dsv4.sparse_mqa(q, cache, idx.to(dev), lens.to(dev), extra_cache=extra, extra_indices=xidx.to(dev),
                               extra_lengths=xlens.to(dev), sink=s, out=out.clone(), return_lse=True, impl=i)

    return _vs_reference(impl, run, "sparse_mqa"), (q, cache, extra, idx, xidx, lens, xlens, s)


@case("dsv4.sparse_mqa", "zero tokens")
def _(dev, impl):
    (o, lse), _ = _sparse(dev, impl, 0)
    assert o.shape == (0, 8, 512) and lse.shape == (0, 8)


@case("dsv4.sparse_mqa", "all-invalid index sets among ordinary tokens: zero rows, lse -inf, the others unchanged")
def _(dev, impl):
    from ..kernels import dsv4

    bad = (1, 4, 6)
    (o, lse), (q, cache, extra, idx, xidx, lens, xlens, s) = _sparse(dev, impl, 8, bad=bad)
    b = list(bad)
    assert torch.equal(o[b].float(), torch.zeros_like(o[b].float())), "a token with no valid entry is not zero"
    assert bool(torch.isneginf(lse[b]).all()), "a token with no valid entry has an LSE other than -inf"
    keep = [t for t in range(8) if t not in bad]
    o2, lse2 = dsv4.sparse_mqa(q[keep], cache, idx[keep].to(dev), lens[keep].to(dev), extra_cache=extra,
                               extra_indices=xidx[keep].to(dev), extra_lengths=xlens[keep].to(dev), sink=s,
                               return_lse=True, impl=impl)
    _same(o[keep], o2, "ordinary tokens beside invalid ones", **_tol(impl))
    _same(lse[keep], lse2, "their LSE", **_tol(impl, bf16=False))


@case("dsv4.sparse_mqa", "a single token, no sink")
def _(dev, impl):
    (o, lse), _ = _sparse(dev, impl, 1, sink=False)
    assert bool(torch.isfinite(o.float()).all() and torch.isfinite(lse).all())


@case("dsv4.sparse_mqa", f"{GRAPH_MAX_BATCH} decode tokens, H 64")
def _(dev, impl):
    (o, lse), _ = _sparse(dev, impl, GRAPH_MAX_BATCH, H=64, bad=(0, 100, 511))
    assert bool(torch.isfinite(o.float()).all())


@case("dsv4.sparse_mqa_plan", "zero tokens, all-invalid tokens, 512 tokens: every tile visited once, the plan "
                              "drives sparse_mqa to the reference's result")
def _(dev, impl):
    from ..kernels import dsv4
    from ..kernels.dsv4.sparse import schedule

    for T, bad in ((0, ()), (5, (0, 1, 2, 3, 4)), (GRAPH_MAX_BATCH, (0, 100, 511))):
        (o, lse), (q, cache, extra, idx, xidx, lens, xlens, s) = _sparse(dev, impl, T, bad=bad)
        plan = dsv4.sparse_mqa_plan(q, idx.to(dev), lens.to(dev), xidx.to(dev), xlens.to(dev))
        assert plan.tokens == T and plan.part_meta.shape == (plan.parts, schedule.META_FIELDS)
        visits = schedule.visits(plan)
        assert sum(b - a for pieces in visits for _, a, b in pieces) == int(plan.tiles.sum())
        o2, lse2 = dsv4.sparse_mqa(q, cache, idx.to(dev), lens.to(dev), extra_cache=extra, extra_indices=xidx.to(dev),
                                   extra_lengths=xlens.to(dev), sink=s, return_lse=True, plan=plan, impl=impl)
        _same(o2, o, "sparse_mqa on a plan", **_tol(impl))
        _same(lse2, lse, "its LSE", **_tol(impl, bf16=False))


@case("dsv4.flash_mla_with_kvcache", "zero requests; all-invalid requests (zero rows, lse +inf)")
def _(dev, impl):
    from ..kernels import dsv4

    cache = _v4_cache(dev)
    for B, s_q in ((0, 1), (0, 2), (3, 2)):
        q = _randn(B, s_q, 8, 512, seed=B, dev=dev, dtype=torch.bfloat16)
        idx = torch.randint(0, 150, (B, s_q, 64), generator=_gen(1)).int().to(dev)
        tl = torch.tensor([40, 0, 64][:B], dtype=torch.int32, device=dev)  # request 1: no entry counts
        if B:
            idx[2] = -1  # request 2: every entry invalid

        def run(i):
            return dsv4.flash_mla_with_kvcache(q, cache.view(3, 64, 1, 584), indices=idx, topk_length=tl,
                                               attn_sink=_randn(8, seed=3, dev=dev), impl=i)

        o, lse = _vs_reference(impl, run, "flash_mla_with_kvcache")
        assert o.shape == (B, s_q, 8, 512) and lse.shape == (B, 8, s_q)
        if B:
            assert torch.equal(o[1:].float(), torch.zeros_like(o[1:].float())) and bool(torch.isposinf(lse[1:]).all())
            assert bool(torch.isfinite(o[0].float()).all() and torch.isfinite(lse[0]).all())


@case("dsv4.flash_mla_sparse_fwd", "zero queries; all-invalid queries (zero rows, max -inf, lse +inf)")
def _(dev, impl):
    from ..kernels import dsv4

    kv = _randn(40, 1, 512, seed=0, dev=dev, dtype=torch.bfloat16)
    for S in (0, 4):
        q = _randn(S, 8, 512, seed=1, dev=dev, dtype=torch.bfloat16)
        idx = torch.randint(0, 40, (S, 1, 16), generator=_gen(2)).int().to(dev)
        if S:
            idx[1] = -1
            idx[2] = 40  # past the workspace
        o, mx, lse = dsv4.flash_mla_sparse_fwd(q, kv, idx, 0.04, impl="auto" if impl != "reference" else impl)
        assert o.shape == (S, 8, 512) and mx.shape == lse.shape == (S, 8)
        if S:
            assert torch.equal(o[1:3].float(), torch.zeros_like(o[1:3].float()))
            assert bool(torch.isneginf(mx[1:3]).all() and torch.isposinf(lse[1:3]).all())
            assert bool(torch.isfinite(o[[0, 3]].float()).all())


def _writer_case(op_name, width, pages_fn, cache_fn):
    """The two writers' cases: zero tokens, every slot invalid (bytes unchanged), one token, the largest batch
    with padding slots among real ones (bytes equal to the reference's)."""

    def write(dev, impl, T, slots, seed):
        from ..kernels import dsv4

        cache = cache_fn(dev)
        x = _randn(T, width, seed=seed, dev=dev, dtype=torch.bfloat16, scale=3.0)
        before = cache.clone()
        getattr(dsv4, op_name)(x, cache, torch.tensor(slots, dtype=torch.int64, device=dev), impl=impl)
        return x, cache, before

    @case(f"dsv4.{op_name}", "zero tokens; every slot negative or past the cache")
    def _(dev, impl):
        for T, slots in ((0, []), (4, [-1, -7, 10 ** 6, 3 * 64])):
            _, cache, before = write(dev, impl, T, slots, 0)
            _same(cache, before, f"{op_name}: the cache after a write of skipped slots")

    @case(f"dsv4.{op_name}", f"one token; {GRAPH_MAX_BATCH} tokens among padding")
    def _(dev, impl):
        from ..kernels import dsv4

        for T in (1, GRAPH_MAX_BATCH):
            slots = [17] if T == 1 else [(5 * t) % 192 if t % 4 else -1 for t in range(T)]
            slots = [s if s < 0 or slots.index(s) == t else -1 for t, s in enumerate(slots)]  # no duplicates
            x, cache, before = write(dev, impl, T, slots, T)
            want = before.clone()
            getattr(dsv4, op_name)(x, want, torch.tensor(slots, dtype=torch.int64, device=dev), impl="reference")
            _same(cache, want, f"{op_name}: the cache bytes")


_writer_case("write_kv_v4", 512, None, lambda dev: _v4_cache(dev, filled=0))


def _index_cache(dev, pages=3, rows=64):
    from ..kernels import dsv4

    buf = torch.full((pages, dsv4.index_page_bytes(rows)), 0xFF, dtype=torch.uint8, device=dev)
    return dsv4.paged_view(buf, rows, dsv4.INDEX_ROW_BYTES)


_writer_case("write_index_k", 128, None, _index_cache)


@case("dsv4.norm_rope_write_kv_v4", "zero tokens; every slot invalid; one token; the largest batch")
def _(dev, impl):
    from ..kernels import dsv4

    w = _randn(512, seed=1, dev=dev).abs() + 0.5
    ang = torch.rand(600, 32, generator=_gen(2)) * 6
    cos, sin = ang.cos().to(dev), ang.sin().to(dev)
    for T, valid in ((0, False), (3, False), (1, True), (GRAPH_MAX_BATCH, True)):
        cache = _v4_cache(dev, filled=0)
        kv = _randn(T, 512, seed=T, dev=dev, dtype=torch.bfloat16, scale=3.0)
        pos = torch.randint(0, 600, (T,), generator=_gen(T)).to(dev)
        t = torch.arange(T)  # one token a slot: duplicates land unspecified
        slots = torch.where((t % 3 > 0) & (t < 192), t, -1) if valid else torch.full((T,), -1)
        if T == 1:
            slots = torch.tensor([5])
        before = cache.clone()
        dsv4.norm_rope_write_kv_v4(kv, w, 1e-6, cos, sin, pos, cache, slots.to(dev), impl=impl)
        if not valid:
            _same(cache, before, "the cache after skipped slots")
        else:
            want = before.clone()
            dsv4.norm_rope_write_kv_v4(kv, w, 1e-6, cos, sin, pos, want, slots.to(dev), impl="reference")
            if impl == "reference":
                _same(cache, want, "the cache bytes")
            else:  # the GPU program's norm may round one bf16 value the other way: compare the rows read back
                rows = slots[slots >= 0].to(dev)
                _same(dsv4.read_kv_v4(cache, rows), dsv4.read_kv_v4(want, rows), "the rows written", **_tol(impl))


@case("dsv4.read_kv_v4", "no slot; an invalid slot refused")
def _(dev, impl):
    from ..kernels import dsv4

    cache = _v4_cache(dev)
    assert dsv4.read_kv_v4(cache, torch.empty(0, dtype=torch.int64, device=dev)).shape == (0, 512)
    _raises(lambda: dsv4.read_kv_v4(cache, torch.tensor([3, -1], device=dev)), "read_kv_v4", "slot")


@case("dsv4.read_index_k", "no slot; an invalid slot refused")
def _(dev, impl):
    from ..kernels import dsv4

    cache = _index_cache(dev)
    assert dsv4.read_index_k(cache, torch.empty(0, dtype=torch.int64, device=dev)).shape == (0, 128)
    _raises(lambda: dsv4.read_index_k(cache, torch.tensor([3 * 64], device=dev)), "read_index_k", "slot")


# ----------------------------------------------------------------------------------------------- V4 indexer


def _rope_tables(dev, n=600, seed=9):
    ang = torch.rand(n, 32, generator=_gen(seed)) * 6
    return ang.cos().to(dev), ang.sin().to(dev)


@case("dsv4.indexer_q", f"zero tokens; one token; {GRAPH_MAX_BATCH} tokens")
def _(dev, impl):
    from ..kernels import dsv4

    cos, sin = _rope_tables(dev)
    for T in (0, 1, GRAPH_MAX_BATCH):
        q = _randn(T, 16, 128, seed=T, dev=dev, dtype=torch.bfloat16)
        w = _randn(T, 16, seed=T + 1, dev=dev, dtype=torch.bfloat16)
        pos = torch.randint(0, 600, (T,), generator=_gen(T)).to(dev)
        q8, wt = _vs_reference(impl, lambda i: dsv4.indexer_q(q, w, pos, cos, sin, impl=i), "indexer_q",
                               atol=0.0, rtol=0.0) if impl == "reference" else \
            dsv4.indexer_q(q, w, pos, cos, sin, impl=impl)
        assert q8.shape == (T, 16, 128) and q8.dtype == torch.float8_e4m3fn and wt.shape == (T, 16)
        if impl != "reference" and T:
            r8, rw = dsv4.indexer_q(q, w, pos, cos, sin, impl="reference")
            # one e4m3 step (3 mantissa bits: 1/8 of the value; 2^-9 below the normal range)
            _same(q8.float(), r8.float(), "indexer_q's FP8 rows", atol=2 ** -9, rtol=0.126)
            _same(wt, rw, "indexer_q's weights", **_tol(impl, bf16=False))


# the indexer's logits: FP8 products summed over heads and dims in another order on tensor cores (as
# tests/dsv4/test_gpu_dsv4_indexer.py bounds them)
_LOGITS = dict(atol=0.0, rtol=1e-3, of_max=1e-3)


def _fp8(*shape, seed, dev):
    return torch.randn(*shape, generator=_gen(seed)).clamp(-4, 4).to(torch.float8_e4m3fn).to(dev)


@case("dsv4.indexer_logits", "zero queries; zero keys; empty and reversed ranges: -inf rows, the others unchanged")
def _(dev, impl):
    from ..kernels import dsv4

    for T, S in ((0, 50), (5, 0), (6, 50)):
        q = _fp8(T, 16, 128, seed=T, dev=dev)
        w = _randn(T, 16, seed=1, dev=dev)
        k = _fp8(S, 128, seed=2, dev=dev)
        ks = _randn(S, seed=3, dev=dev).abs()
        starts = torch.tensor([0, 10, 30, 20, 0, 45][:T], dtype=torch.int32, device=dev)
        ends = torch.tensor([50, 10, 20, 49, -3, 60][:T], dtype=torch.int32, device=dev)  # 1, 2, 4: empty
        out = _vs_reference(impl, lambda i: dsv4.indexer_logits(q, w, k, ks, starts, ends, impl=i),
                            "indexer_logits", **_LOGITS)
        assert out.shape == (T, S)
        if T and S:
            assert bool(torch.isneginf(out[[1, 2, 4]]).all()), "an empty range holds a logit"
            keep = [0, 3, 5]
            alone = dsv4.indexer_logits(q[keep], w[keep], k, ks, starts[keep], ends[keep], impl=impl)
            _same(out[keep], alone, "ordinary rows beside empty ones", **_LOGITS)


def _paged_logits(dev, impl, B, next_n, lens, max_len, bad_page=False, seed=0):
    from ..kernels import dsv4

    pages = 4
    cache = _index_cache(dev, pages=pages)
    dsv4.write_index_k(_randn(pages * 64, 128, seed=seed, dev=dev, dtype=torch.bfloat16), cache,
                       torch.arange(pages * 64, device=dev), impl="reference")
    width = max(1, -(-max_len // 64))
    table = torch.randint(0, pages, (B, width), generator=_gen(seed + 1)).int()
    if bad_page and B:
        table[0, -1] = -1
        table[-1, 0] = pages + 3
    q = _fp8(B, next_n, 16, 128, seed=seed + 2, dev=dev)
    w = _randn(B * next_n, 16, seed=seed + 3, dev=dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev).view(B, next_n) if next_n > 1 else \
        torch.tensor(lens, dtype=torch.int32, device=dev)
    return _vs_reference(impl, lambda i: dsv4.paged_indexer_logits(q, w, cache, cl, table.to(dev), max_len, impl=i),
                         "paged_indexer_logits", **_LOGITS)


@case("dsv4.paged_indexer_logits", "zero requests; max_len 0; zero-length rows; invalid page entries")
def _(dev, impl):
    assert _paged_logits(dev, impl, 0, 1, [], 128).shape == (0, 128)
    assert _paged_logits(dev, impl, 2, 2, [0, 0, 0, 0], 0).shape == (4, 0)
    out = _paged_logits(dev, impl, 3, 2, [100, 101, 0, 0, 5, 6], 128, bad_page=True)
    assert bool(torch.isneginf(out[2:4]).all()), "a row of length 0 holds a logit"
    assert bool(torch.isneginf(out[0, 64:101]).all()), "a key on a page entry of -1 holds a logit"
    assert bool(torch.isneginf(out[4:6, :6]).all()), "a key on a page past the cache holds a logit"


@case("dsv4.paged_indexer_logits", f"one request; {GRAPH_MAX_BATCH} requests")
def _(dev, impl):
    out = _paged_logits(dev, impl, 1, 1, [77], 128)
    assert bool(torch.isfinite(out[0, :77]).all() and torch.isneginf(out[0, 77:]).all())
    lens = [(13 * b) % 200 for b in range(GRAPH_MAX_BATCH)]
    _paged_logits(dev, impl, GRAPH_MAX_BATCH, 1, lens, 256, seed=4)


@case("dsv4.indexer_topk", "zero rows; zero columns; lengths 0 or negative, starts past the row: all -1")
def _(dev, impl):
    from ..kernels import dsv4

    for T, N in ((0, 64), (3, 0), (5, 300)):
        logits = _randn(T, N, seed=T, dev=dev)
        lens = torch.tensor([0, -4, 50, 300, 20][:T], dtype=torch.int32, device=dev)
        starts = torch.tensor([0, 0, 290, 0, 400][:T], dtype=torch.int32, device=dev)
        out = torch.full((T, 32), 7, dtype=torch.int32, device=dev)
        got = dsv4.indexer_topk(logits, lens, 32, starts=starts, out=out, impl=impl)
        assert got.shape == (T, 32)
        if T and N:
            assert bool((got[[0, 1, 4]] == -1).all()), "an empty range chose a position"
            assert sorted(got[2].tolist()) == [-1] * 22 + list(range(10)), "a range cut at N"
            want = dsv4.indexer_topk(logits, lens, 32, starts=starts, impl="reference")
            assert torch.equal(got[3].sort().values, want[3].sort().values)


@case("dsv4.indexer_topk", f"one row; {GRAPH_MAX_BATCH} rows with a page table (bad entries -> -1)")
def _(dev, impl):
    from ..kernels import dsv4

    for T in (1, GRAPH_MAX_BATCH):
        logits = _randn(T, 640, seed=T, dev=dev)
        lens = torch.randint(0, 641, (T,), generator=_gen(T)).int().to(dev)
        table = torch.randint(0, 50, (T, 10), generator=_gen(T + 1)).int()
        table[:, 3] = -1
        got = dsv4.indexer_topk(logits, lens, 512, page_table=table.to(dev), impl=impl)
        want = dsv4.indexer_topk(logits, lens, 512, page_table=table.to(dev), impl="reference")
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values), "top-k slots differ from the reference"


@case("dsv4.compress", "zero tokens (no request; requests with no new token); a request of zero new tokens among others")
def _(dev, impl):
    from . import dsv4_compress as C
    from ..kernels import dsv4

    for ratio, d in ((4, 512), (128, 128)):
        # request 1 gets no token in call 1; the others' rows equal a run without it
        full = C.make_case(ratio, d, "paged", [[5, 3], [0, 0], [9, 4]], device=dev, seed=ratio)
        alone = C.make_case(ratio, d, "paged", [[5, 3], [9, 4]], device=dev, seed=ratio)
        alone.xs = [full.xs[0], full.xs[2]]
        alone.ape, alone.norm_weight, alone.cos, alone.sin = full.ape, full.norm_weight, full.cos, full.sin
        got = C.run_calls(full, impl)
        ref = C.run_calls(alone, impl)
        for (pa, ra, rows_a), (pb, rb, rows_b) in zip(got, ref):
            assert rows_a.shape[0] == rows_b.shape[0]
            _same(rows_a, rows_b, f"ratio {ratio}: rows beside a request of no token", **_tol(impl, bf16=False))
        # a call with no token at all, with and without requests
        kw = next(C.call_args(C.make_case(ratio, d, "paged", [[4]], device=dev)))
        for B in (0, 2):
            empty = {k: (v[:0] if isinstance(v, torch.Tensor) and k in ("kv_score", "positions", "token_req",
                                                                         "out_slots") else v)
                     for k, v in kw.items()}
            empty["seq_lens"] = torch.zeros(B, dtype=torch.int32, device=dev)
            empty["query_start"] = torch.zeros(B + 1, dtype=torch.int32, device=dev)
            empty["state_table"] = kw["state_table"][:1].expand(B, -1)
            state = kw["state"].clone()
            before = kw["cache"].clone()
            rows = dsv4.compress(**{**empty, "state_rows": None}, return_rows=True, impl=impl)
            assert rows.shape == (0, d)
            _same(kw["cache"], before, "the cache after a call of no token")
            _same(kw["state"], state, "the state after a call of no token")


@case("dsv4.compress", "one token")
def _(dev, impl):
    from . import dsv4_compress as C

    for ratio, d in ((4, 512), (128, 512)):
        c = C.make_case(ratio, d, "ring", [[1]], device=dev)
        ((_, _, rows),) = C.run_calls(c, impl)
        assert rows.shape == (1, d) and bool(rows.isnan().all()), "a first token emits no row"


@case("dsv4.attention_slots", f"zero tokens; padding rows (-1); one token; {GRAPH_MAX_BATCH} tokens")
def _(dev, impl):
    from ..kernels import dsv4

    for T in (0, 1, 6, GRAPH_MAX_BATCH):
        pos = torch.randint(0, 3000, (T,), generator=_gen(T)).to(dev)
        req = torch.randint(0, 4, (T,), generator=_gen(T + 1)).int().to(dev)
        if T == 6:
            pos[2], req[4] = -1, -1
        swa = torch.randint(0, 100, (4, 24), generator=_gen(3)).int().to(dev)
        main = torch.randint(0, 30, (4, 12), generator=_gen(4)).int().to(dev)
        topk = torch.randint(-1, 700, (T, 64), generator=_gen(5)).int().to(dev)
        for ratio, kw in ((1, {}), (4, dict(main_table=main, main_rows=64, topk_local=topk)),
                          (128, dict(main_table=main, main_rows=2, width=24))):
            win, comp = _vs_reference(impl, lambda i: dsv4.attention_slots(pos, req, swa, 128, 128, ratio, **kw,
                                                                           impl=i), "attention_slots")
            assert win.shape == (T, 128)
            if T == 6:
                assert bool((win[[2, 4]] == -1).all()), "a padding row names a window slot"
                if comp is not None:
                    assert bool((comp[[2, 4]] == -1).all()), "a padding row names a compressed slot"


# ------------------------------------------------------------------------------------------ V4 model-side ops


def _model_rows(op, dev, impl, make, compare=True):
    """``op`` on 0, 1 and :data:`GRAPH_MAX_BATCH` rows (``make(T)``: the arguments); rows are independent, so the
    isolation check is the comparison with the reference (and with a run of each row's own batch on a GPU)."""
    for T in (0, 1, GRAPH_MAX_BATCH):
        args, kwargs = make(T)
        takes_impl = "impl" in inspect.signature(op).parameters
        run = (lambda i: op(*args, **kwargs, impl=i)) if takes_impl else (lambda i: op(*args, **kwargs))
        got = _vs_reference(impl if takes_impl else "reference", run, op.__name__) if compare else run(impl)
        for t in _tuple(got):
            if isinstance(t, torch.Tensor):
                assert t.shape[0] == T, f"{op.__name__}: {t.shape[0]} rows for {T}"
                assert bool(torch.isfinite(t.float()).all()), f"{op.__name__}: a non-finite result"


def _model_case(name, make):
    @case(f"model.{name}", f"zero rows; one row; {GRAPH_MAX_BATCH} rows")
    def _(dev, impl):
        from ..kernels.dsv4 import model

        _model_rows(getattr(model, name), dev, impl, lambda T: make(T, dev))


def _pos(T, dev):
    return torch.randint(0, 600, (T,), generator=_gen(T)).to(dev)


def _hc(T, dev, n=4, H=256):
    return dict(residual=_randn(T, n, H, seed=T, dev=dev, dtype=torch.bfloat16),
                fn=_randn(n * (n + 2), n * H, seed=1, dev=dev, scale=0.05),
                scale=_randn(3, seed=2, dev=dev).abs() + 0.5, base=_randn(n * (n + 2), seed=3, dev=dev, scale=0.1))


_model_case("q_norm_rope", lambda T, dev: ((_randn(T, 8, 512, seed=T, dev=dev, dtype=torch.bfloat16), 1e-6,
                                            *_rope_tables(dev), _pos(T, dev)), {}))
_model_case("rope_", lambda T, dev: ((_randn(T, 8, 64, seed=T, dev=dev, dtype=torch.bfloat16), *_rope_tables(dev),
                                      _pos(T, dev), True), {}))
_model_case("norm_rope_", lambda T, dev: ((_randn(T, 512, seed=T, dev=dev, dtype=torch.bfloat16),
                                           _randn(512, seed=1, dev=dev).abs() + 0.5, 1e-6, *_rope_tables(dev),
                                           _pos(T, dev)), {}))
_model_case("silu_and_mul_clamp", lambda T, dev: ((_randn(T, 512, seed=T, dev=dev, dtype=torch.bfloat16, scale=8),
                                                   10.0), {}))
_model_case("hc_mixes", lambda T, dev: ((_hc(T, dev)["residual"], _hc(T, dev)["fn"], 1e-6), {}))
_model_case("hc_split_sinkhorn", lambda T, dev: ((_randn(T, 24, seed=T, dev=dev), _hc(0, dev)["scale"],
                                                  _hc(0, dev)["base"], 4, 20, 1e-6), {}))
_model_case("hc_combine", lambda T, dev: ((_hc(T, dev)["residual"], _randn(T, 4, seed=T, dev=dev)), {}))
_model_case("mhc_pre", lambda T, dev: ((*_hc(T, dev).values(), 1e-6, 1e-6, 1e-6, 2.0, 20), {}))
_model_case("mhc_post", lambda T, dev: ((_randn(T, 256, seed=T, dev=dev, dtype=torch.bfloat16),
                                         _hc(T, dev)["residual"], _randn(T, 4, 1, seed=T + 1, dev=dev),
                                         _randn(T, 4, 4, seed=T + 2, dev=dev)), {}))
_model_case("hc_head", lambda T, dev: ((_hc(T, dev)["residual"], _hc(T, dev)["fn"][:4],
                                        _hc(T, dev)["scale"][:1], _hc(T, dev)["base"][:4], 1e-6, 1e-6), {}))


@case("model.moe_swiglu_experts", "zero tokens; repeated and dropped expert ids; one token; the largest batch")
def _(dev, impl):
    from ..kernels.dsv4 import model

    E, H, I = 4, 128, 64
    w13 = _randn(E, 2 * I, H, seed=1, dev=dev, dtype=torch.bfloat16, scale=0.1)
    w2 = _randn(E, H, I, seed=2, dev=dev, dtype=torch.bfloat16, scale=0.1)
    for T in (0, 1, 7, GRAPH_MAX_BATCH):
        x = _randn(T, H, seed=T, dev=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (T, 2), generator=_gen(T)).to(dev)
        wts = _randn(T, 2, seed=T + 1, dev=dev).abs()
        if T == 7:
            ids[0] = torch.tensor([2, 2])  # both choices one expert: the sum of both
            ids[3] = torch.tensor([-1, E])  # none on this rank: zero
        got = model.moe_swiglu_experts(x, w13, w2, wts, ids, 10.0)
        assert got.shape == (T, H)
        if T == 7:
            def one(t, e):
                h = model.silu_and_mul_clamp(x[t:t + 1] @ w13[e].t(), 10.0, impl="reference")
                return (h @ w2[e].t()).float()[0]

            want0 = (one(0, 2) * wts[0, 0] + one(0, 2) * wts[0, 1])
            _same(got[0].float(), want0, "a repeated expert: the sum of both choices", atol=2e-2, rtol=2e-2)
            assert torch.equal(got[3].float(), torch.zeros(H, device=dev)), "dropped choices add something"
            keep = [1, 2, 4, 5, 6]
            alone = model.moe_swiglu_experts(x[keep], w13, w2, wts[keep], ids[keep], 10.0)
            _same(got[keep], alone, "tokens beside repeated and dropped ids", atol=0.0, rtol=0.0)


# ------------------------------------------------------------------------------------------------------- MoE


def _moe_weights(dev, E=4, H=256, I=128, fp4=False, seed=0):
    from ..kernels import moe

    if fp4:
        w13, s13 = moe.quantize_fp4_reference(torch.randn(E, 2 * I, H, generator=_gen(seed)) / 8)
        w2, s2 = moe.quantize_fp4_reference(torch.randn(E, H, I, generator=_gen(seed + 1)) / 8)
    else:
        w13, s13 = moe.quantize_weight_blocks_reference(torch.randn(E, 2 * I, H, generator=_gen(seed)) / 16)
        w2, s2 = moe.quantize_weight_blocks_reference(torch.randn(E, H, I, generator=_gen(seed + 1)) / 16)
    return w13.to(dev), s13.to(dev), w2.to(dev), s2.to(dev)


def _experts(dev, impl, T, ids, layout, fp4=False, expert_map=None, E=4, subset=None):
    """``fused_experts`` on ``T`` random tokens routed by ``ids`` (only the tokens ``subset`` when given): ``(x,
    weights, result, the float32 formula's result)``."""
    from ..kernels import moe

    w13, s13, w2, s2 = _moe_weights(dev, E=E, fp4=fp4)
    x = _randn(T, 256, seed=T + 11, dev=dev, dtype=torch.bfloat16, scale=4.0)
    wts = _randn(T, ids.shape[1], seed=T + 12, dev=dev).abs()
    if subset is not None:
        x, wts, ids, T = x[subset], wts[subset], ids[subset], len(subset)
    out = torch.full((T, 256), float("nan"), dtype=torch.bfloat16, device=dev)
    kw = dict(w13_scale=s13, w2_scale=s2, swiglu_limit=10.0, expert_map=expert_map)
    got = moe.fused_experts(x, w13, w2, wts, ids.to(dev), out=out, layout=layout, impl=impl, **kw)
    assert got is out
    want = moe.fused_experts_reference(x, w13, w2, wts, ids.to(dev), **kw)
    return x, wts, got, want


@case("moe.fused_experts", "zero tokens, both layouts and weight formats")
def _(dev, impl):
    for layout in ("masked", "contiguous"):
        for fp4 in (False, True):
            _, _, got, _ = _experts(dev, impl, 0, torch.empty(0, 2, dtype=torch.int32), layout, fp4)
            assert got.shape == (0, 256)


@case("moe.fused_experts", "repeated and dropped expert ids among ordinary tokens: the sum of both choices, "
                           "zero rows, the others unchanged")
def _(dev, impl):
    T, E = 7, 4
    ids = torch.stack([torch.randperm(E, generator=_gen(t))[:2] for t in range(T)]).int()
    ids[:, 0] = 1  # expert 1 gets every token once ...
    ids[0] = torch.tensor([1, 1])  # ... and token 0 twice: more choices than the masked layout's T rows
    ids[3] = torch.tensor([-1, -1])  # no expert: a zero row
    ids[5, 1] = E + 2  # past the experts: dropped
    for layout in ("masked", "contiguous"):
        for fp4 in (False, True):
            x, wts, got, want = _experts(dev, impl, T, ids, layout, fp4)
            _l2(got, want, f"{layout}{' fp4' if fp4 else ''} against the float32 formula")
            assert torch.equal(got[3].float(), torch.zeros(256, device=dev)), "a token with no expert is not zero"
            keep = [1, 2, 4, 6]
            _, _, alone, _ = _experts(dev, impl, T, ids, layout, fp4, subset=keep)
            _same(got[keep], alone, f"{layout}: tokens beside repeated and dropped ids", atol=0, rtol=2 ** -7)


@case("moe.fused_experts", f"one token; {GRAPH_MAX_BATCH} tokens; a rank holding none of the experts")
def _(dev, impl):
    for T, layout in ((1, "masked"), (1, "contiguous"), (GRAPH_MAX_BATCH, "masked"),
                      (GRAPH_MAX_BATCH, "contiguous")):
        ids = torch.stack([torch.randperm(4, generator=_gen(t))[:2] for t in range(T)]).int()
        _, _, got, want = _experts(dev, impl, T, ids, layout)
        _l2(got, want, f"{layout}, {T} tokens")
    emap = torch.full((16,), -1, dtype=torch.int32, device=dev)  # 16 global experts, none here
    ids = torch.randint(0, 16, (5, 2), generator=_gen(5)).int()
    _, _, got, _ = _experts(dev, impl, 5, ids, "masked", expert_map=emap)
    assert torch.equal(got.float(), torch.zeros(5, 256, device=dev)), "no local expert: not zero"


@case("moe.align_routing", "zero tokens; every choice dropped")
def _(dev, impl):
    from ..kernels import moe

    for ids in (torch.empty(0, 2, dtype=torch.int32), torch.full((3, 2), -1, dtype=torch.int32)):
        src, layout = moe.align_routing(ids.to(dev), 4)
        assert src.shape == layout.shape and src.numel() % moe.ALIGN == 0
        assert bool((src == -1).all() and (layout == -1).all()), "a dropped choice took a row"


@case("moe.quantize_groups", "zero rows")
def _(dev, impl):
    from ..kernels import moe

    q, s = moe.quantize_groups(torch.empty(0, 256, device=dev))
    assert q.shape == (0, 256) and s.shape == (0, 2)


@case("moe.dequantize_groups", "zero rows")
def _(dev, impl):
    from ..kernels import moe

    x = moe.dequantize_groups(*moe.quantize_groups(torch.empty(0, 256, device=dev)))
    assert x.shape == (0, 256)


def _fp8_rows(M, K, dev, seed):
    from ..kernels import moe

    return moe.quantize_groups(_randn(M, K, seed=seed, dev=dev, scale=3.0))


@case("moe.grouped_gemm_fp8", "zero rows; every row padding (-1): nothing written")
def _(dev, impl):
    from ..kernels import moe

    for fp4 in (False, True):
        w13, s13, _, _ = _moe_weights(dev, fp4=fp4)
        for M in (0, 128):
            a, sa = _fp8_rows(M, 256, dev, M)
            out = torch.full((M, 256), float("nan"), dtype=torch.bfloat16, device=dev)
            moe.grouped_gemm_fp8(a, sa, w13, s13, torch.full((M,), -1, dtype=torch.int32, device=dev), out,
                                 impl=impl)
            assert bool(out.isnan().all()), "a padding row was written"


@case("moe.grouped_gemm_fp8_masked", "max_m 0; every count 0, negative or past max_m")
def _(dev, impl):
    from ..kernels import moe

    for fp4 in (False, True):
        w13, s13, _, _ = _moe_weights(dev, fp4=fp4)
        for MM, counts in ((0, [0, 0, 0, 0]), (64, [0, -3, 0, 0]), (64, [0, 0, 200, 0])):
            a, sa = (t.view(4, MM, t.shape[1]) for t in _fp8_rows(4 * MM, 256, dev, MM))
            out = torch.full((4, MM, 256), float("nan"), dtype=torch.bfloat16, device=dev)
            m = torch.tensor(counts, dtype=torch.int32, device=dev)
            moe.grouped_gemm_fp8_masked(a, sa, w13, s13, m, out, impl=impl)
            written = torch.arange(MM, device=dev)[None, :] < m.clamp(0, MM)[:, None]
            assert bool(out[~written].isnan().all()), "a row past its expert's count was written"
            if written.any():
                want = moe.grouped_gemm_fp8_masked(a, sa, w13, s13, m, impl="reference")
                _same(out[written], want[written], "rows within the clamped count", **_tol(impl))


@case("moe.swiglu_quant", "zero rows; no row named; every index invalid")
def _(dev, impl):
    from ..kernels import moe

    for R, rows in ((0, []), (5, []), (5, [-1, 5, 99])):
        h = _randn(R, 256, seed=R, dev=dev, dtype=torch.bfloat16)
        q = torch.full((R, 128), float("nan"), device=dev).to(torch.float8_e4m3fn)
        s = torch.full((R, 1), float("nan"), device=dev)
        moe.swiglu_quant(h, torch.tensor(rows, dtype=torch.int32, device=dev), 10.0, (q, s), impl=impl)
        assert bool(q.float().isnan().all() and s.isnan().all()), "a row no valid index names was written"


@case("moe.grouped_gemm_swiglu_fp8", "zero rows; every row padding")
def _(dev, impl):
    from ..kernels import moe

    w13, s13, _, _ = _moe_weights(dev)
    for M in (0, 128):
        a, sa = _fp8_rows(M, 256, dev, M)
        q = torch.full((M, 128), float("nan"), device=dev).to(torch.float8_e4m3fn)
        s = torch.full((M, 1), float("nan"), device=dev)
        moe.grouped_gemm_swiglu_fp8(a, sa, w13, s13, torch.full((M,), -1, dtype=torch.int32, device=dev), 10.0,
                                    (q, s), impl=impl)
        assert bool(q.float().isnan().all() and s.isnan().all()), "a padding row was written"


@case("moe.grouped_gemm_swiglu_fp8_masked", "max_m 0; every count 0 or negative")
def _(dev, impl):
    from ..kernels import moe

    w13, s13, _, _ = _moe_weights(dev)
    for MM, counts in ((0, [0] * 4), (64, [0, -1, 0, -9])):
        a, sa = (t.view(4, MM, t.shape[1]) for t in _fp8_rows(4 * MM, 256, dev, MM))
        q = torch.full((4, MM, 128), float("nan"), device=dev).to(torch.float8_e4m3fn)
        s = torch.full((4, MM, 1), float("nan"), device=dev)
        moe.grouped_gemm_swiglu_fp8_masked(a, sa, w13, s13, torch.tensor(counts, dtype=torch.int32, device=dev),
                                           10.0, (q, s), impl=impl)
        assert bool(q.float().isnan().all() and s.isnan().all()), "a row past its count was written"


@case("moe.route_masked", "zero tokens; every choice dropped (no local expert, ids past the map, a token naming one "
                          "expert at every choice): the reference's slots and counts, a dropped choice at the spare row")
def _(dev, impl):
    from ..kernels import moe

    E = 4
    emap = torch.tensor([-1, 2, -1], dtype=torch.int32, device=dev)
    for ids, m in ((torch.empty(0, 3, dtype=torch.int32), None), (torch.full((2, 3), -1, dtype=torch.int32), None),
                   (torch.tensor([[0, 2, 5], [7, -3, 0]], dtype=torch.int32), emap),
                   (torch.full((3, 3), 1, dtype=torch.int32), emap)):
        ids = ids.to(dev)
        w = _randn(ids.shape[0], 3, seed=ids.shape[0], dev=dev).abs()
        slot, merged, counts = moe.route_masked(ids, w, E, m, impl=impl)
        rs, rm, rc = moe.route_masked_reference(ids, w, E, m)
        T = ids.shape[0]
        assert slot.shape == (T, 3) and merged.shape == (T, 3) and counts.shape == (E,)
        assert torch.equal(slot.long(), rs.long()) and torch.equal(counts, rc), "routing differs from the rule"
        _same(merged, rm, "merged weights", atol=1e-6, rtol=1e-6)
        assert int(counts.sum()) == int((slot < E * T).sum()), "a counted choice without a row (or the reverse)"
    assert int(counts.sum()) == 3 and bool((slot[:, 0] == torch.arange(3, device=dev) + 2 * 3).all()), \
        "a token naming one expert three times: one row each, the others dropped"


@case("moe.quantize_scatter", "zero tokens; zero rows; every destination dropped")
def _(dev, impl):
    from ..kernels import moe

    for T, rows, dest in ((0, 8, []), (3, 0, [[0, 1]] * 3), (3, 8, [[-1, 8], [9, -2], [-1, -1]])):
        x = _randn(T, 256, seed=T, dev=dev, dtype=torch.bfloat16)
        d = torch.tensor(dest, dtype=torch.int32, device=dev).view(T, 2)
        a, sa = moe.quantize_scatter(x, d, rows, impl=impl)
        assert a.shape == (rows, 256) and sa.shape == (rows, 2)


@case("moe.combine_experts", "zero tokens; zero rows; every choice dropped: zero rows, the others unchanged")
def _(dev, impl):
    from ..kernels import moe

    for T, R, rows in ((0, 6, []), (2, 0, [[0, 1], [-1, 3]]), (4, 6, [[0, 1], [-1, 6], [2, 2], [-5, 9]])):
        y = _randn(R, 256, seed=R, dev=dev, dtype=torch.bfloat16)
        r = torch.tensor(rows, dtype=torch.int32, device=dev).view(T, 2)
        w = _randn(T, 2, seed=T, dev=dev).abs()
        out = torch.full((T, 256), float("nan"), dtype=torch.bfloat16, device=dev)
        got = _vs_reference(impl, lambda i: moe.combine_experts(y, r, w, out.clone(), impl=i), "combine_experts")
        assert got.shape == (T, 256)
        if T == 4:
            assert torch.equal(got[[1, 3]].float(), torch.zeros(2, 256, device=dev)), "a dropped choice added"
            alone = moe.combine_experts(y, r[[0, 2]], w[[0, 2]], impl=impl)
            _same(got[[0, 2]], alone, "tokens beside dropped choices", atol=0.0, rtol=0.0)
        if R == 0:
            assert torch.equal(got.float(), torch.zeros(T, 256, device=dev)), "no row: not zero"
