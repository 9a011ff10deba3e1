"""vLLM 0.33.0's own DeepSeek-V4 Triton kernels as oracles for what our vLLM V4 builders and layer compute, on a
GPU, run as ``python -m musa_attn_backend.testing.vllm_dsv4_oracles OUT.json`` in a fresh interpreter (it imports
vLLM's V4 submodules without the package ``__init__``: :func:`.vllm_dsv4.skip_v4_package_init`).

One random ragged batch (decode rows of one and two query tokens first, then chunked prefills, then padding rows
whose slot is ``-1``; block tables with shuffled blocks) goes through both sides:

- ``token_to_req``: vLLM's ``compute_token_to_req_indices`` (rows past the last request map to 0 there, to -1 here:
  compared on the mapped rows);
- the compressed slot mappings (ratios 4 and 128): ``get_compressed_slot_mapping`` (its ``block_size`` is the
  compressed rows a block, ``256 / ratio``, as vLLM's builder passes ``num_states``), every row;
- the window: the SWA builder's ``_COMPUTE_SWA_INDICES_AND_LENS_KERNEL`` (``decode_swa_indices`` and lengths), as
  a set per token (our order differs), ours from :func:`..metadata.vllm_dsv4.attention_indices`;
- C4: ``compute_global_topk_indices_and_lens`` of the same request-local top-k (random, ``-1`` holes), per token
  as a set and its count;
- C128: ``build_c128a_topk_metadata`` with every token as a decode token (global slots and lengths);
- the SWA writer: ``quantize_and_insert_k_cache`` and our :func:`..kernels.dsv4.write_kv_v4` into two packed caches
  (pages 2.5x a page apart, as vLLM packs a layer group) at the same slots, byte for byte (the rest of each
  block, never written, compared too).

The report counts mismatching rows (tokens, or cache blocks for the writer) per check.
"""

from __future__ import annotations

import json
import sys


