"""Degenerate batches through our vLLM 0.33.0 DeepSeek-V4 layer (:class:`musa_attn_backend.vllm.dsv4.
MusaDeepseekV4Attention` with its metadata builders) and vLLM's FP8 MoE kernel on our experts class
(:mod:`musa_attn_backend.vllm.moe`), run on a CPU as ``python -m musa_attn_backend.testing.vllm_dsv4_degenerate
OUT.json`` in a fresh interpreter (``tests/vllm/test_vllm_degenerate.py`` reads the report).

Fixture: the tiny V4 of ``integration_tests/tiny_dsv4.py`` (ratios 0/4/128/4, 8 heads, ``index_topk`` 16), its four
layers built by vLLM's constructors with the reference checkpoint's weights, caches planned, allocated and bound
by vLLM's functions in one buffer of random bytes (as :mod:`.vllm_dsv4_layer`). Every case starts from the same
cache bytes (a snapshot taken after the set-up prefill), so the cases are independent.

What each case reports (the test asserts on it):

- ``rel_err`` of a token's output against the independent float32 forward (``dsv4_reference.Reference.
  _attention`` over the request's whole sequence; on the C4 layers fed the indexer rows our layer chose, as
  :mod:`.vllm_dsv4_layer` does): ``[mean |err|, max |err|] / mean |want|`` per layer;
- ``others_rel``: the largest |difference| of the other tokens' outputs between the batch with the degenerate
  part and the same batch without it (same cache bytes before each run), over the mean |output|;
- ``cache_foreign_blocks``: physical blocks whose bytes differ between those two runs' caches although no
  degenerate request owns them (a write into another request's rows or into free blocks); ``state_diff``: the
  largest difference in the real requests' own float32 compressor-state rows (the CPU float32 GEMM rounds a row
  differently from one batch size to another: last-bit differences only); ``cache_changed_blocks``: blocks
  changed by a run that may write nothing (dummy, profile, 0 tokens);
- ``error``: the exception (type, message, innermost frames) where a case raised.

MoE (``Fp8Config`` 128 x 128 blocks, 4 experts, H 256, I 128, top-2, SwiGLU clamp 10, the kernel vLLM builds:
no-EP prepare/finalize + our experts) against ``kernels.moe.fused_experts_reference`` (``ref_diff``, exact on a
CPU: the same math), and other tokens against the batch of the other tokens alone (``others_diff``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPK = 16
# vLLM 0.33's largest CUDA-graph capture size by default (config/vllm.py _set_cudagraph_sizes: min(max_num_seqs *
# decode_query_len * 2, 512) on Hopper-class GPUs, 1024 only on data-centre Blackwell): a decode batch this large
LARGE = 512
LONG, SHORT, MID = 150, 40, 20  # the set-up requests' lengths (A: the indexer scores, C128 has a row; B; F)
A, B, F = 0, 1, 2


def _error(e: BaseException) -> dict:
    frames = traceback.extract_tb(e.__traceback__)[-4:]
    return {"type": type(e).__name__, "message": str(e)[:600],
            "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]}


class Rig:
    """The layers, their caches and builders, and batches run through them (see the module docstring)."""

    def __init__(self, fx, torch, config, weights, vc):
        from musa_attn_backend.testing.vllm_dsv4_layer import load
        from musa_attn_backend.vllm.dsv4 import MusaDeepseekV4Attention, MusaV4MetadataBuilder
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.torch, self.fx, self.vc, self.config, self.weights = torch, fx, vc, config, weights
        self.dev = torch.device("cpu")
        self.topk_buf = torch.full((vc.scheduler_config.max_num_batched_tokens, TOPK), -7, dtype=torch.int32)
        self.layers = {}
        with torch.device(self.dev), set_default_torch_dtype(vc.model_config.dtype):
            for i in range(config["num_hidden_layers"]):
                self.layers[i] = MusaDeepseekV4Attention(vc, prefix=f"model.layers.{i}.attn",
                                                         topk_indices_buffer=self.topk_buf)
        for i, layer in self.layers.items():
            load(layer, weights, i, self.dev)
        named = {}
        for layer in self.layers.values():
            for m in layer.modules():
                if hasattr(m, "get_kv_cache_spec") and hasattr(m, "get_attn_backend"):
                    named[m.prefix] = m
        self.caches = fx.allocate(vc, named, "cpu")
        g = torch.Generator().manual_seed(0)
        self.caches.buffer.copy_(torch.randint(0, 256, self.caches.buffer.shape, dtype=torch.uint8, generator=g))
        self.builders = [MusaV4MetadataBuilder(spec, names, vc, self.dev) for spec, names, _ in self.caches.groups]
        self.sched = fx.Scheduler(self.caches, max_blocks=vc.model_config.max_model_len // 4 + 1, seed=1)
        self.block_bytes = self.layers[0].swa_cache_layer.kv_cache.stride(0)  # the packed physical block
        assert self.caches.buffer.numel() == self.caches.num_blocks * self.block_bytes
        self.pages = []  # per group: the byte ranges of its layers' pages in a physical block
        for _, names, _ in self.caches.groups:
            ranges = []
            for n in names:
                v = named[n].kv_cache
                lo = v.data_ptr() - self.caches.buffer.data_ptr()
                assert v.stride(0) * v.element_size() == self.block_bytes and 0 <= lo < self.block_bytes
                ranges.append((lo, lo + v[0].numel() * v.element_size()))
            self.pages.append(ranges)
        self._snaps: dict = {}
        self.gen = torch.Generator().manual_seed(5)
        self.xs: dict = {}  # request -> its hidden states, every position

    def x(self, r: int, upto: int):
        """Request ``r``'s hidden states ``[upto, H]`` (grown on demand, fixed once drawn)."""
        torch = self.torch
        have = self.xs.get(r)
        if have is None or have.shape[0] < upto:
            n = upto - (0 if have is None else have.shape[0])
            more = (torch.randn(n, self.config["hidden_size"], generator=self.gen) * 0.5).to(torch.bfloat16)
            self.xs[r] = more if have is None else torch.cat([have, more])
        return self.xs[r][:upto]

    # --- metadata
    def common(self, batch, pad_to: int = 0, full_pad_reqs: int = 0):
        """The per-group ``CommonAttentionMetadata`` of ``batch`` [(request, start, query_len)] as vLLM's runner
        builds it, and ``positions``: query lengths of 0 allowed (a request with no rows), an empty batch too.
        ``pad_to``: the layer runs that many rows (a CUDA-graph-padded batch, eager/PIECEWISE as vLLM runs our
        layers: ``num_actual_tokens`` stays the real count, the slot mapping is -1 past it, the padding rows'
        positions are whatever the buffer held: random here). ``full_pad_reqs``: also that many requests of no
        rows and no context and every row counted (``num_actual_tokens = pad_to``), as a FULL graph pads."""
        torch = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        lens = [n for _, _, n in batch] + [0] * full_pad_reqs
        seq = [s + n for _, s, n in batch] + [0] * full_pad_reqs
        qsl = torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
        T = int(qsl[-1])
        Tp = max(pad_to, T)
        pos = torch.cat([torch.arange(s, s + n) for _, s, n in batch] + [torch.zeros(0, dtype=torch.long)])
        stale = torch.randint(0, self.vc.model_config.max_model_len, (Tp - T,), generator=self.gen)
        out = []
        for gi, (spec, _, _) in enumerate(self.caches.groups):
            bs = spec.block_size
            table = torch.full((len(lens), self.sched.max_blocks), -1, dtype=torch.int32)
            if full_pad_reqs:
                table[len(batch):] = 0  # vLLM's padded rows: the null block
            slots = [torch.full((Tp - T,), -1, dtype=torch.long)]
            for i, (r, s, n) in enumerate(batch):
                t = self.sched._table(gi, r, s + n)
                table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
                p = torch.arange(s, s + n)
                slots.insert(-1, table[i].long()[p // bs] * bs + p % bs)
            out.append(CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32),
                num_reqs=len(lens), num_actual_tokens=Tp if full_pad_reqs else T, max_query_len=max(lens, default=0),
                max_seq_len=max(seq, default=0), block_table_tensor=table, slot_mapping=torch.cat(slots),
                positions=torch.cat([pos, stale])))
        return out, torch.cat([pos, stale])

    def dummy_common(self, n: int):
        """What vLLM's model runner V2 builds for a DP dummy batch (``_dummy_run(1, uniform_decode=True)``, padded to
        ``n`` tokens by the DP sync): ``n`` requests of one token (``seq_lens`` 1), every position 0, block tables
        of the null block 0, every slot -1 (``InputBatch.make_dummy``, ``prepare_dummy_attn``)."""
        torch = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl = torch.arange(n + 1, dtype=torch.int32)
        out = [CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.ones(n, dtype=torch.int32), num_reqs=n,
            num_actual_tokens=n, max_query_len=1, max_seq_len=1,
            block_table_tensor=torch.zeros(n, self.sched.max_blocks, dtype=torch.int32),
            slot_mapping=torch.full((n,), -1, dtype=torch.long), positions=torch.zeros(n, dtype=torch.long))
            for _ in self.caches.groups]
        return out, torch.zeros(n, dtype=torch.long)

    # --- running
    def forward(self, cms, positions, h, metadata: bool = True):
        """Every layer on ``h`` with the metadata built from ``cms`` (None: a profile run's). Returns ``({layer:
        out float32}, {C4 layer: its top-k rows})``."""
        from vllm.forward_context import set_forward_context

        md = None
        if metadata:
            md = {}
            for (spec, names, _), b, cm in zip(self.caches.groups, self.builders, cms):
                built = b.build(0, cm)
                md.update({n: built for n in names})
        ys, chosen = {}, {}
        for i, layer in self.layers.items():
            with set_forward_context(md, self.vc), self.torch.no_grad():
                ys[i] = layer(positions, h).float()
            if layer.compress_ratio == 4:
                chosen[i] = self.topk_buf[:h.shape[0]].clone()
        return ys, chosen

    def run(self, batch, pad_to: int = 0, full_pad_reqs: int = 0, pad_rows=None):
        cms, pos = self.common(batch, pad_to, full_pad_reqs)
        h = [self.x(r, s + n)[s:] for r, s, n in batch]
        T = sum(n for _, _, n in batch)
        if pos.shape[0] > T:
            h.append(pad_rows if pad_rows is not None else
                     (self.torch.randn(pos.shape[0] - T, self.config["hidden_size"], generator=self.gen) * 3)
                     .to(self.torch.bfloat16))
        h = self.torch.cat(h) if h else self.torch.zeros(0, self.config["hidden_size"], dtype=self.torch.bfloat16)
        return self.forward(cms, pos, h)

    def snapshot(self, name: str):
        """The cache bytes now, kept under ``name`` (one buffer a name, allocated once: the pool is hundreds of MB
        and fresh allocations of that size cost page faults every time)."""
        buf = self._snaps.get(name)
        if buf is None:
            buf = self._snaps[name] = self.torch.empty_like(self.caches.buffer)
        buf.copy_(self.caches.buffer)
        return buf

    def restore(self, snap):
        self.caches.buffer.copy_(snap)

    def _blocks(self, t):
        return t.view(-1, self.block_bytes)

    def changed_blocks(self, a, b) -> list:
        """The physical blocks whose bytes differ between two snapshots (compared a chunk of blocks at a time)."""
        A, B = self._blocks(a), self._blocks(b)
        out = []
        for lo in range(0, A.shape[0], 256):
            d = (A[lo:lo + 256] != B[lo:lo + 256]).any(1).nonzero().flatten()
            out += (d + lo).tolist()
        return out

    def cache_check(self, after, ref, allowed: set, real: set) -> dict:
        """Where two runs' caches differ: ``foreign`` blocks (a write no request of the batch may make: a block of
        no request, or one of a request in ``real`` outside its float32 compressor-state pages), and the largest
        difference in ``real`` requests' state pages, whose float32 rows legitimately differ in the last bits
        (the CPU float32 GEMM rounds a row differently from one batch size to another). Blocks of ``allowed``
        requests (the degenerate ones) may differ."""
        torch = self.torch
        owner = {b: (gi, r) for (gi, r), t in self.sched.tables.items() for b in t}
        foreign, state_diff = [], 0.0
        A, B = self._blocks(after), self._blocks(ref)
        for b in self.changed_blocks(after, ref):
            gi, r = owner.get(b, (None, None))
            if r in allowed:
                continue
            if r in real and self.caches.groups[gi][0].dtype == torch.float32:
                in_page = torch.zeros(self.block_bytes, dtype=torch.bool)
                for lo, hi in self.pages[gi]:
                    in_page[lo:hi] = True
                    x, y = A[b, lo:hi].view(torch.float32), B[b, lo:hi].view(torch.float32)
                    d = torch.where((x == y) | (torch.isnan(x) & torch.isnan(y)), 0.0, (x - y).abs())
                    state_diff = max(state_diff, float(d.nan_to_num(float("inf")).max()))
                if bool((A[b][~in_page] == B[b][~in_page]).all()):
                    continue
            foreign.append(b)
        return {"foreign_blocks": len(foreign), "state_diff": state_diff}

    # --- checks
    def rel_err(self, r: int, upto: int, layer: int, got, chosen_row=None) -> list:
        """``[mean, max] |got - want| / mean |want|`` of request ``r``'s token at ``upto - 1`` against the float32
        forward of its first ``upto`` tokens (C4 layers: fed our top-k row for that token)."""
        import dsv4_reference as ref_mod

        torch = self.torch
        ref = ref_mod.Reference(self.config, self.weights)
        if chosen_row is not None:
            own = ref._indexer

            def indexer(xx, qr, ang, prefix):
                theirs = own(xx, qr, ang, prefix).clone()
                mine = chosen_row.long()
                k = theirs.shape[1]
                theirs[-1] = torch.where(mine[:k] >= 0, mine[:k], -1)
                return theirs

            ref._indexer = indexer
        want = ref._attention(self.x(r, upto).float(), layer)[-1]
        err = (got - want).abs()
        scale = want.abs().mean()
        return [float(err.mean() / scale), float(err.max() / scale)]

    def check_tokens(self, ys, chosen, rows: dict) -> dict:
        """``rows``: {batch row: (request, tokens so far)}: rel_err per layer of each."""
        out = {}
        for t, (r, upto) in rows.items():
            out[f"req{r}@{upto - 1}"] = {
                str(i): self.rel_err(r, upto, i, ys[i][t], chosen[i][t] if i in chosen else None)
                for i in self.layers}
        return out


