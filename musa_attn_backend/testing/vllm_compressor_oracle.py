"""vLLM's own Triton compressor kernels as an oracle for our ``compress``, run on the CPU by Triton's
interpreter. Run as a program, in a process of its own, since the interpreter must be on before Triton is first
imported (Triton's own library functions are wrapped at import)::

    TRITON_INTERPRET=1 python -m musa_attn_backend.testing.vllm_compressor_oracle OUT.pt

For each case (ratio 4 / 128, the attention and the indexer width) it feeds the case through our reference in
vLLM's layout (every token's ``[kv | score + ape]`` kept in the paged state), then has vLLM's kernel compute the
last call's rows from that state into a cache of its own (vLLM reads every window position from its state, the
call's own tokens included: its ``save_partial_states`` runs first). ``OUT.pt``: per case, our cache's bytes and
vLLM's (``[pages, page stride]``), rows a page, and the slots the last call wrote.
"""

from __future__ import annotations

import os
import sys

import torch

from ..kernels import dsv4
from ..kernels.dsv4 import layout as L
from .dsv4_compress import call_args, make_case

SCHEDULES = {4: [[13, 11, 1, 1, 1, 1, 1, 9], [5, 1, 1, 1, 30, 1, 1, 3]],
             128: [[200, 57, 1, 1, 200], [130, 1, 125, 1, 127]]}
CASES = [(4, L.D), (128, L.D), (4, L.INDEX_D), (128, L.INDEX_D)]


def raw_pages(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes, one page a row (its page stride)."""
    return torch.as_strided(cache, (cache.shape[0], cache.stride(0)), (cache.stride(0), 1))


def round_casts_to_nearest_even() -> None:
    """Make the interpreter's float conversions round as the GPU does. Triton 3.8's interpreter converts
    float32 to bf16 by truncation and to e4m3 without carrying a rounded-up mantissa into the exponent (127.9
    becomes 64); its conversion is replaced by torch's (round to nearest even, what ``cvt.rn`` does on the GPU)
    for the float types torch has, the interpreter's own kept for the rest."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    own = interpreter._convert_float
    types = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
             tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def convert(data, src, dst, rounding_mode):
        if src not in types or dst not in types:
            return own(data, src, dst, rounding_mode)
        bits = {8: np.uint8, 16: np.uint16, 32: np.uint32}
        raw = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=bits[src.primitive_bitwidth]).copy()
        unsigned = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32}
        x = torch.from_numpy(raw).view(unsigned[src.primitive_bitwidth]).view(types[src])
        out = x.to(types[dst]).view(unsigned[dst.primitive_bitwidth]).numpy()
        return out.reshape(np.shape(data))

    interpreter._convert_float = convert


def vllm_kernels():
    """vLLM's two compressor kernels, wrapped by the real Triton (without a GPU vLLM hands its modules a
    placeholder ``triton``; their module's ``tl`` and ``triton`` are pointed at the real ones)."""
    import triton
    import triton.language as tl
    from vllm.models.deepseek_v4.common.ops import fused_compress_quant_cache as fc

    fc.tl, fc.triton = tl, triton
    return (triton.jit(getattr(fc._fused_kv_compress_norm_rope_insert_sparse_attn, "fn",
                               fc._fused_kv_compress_norm_rope_insert_sparse_attn)),
            triton.jit(getattr(fc._fused_kv_compress_norm_rope_insert_indexer_attn, "fn",
                               fc._fused_kv_compress_norm_rope_insert_indexer_attn)))


def run_case(ratio: int, d: int, kernels) -> dict:
    case = make_case(ratio, d, "paged", SCHEDULES[ratio], seed=ratio + d)
    calls = list(call_args_iter(case))
    kw = calls[-1]
    pos, req, slots = kw["positions"], kw["token_req"], kw["out_slots"]
    theirs = torch.zeros_like(raw_pages(case.cache))
    cos_sin = torch.cat([case.cos, case.sin], dim=1).contiguous()
    coff = 2 if ratio == 4 else 1
    index = d == L.INDEX_D
    kernel = kernels[1] if index else kernels[0]
    extra = dict(MX_SCALE=False) if index else dict(SANITIZE_CACHE_NANS=False)
    kernel[(pos.numel(),)](
        case.state, case.state.stride(0), case.state.stride(1), req.to(torch.int32), pos.to(torch.int64),
        torch.zeros_like(pos), case.table, case.table.stride(0), case.addr["state_block"],
        case.norm_weight.float(), case.eps, cos_sin, cos_sin.stride(0), theirs, slots.to(torch.int64),
        case.cache.shape[1], HEAD_SIZE=d, TRITON_BLOCK_SIZE=d, STATE_WIDTH=coff * d, COMPRESS_RATIO=ratio,
        OVERLAP=ratio == 4, ROPE_HEAD_DIM=64, FP8_MAX=448.0, QUANT_BLOCK=128 if index else 64,
        TOKEN_STRIDE=128 if index else 576, SCALE_DIM=4 if index else 8, KV_BLOCK_STRIDE=theirs.stride(0), **extra)
    emit = ((pos + 1) % ratio == 0).nonzero().flatten()
    return dict(ours=raw_pages(case.cache).clone(), theirs=theirs, slots=slots[emit].clone(),
                rows=case.cache.shape[1])


def call_args_iter(case):
    """Every call of ``case`` through our reference, yielding each call's arguments after running it."""
    for kw in call_args(case):
        dsv4.compress(**kw, impl="reference")
        yield kw


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (before Triton is imported)")
    round_casts_to_nearest_even()
    kernels = vllm_kernels()
    torch.save({f"{r}-{d}": run_case(r, d, kernels) for r, d in CASES}, argv[0])


if __name__ == "__main__":
    main()