def _batch(torch, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qlens = [1, 1, 2, 1, 2, 1] + [int(x) for x in torch.randint(3, 300, (5,), generator=g)]
    ctx = [int(x) for x in torch.randint(0, 3000, (len(qlens),), generator=g)]
    ctx[0], ctx[6] = 0, 0  # a first decode token, a first prefill chunk
    seq = [c + q for c, q in zip(ctx, qlens)]
    B, pad = len(qlens), 5
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    T = qsl[-1] + pad
    width = -(-max(seq) // 256) + 1
    main = torch.randperm(B * width + 40, generator=g)[:B * width].view(B, width).to(torch.int32)
    swa = torch.randperm(B * width * 4 + 40, generator=g)[:B * width * 4].view(B, width * 4).to(torch.int32)
    slot = torch.randint(0, 1 << 20, (T,), generator=g)
    slot[qsl[-1]:] = -1
    return dict(qsl=torch.tensor(qsl, dtype=torch.int32, device=dev),
                seq=torch.tensor(seq, dtype=torch.int32, device=dev), T=T, n=qsl[-1],
                main=main.to(dev), swa=swa.to(dev), slot=slot.to(dev), g=g, max_seq=max(seq))


def _set_mismatches(ours, theirs, lens, valid) -> int:
    bad = 0
    for t in range(ours.shape[0]):
        mine = sorted(x for x in ours[t].tolist() if x >= 0)
        want = sorted(x for x in theirs[t, :int(lens[t])].tolist() if x >= 0) if valid[t] else []
        bad += mine != want
    return bad


def main(out_path: str) -> None:
    import torch

    from . import vllm_dsv4 as fx

    fx.skip_v4_package_init()
    from vllm.models.deepseek_v4.common.ops.cache_utils import (compute_global_topk_indices_and_lens,
                                                                quantize_and_insert_k_cache)
    from vllm.models.deepseek_v4.sparse_mla import build_c128a_topk_metadata
    from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping
    from vllm.v1.attention.backends.mla.sparse_swa import _COMPUTE_SWA_INDICES_AND_LENS_KERNEL
    from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

    from ..kernels import dsv4
    from ..kernels.dsv4 import layout
    from ..metadata import vllm_dsv4 as m

    dev = torch.device("cuda")
    b = _batch(torch, dev)
    T, n = b["T"], b["n"]
    report: dict = {"tokens": T, "mapped": n}

    theirs_req = torch.zeros(T, dtype=torch.int32, device=dev)
    compute_token_to_req_indices(b["qsl"], theirs_req, n, T)
    req = m.token_to_req(b["qsl"], T)
    report["token_to_req"] = int((req[:n] != theirs_req[:n]).sum()) + int((req[n:] != -1).sum())
    pos = m.token_positions(b["qsl"], b["seq"], req)
    valid = (b["slot"] >= 0).cpu()

    for ratio in (4, 128):
        theirs = get_compressed_slot_mapping(T, b["slot"], b["qsl"], b["seq"], b["main"], 256 // ratio, ratio)
        ours = m.compressed_slot_mapping(pos, req, b["slot"], b["main"], 256, ratio)
        report[f"compressed_slot_mapping_{ratio}"] = int((ours.long() != theirs.long()).sum())
        report[f"compressed_slot_mapping_{ratio}_writes"] = int((theirs >= 0).sum())

    # the window (SWA builder kernel over every token)
    swa_idx = torch.full((T, 1, 128), 7, dtype=torch.int32, device=dev)
    swa_lens = torch.zeros(T, dtype=torch.int32, device=dev)
    replay = torch.zeros(len(b["seq"]) + 1, dtype=torch.int32, device=dev)
    _COMPUTE_SWA_INDICES_AND_LENS_KERNEL(swa_idx, swa_lens, 128, 128, swa_lens, swa_lens, b["qsl"], b["seq"],
                                         theirs_req, b["slot"] >= 0, b["swa"], 64, replay, num_tokens=T,
                                         token_offset=0)
    win, _ = m.attention_indices(pos, req, b["swa"], 64, 128)
    report["window"] = _set_mismatches(win.cpu(), swa_idx.view(T, 128).cpu(), swa_lens.cpu(), valid)

    # C4: the same request-local top-k through vLLM's global mapping and ours
    K = 512
    local = torch.stack([torch.randperm(K, generator=b["g"]) for _ in range(T)])
    seen = ((pos.cpu() + 1) // 4).clamp(min=0).view(T, 1)
    local = torch.where((local < seen) & (torch.rand(T, K, generator=b["g"]) > 0.05), local, -1)
    local = local.to(torch.int32).to(dev)
    g_idx, g_lens = compute_global_topk_indices_and_lens(local, theirs_req, b["main"], 64, b["slot"] >= 0)
    _, c4 = m.attention_indices(pos, req, b["swa"], 64, 128, 4, b["main"], 256, local, b["max_seq"])
    report["c4"] = _set_mismatches(c4.cpu(), g_idx.cpu(), torch.full((T,), K), valid)
    report["c4_lens"] = int((g_lens.cpu() != torch.where(valid, (c4.cpu() >= 0).sum(1), 0)).sum())

    # C128: every token as a decode token (global slots)
    W = max(128, 1 << (max(b["max_seq"] // 128, 1) - 1).bit_length())
    gdec = torch.full((T, W), 7, dtype=torch.int32, device=dev)
    dlens = torch.zeros(T, dtype=torch.int32, device=dev)
    pref = torch.zeros((1, W), dtype=torch.int32, device=dev)
    build_c128a_topk_metadata(pos, 128, T, theirs_req, b["main"], 2, b["slot"], gdec, dlens, pref,
                              max_compressed_tokens=W)
    _, c128 = m.attention_indices(pos, req, b["swa"], 64, 128, 128, b["main"], 256, None, b["max_seq"])
    report["c128"] = _set_mismatches(c128.cpu(), gdec.cpu(), dlens.cpu(), valid)
    report["c128_width"] = [int(c128.shape[1]), W]

    # the SWA writer, byte for byte, in packed blocks
    nb, page = 40, layout.page_bytes(64)
    stride = page * 5 // 2
    k = torch.randn(300, 512, generator=b["g"]) * torch.logspace(-3, 2, 300).view(-1, 1)
    k = k.to(torch.bfloat16).to(dev)
    slots = torch.randperm(nb * 64, generator=b["g"])[:300]
    slots[::17] = -1
    slots = slots.to(dev)
    bufs = [torch.randint(0, 256, (nb * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
            .to(dev) for _ in range(2)]
    quantize_and_insert_k_cache(k, bufs[0].as_strided((nb, page), (stride, 1)), slots, block_size=64)
    dsv4.write_kv_v4(k, bufs[1].as_strided((nb, 64, layout.ROW_BYTES), (stride, layout.ROW_BYTES, 1)), slots)
    torch.cuda.synchronize()
    diff = (bufs[0] != bufs[1]).view(nb, stride)
    report["writer_blocks"] = int(diff.any(1).sum())
    report["writer_bytes"] = int(diff.sum())
    report["writer_rows"] = int((slots >= 0).sum())
    Path = __import__("pathlib").Path
    Path(out_path).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