def _max_diff(torch, ys_a, rows_a, ys_b, rows_b) -> float:
    """The largest |difference| over every layer between rows ``rows_a`` of one run and ``rows_b`` of another."""
    if not rows_a:
        return 0.0
    ia, ib = torch.tensor(rows_a), torch.tensor(rows_b)
    return max(float((ys_a[i][ia] - ys_b[i][ib]).abs().max()) for i in ys_a)


def attention_cases(rig: Rig) -> dict:
    torch = rig.torch
    rep: dict = {}
    # set-up: A (150 tokens: its decode token's indexer scores 37 compressed rows, the C128 layer has one row),
    # B (40) and F (20) prefilled in one step; every case starts from these cache bytes
    rig.run([(A, 0, LONG), (B, 0, SHORT), (F, 0, MID)])
    base = rig.snapshot("base")
    pair = [(A, LONG, 1), (B, SHORT, 1)]

    def case(name, fn):
        rig.restore(base)
        t0 = time.time()
        try:
            rep[name] = fn()
        except Exception as e:  # reported: the test names the case and the frames
            rep[name] = {"error": _error(e)}
        rep[name]["seconds"] = round(time.time() - t0, 2)

    # the plain pair, A and B decoding: what every other case's A and B rows and caches are compared with
    ys_pair, _ = rig.run(pair)
    cache_pair = rig.snapshot("pair")
    pair_scale = min(float(y.abs().mean()) for y in ys_pair.values())

    def others(ys, rows):
        return _max_diff(torch, ys, rows, ys_pair, [0, 1]) / pair_scale

    def with_and_without(batch, other_rows, new_reqs, pad_to=0, full_pad_reqs=0):
        """``batch`` (the pair plus degenerate parts) against the pair alone: the pair's rows (``other_rows`` in
        ``batch``) and every cache byte outside ``new_reqs``' blocks."""
        ys, ch = rig.run(batch, pad_to, full_pad_reqs)
        chk = rig.cache_check(rig.snapshot("after"), cache_pair, set(new_reqs), {A, B})
        res = {"rows": int(ys[0].shape[0]), "others_rel": others(ys, other_rows),
               "cache_foreign_blocks": chk["foreign_blocks"], "state_diff": chk["state_diff"]}
        return res, ys, ch

    def single_decode():  # one token, alone: against the reference and against the same token in the pair
        ys, ch = rig.run([(A, LONG, 1)])
        return {"ref": rig.check_tokens(ys, ch, {0: (A, LONG + 1)}),
                "others_rel": _max_diff(torch, ys, [0], ys_pair, [0]) / pair_scale}

    def one_token_prompt():  # a request with no context and a 1-token prompt, between A and B
        C = 3
        res, ys, ch = with_and_without([(A, LONG, 1), (C, 0, 1), (B, SHORT, 1)], [0, 2], {C})
        res["ref"] = rig.check_tokens(ys, ch, {1: (C, 1)})
        return res

    def short_prompt_first_chunk():  # a 0-context 3-token prompt (its positions 0, 1, 2)
        C = 4
        res, ys, ch = with_and_without([(A, LONG, 1), (C, 0, 3), (B, SHORT, 1)], [0, 4], {C})
        res["ref"] = rig.check_tokens(ys, ch, {1: (C, 1), 3: (C, 3)})
        return res

    def zero_length_requests():  # F: context, no new token; Z: neither (a FULL graph's padded request)
        Z = 5
        res, _, _ = with_and_without([(A, LONG, 1), (F, MID, 0), (Z, 0, 0), (B, SHORT, 1)], [0, 1], {F, Z})
        return res

    def padded_decode():  # the pair as 8 rows: 6 padding rows (slot -1, stale positions, junk hidden states)
        res, ys, _ = with_and_without(pair, [0, 1], set(), pad_to=8)
        res["padding_finite"] = bool(all(torch.isfinite(y[2:]).all() for y in ys.values()))
        return res

    def padded_mixed():  # A decoding, C's 5-token first chunk, B decoding, padded to 16 rows
        C = 6
        res, ys, ch = with_and_without([(A, LONG, 1), (C, 0, 5), (B, SHORT, 1)], [0, 6], {C}, pad_to=16)
        res["ref"] = rig.check_tokens(ys, ch, {5: (C, 5)})
        return res

    def full_graph_padding():  # the pair, 2 padded requests of no rows, all 4 rows counted as actual tokens
        res, _, _ = with_and_without(pair, [0, 1], set(), pad_to=4, full_pad_reqs=2)
        return res

    def changed_since(before) -> int:
        return len(rig.changed_blocks(rig.caches.buffer, before))

    def dp_dummy(n):
        def fn():
            cms, pos = rig.dummy_common(n)
            h = (torch.randn(n, rig.config["hidden_size"], generator=rig.gen) * 0.5).to(torch.bfloat16)
            before = rig.snapshot("before")
            ys, _ = rig.forward(cms, pos, h)
            return {"rows": int(ys[0].shape[0]), "cache_changed_blocks": changed_since(before)}
        return fn

    def profile(n):  # vLLM's profile run (skip_attn) and V1's dummy runs: no attention metadata at all
        def fn():
            h = (torch.randn(n, rig.config["hidden_size"], generator=rig.gen) * 0.5).to(torch.bfloat16)
            before = rig.snapshot("before")
            ys, _ = rig.forward(None, torch.zeros(n, dtype=torch.long), h, metadata=False)
            return {"rows": int(ys[0].shape[0]), "all_zero": bool(all((y == 0).all() for y in ys.values())),
                    "cache_changed_blocks": changed_since(before)}
        return fn

    def zero_tokens(batch):
        def fn():
            before = rig.snapshot("before")
            ys, _ = rig.run(batch)
            return {"shapes": [list(y.shape) for y in ys.values()], "cache_changed_blocks": changed_since(before)}
        return fn

    def large_decode():
        """``LARGE`` decode tokens: A, ``LARGE - 2`` short requests (contexts 0-3, prefilled first) and B. A's and B's
        rows and caches against the pair's; a sample of rows against the reference."""
        shorts = list(range(100, 100 + LARGE - 2))
        ctx = {r: (7 * r) % 4 for r in shorts}
        rig.run([(r, 0, ctx[r]) for r in shorts if ctx[r]])  # about 760 tokens, one step
        batch = [(A, LONG, 1)] + [(r, ctx[r], 1) for r in shorts] + [(B, SHORT, 1)]
        t0 = time.time()
        ys, ch = rig.run(batch)
        res = {"tokens": len(batch), "decode_seconds": round(time.time() - t0, 2),
               "others_rel": others(ys, [0, len(batch) - 1]),
               "finite": bool(all(torch.isfinite(y).all() for y in ys.values()))}
        chk = rig.cache_check(rig.snapshot("after"), cache_pair, set(shorts), {A, B})
        res.update(cache_foreign_blocks=chk["foreign_blocks"], state_diff=chk["state_diff"])
        sample = {t: (r, ctx[r] + 1) for t, (r, _, _) in enumerate(batch) if t % 97 == 1}
        res["ref"] = rig.check_tokens(ys, ch, {0: (A, LONG + 1), **sample})
        return res

    case("single_decode", single_decode)
    case("one_token_prompt", one_token_prompt)
    case("short_prompt_first_chunk", short_prompt_first_chunk)
    case("zero_length_requests", zero_length_requests)
    case("padded_decode", padded_decode)
    case("padded_mixed", padded_mixed)
    case("full_graph_padding", full_graph_padding)
    case("dp_dummy_1", dp_dummy(1))
    case("dp_dummy_4", dp_dummy(4))
    case("profile_0", profile(0))
    case("profile_64", profile(64))
    case("zero_tokens_empty_batch", zero_tokens([]))
    case("zero_tokens_zero_length_request", zero_tokens([(F, MID, 0)]))
    case("large_decode", large_decode)
    return rep


# ------------------------------------------------------------------------------------------------------------ MoE
def moe_cases(torch) -> dict:
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from musa_attn_backend.kernels import moe

    E, H, I, K = 4, 256, 128, 2
    qc = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    runner = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
                             quant_config=qc, swiglu_limit=10.0, prefix="model.layers.0.mlp.experts")
    qm = runner._quant_method
    rep: dict = {"experts_cls": getattr(qm.experts_cls, "__name__", str(qm.experts_cls))}
    if rep["experts_cls"] != "MusaBlockFp8Experts":
        return rep
    g = torch.Generator().manual_seed(0)
    layer = runner.routed_experts
    w13, s13 = moe.quantize_weight_blocks_reference(torch.randn(E, 2 * I, H, generator=g) * 0.2)
    w2, s2 = moe.quantize_weight_blocks_reference(torch.randn(E, H, I, generator=g) * 0.2)
    for name, t in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale_inv", s13),
                    ("w2_weight_scale_inv", s2)):
        getattr(layer, name).data.copy_(t)
    qm.process_weights_after_loading(layer)
    kernel = qm.moe_kernel

    def apply(x, w, ids, emap=None):
        return kernel.apply(x, layer.w13_weight, layer.w2_weight, w, ids, activation=MoEActivation.SILU,
                            global_num_experts=E, expert_map=emap, apply_router_weight_on_input=False)

    def reference(x, w, ids, emap=None):
        return moe.fused_experts_reference(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, swiglu_limit=10.0,
                                           expert_map=emap)

    def routing(T, seed):
        gg = torch.Generator().manual_seed(seed)
        x = (torch.randn(T, H, generator=gg)).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=gg).topk(K, 1).indices.to(torch.int32)
        w = torch.rand(T, K, generator=gg)
        return x, w, ids

    def case(name, fn):
        try:
            rep[name] = fn()
        except Exception as e:
            rep[name] = {"error": _error(e)}

    def zero_tokens():
        x, w, ids = routing(0, 1)
        out = apply(x, w, ids)
        return {"shape": list(out.shape)}

    def one_token():
        x, w, ids = routing(1, 2)
        out = apply(x, w, ids)
        want = reference(x, w, ids)
        return {"shape": list(out.shape), "ref_diff": float((out.float() - want.float()).abs().max()),
                "ref_abs": float(want.float().abs().max())}

    def degenerate(T, seed, edit, emap=None):
        """``edit(ids, w)`` makes some tokens degenerate and returns their rows; the other tokens are compared
        with the same batch without the degenerate rows (a batch of the remaining tokens)."""
        def fn():
            x, w, ids = routing(T, seed)
            bad = edit(ids, w)
            out = apply(x, w, ids, emap)
            want = reference(x, w, ids, emap)
            keep = torch.tensor([t for t in range(T) if t not in bad], dtype=torch.long)
            alone = apply(x[keep].contiguous(), w[keep].contiguous(), ids[keep].contiguous(), emap)
            return {"ref_diff": float((out.float() - want.float()).abs().max()),
                    "ref_diff_degenerate_rows": float((out[bad].float() - want[bad].float()).abs().max()),
                    "ref_abs": float(want.float().abs().max()),
                    "degenerate_rows_abs": float(out[bad].float().abs().max()),
                    "others_diff": float((out[keep].float() - alone.float()).abs().max())}
        return fn

    def repeated(ids, w):  # token 2 picks expert 1 twice, token 5 expert 3 twice (the last token at T 6)
        ids[2] = 1
        ids[5] = 3
        return [2, 5]

    def repeated_crowded(ids, w):  # every token picks expert 1, token 2 twice: expert 1 gets T + 1 choices
        ids[:, 0] = 1
        ids[:, 1] = torch.where(ids[:, 1] == 1, 0, ids[:, 1])
        ids[2] = 1
        return [2]

    def dropped_all(ids, w):  # what vLLM's router writes for padding rows (VLLM_MOE_SKIP_PADDING): ids -1, w 0
        ids[1] = -1
        w[1] = 0.0
        ids[4] = -1  # a weight that is not 0: the id alone must drop it
        return [1, 4]

    def dropped_one(ids, w):  # one of two choices dropped: the other alone (checked against the reference)
        ids[3, 1] = -1
        return [3]

    def padded_tail(ids, w):  # a CUDA-graph-padded batch: the last rows are padding, ids -1, weights 0
        ids[-40:] = -1
        w[-40:] = 0.0
        return list(range(ids.shape[0] - 40, ids.shape[0]))

    def unmapped(ids, w):  # expert parallelism (no all2all): token 0's choices both live on another rank
        ids[0] = torch.tensor([1, 1], dtype=ids.dtype)
        return [0]

    emap = torch.tensor([2, -1, 0, 1], dtype=torch.int32)  # global expert 1 is not on this rank
    case("zero_tokens", zero_tokens)
    case("one_token", one_token)
    for T in (6, 100):  # the masked layout (up to 64 tokens) and the contiguous one
        case(f"repeated_T{T}", degenerate(T, 10 + T, repeated))
        case(f"repeated_crowded_T{T}", degenerate(T, 60 + T, repeated_crowded))
        case(f"dropped_all_T{T}", degenerate(T, 20 + T, dropped_all))
        case(f"dropped_one_T{T}", degenerate(T, 30 + T, dropped_one))
        case(f"unmapped_T{T}", degenerate(T, 40 + T, unmapped, emap))
    case(f"padded_T{LARGE}", degenerate(LARGE, 50, padded_tail))
    return rep


def main(out_path: str) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["MUSA_ATTN_MOE"] = "on"
    sys.path.insert(0, str(ROOT / "integration_tests"))
    import torch

    import musa_attn_backend.vllm as plugin
    from musa_attn_backend.testing import vllm_dsv4 as fx

    plugin.register()
    import dsv4_reference as ref_mod
    from tiny_dsv4 import CONFIG
    from vllm.config import set_current_vllm_config

    config = dict(CONFIG, index_topk=TOPK)
    weights = ref_mod.checkpoint(config, seed=3)
    # room for LARGE requests of up to 4 tokens (8 blocks each: two SWA, three 256-token and three state groups)
    vc = fx.engine_config(config, num_gpu_blocks_override=8 * LARGE + 512)
    report: dict = {}
    with set_current_vllm_config(vc):
        fx.init_distributed()
        t0 = time.time()
        rig = Rig(fx, torch, config, weights, vc)
        report["attention"] = attention_cases(rig)
        report["attention_seconds"] = round(time.time() - t0, 1)
        del rig
        t0 = time.time()
        report["moe"] = moe_cases(torch)
        report["moe_seconds"] = round(time.time() - t0, 1)
    Path(out_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
