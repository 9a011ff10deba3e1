"""An independent DeepSeek-V4 forward in plain torch, and random weights for it under the official checkpoint names.

Written from the model's math (DeepSeek's ``inference/model.py``; ``../shared/reference/deepseek-v4-and-kernels.md``
section 2), not from SGLang's or this package's code: the engine tests serve the same weights through SGLang with
``--attention-backend tilelang_musa`` and check the served tokens against :meth:`Reference.logits`.

The forward is the prompt (prefill) form over a whole token sequence: position ``t`` sees the window of the last
128 raw KV rows up to ``t``, and compressed rows ``j < (t + 1) // ratio`` (all of them at ratio 128; the indexer's
top ``index_topk`` at ratio 4), which is what decoding one token at a time sees too. So one call gives the logits
of every position, and a served generation is checked by teacher forcing: its prompt plus its own output tokens.

Arithmetic is float32 throughout. The model's quantisation steps are simulated where its math has them:
- the 448 nope dims of every attention KV row (raw and compressed): FP8 e4m3 with one power-of-two scale per 64;
- the indexer's q and compressed keys after their Hadamard rotation: FP8 e4m3 with one power-of-two scale per 128
  values (``indexer_quant="fp8"``, the FP8 index cache the engines run), or the checkpoint's FP4 QAT form
  (``"fp4"``: E2M1, one scale per 32).
Weights are read from their stored bf16 values.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ----------------------------------------------------------------------------------------------------------- weights
def checkpoint(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for ``config`` under DeepSeek's checkpoint names (``embed.weight``, ``layers.{i}.attn.wq_a.
    weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ...): bf16 matrices and norms, float32 for the mHC
    parameters, the attention sinks, the compressors' ``ape`` and the router bias. Scales keep every pre-activation
    near unit size, so attention, routing and the compressors' softmax pooling all make real choices."""
    g = torch.Generator().manual_seed(seed)
    d, hc = config["hidden_size"], config["hc_mult"]
    H, hd, rd = config["num_attention_heads"], config["head_dim"], config["qk_rope_head_dim"]
    ql, G, ol = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    ih, ihd = config["index_n_heads"], config["index_head_dim"]
    E, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    mix = (2 + hc) * hc

    def mat(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(out, inp, generator=g) * gain / math.sqrt(inp)).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    def f32(*shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    w = {"embed.weight": torch.randn(config["vocab_size"], d, generator=g).to(torch.bfloat16)}
    for i, ratio in enumerate(config["compress_ratios"][:config["num_hidden_layers"]]):
        p = f"layers.{i}."
        for part in ("attn", "ffn"):
            w[p + f"hc_{part}_fn"] = f32(mix, hc * d, std=1.0 / math.sqrt(hc * d))
            w[p + f"hc_{part}_base"] = f32(mix, std=0.5)
            w[p + f"hc_{part}_scale"] = f32(3, std=0.2, mean=1.0)
        w[p + "attn_norm.weight"] = norm(d)
        w[p + "ffn_norm.weight"] = norm(d)
        a = p + "attn."
        w[a + "attn_sink"] = f32(H, std=1.0)
        w[a + "wq_a.weight"] = mat(ql, d)
        w[a + "q_norm.weight"] = norm(ql)
        w[a + "wq_b.weight"] = mat(H * hd, ql)
        w[a + "wkv.weight"] = mat(hd, d)
        w[a + "kv_norm.weight"] = norm(hd)
        w[a + "wo_a.weight"] = mat(G * ol, H * hd // G)
        w[a + "wo_b.weight"] = mat(d, G * ol)
        if ratio:
            coff = 2 if ratio == 4 else 1
            for c, dim in ((a + "compressor.", hd), *(((a + "indexer.compressor.", ihd),) if ratio == 4 else ())):
                w[c + "ape"] = f32(ratio, coff * dim, std=0.5)
                w[c + "wkv.weight"] = mat(coff * dim, d)
                w[c + "wgate.weight"] = mat(coff * dim, d)
                w[c + "norm.weight"] = norm(dim)
            if ratio == 4:
                w[a + "indexer.wq_b.weight"] = mat(ih * ihd, ql)
                w[a + "indexer.weights_proj.weight"] = mat(ih, d)
        f = p + "ffn."
        w[f + "gate.weight"] = mat(E, d)
        w[f + "gate.bias"] = f32(E, std=0.3)
        for e in [f"experts.{j}." for j in range(E)] + ["shared_experts."]:
            w[f + e + "w1.weight"] = mat(inter, d)
            w[f + e + "w3.weight"] = mat(inter, d)
            w[f + e + "w2.weight"] = mat(d, inter)
    w["norm.weight"] = norm(d)
    w["head.weight"] = mat(config["vocab_size"], d, gain=4.0)  # logits a few units apart: greedy is not a coin toss
    w["hc_head_fn"] = f32(hc, hc * d, std=1.0 / math.sqrt(hc * d))
    w["hc_head_base"] = f32(hc, std=0.5)
    w["hc_head_scale"] = f32(1, std=0.2, mean=1.0)
    return w


def save(weights: dict[str, torch.Tensor], out: Path) -> Path:
    from safetensors.torch import save_file

    path = Path(out) / "model.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})
    return path


def load(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(out) / "model.safetensors"))


# ------------------------------------------------------------------------------------------------------- the pieces
def quant_sim(x: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """Round ``x`` to FP8 e4m3 (``fmt="fp8"``) or FP4 E2M1 (``"fp4"``) with one power-of-two scale per ``block``
    values of the last dim, and return the dequantised float32 values."""
    top = FP8_MAX if fmt == "fp8" else FP4_MAX
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4 if fmt == "fp8" else 6 * 2.0 ** -126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / top)))
    y = (xb / scale).clamp(-top, top)
    if fmt == "fp8":
        y = y.to(torch.float8_e4m3fn).float()
    else:  # the nearest E2M1 magnitude (the smaller one on a tie), sign kept
        grid = FP4_GRID.to(x.device)
        y = grid[(y.abs().unsqueeze(-1) - grid).abs().argmin(-1)] * torch.sign(y)
    return (y * scale).flatten(-2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def rope_angles(dim: int, positions: torch.Tensor, base: float, yarn: dict | None) -> torch.Tensor:
    """Angles ``[len(positions), dim / 2]``: ``pos * f_i`` with ``f_i = base^(-2i/dim)``, YaRN-blended (``f / factor``
    below the slow band, ``f`` above the fast one, a linear ramp between) when ``yarn`` is given."""
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if yarn is not None:
        def corr(rot: float) -> float:
            return dim * math.log(yarn["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
        lo = max(math.floor(corr(yarn["beta_fast"])), 0)
        hi = min(math.ceil(corr(yarn["beta_slow"])), dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / yarn["factor"] * (1 - keep) + freqs * keep
    return (positions.double().unsqueeze(-1) * freqs).float()


def rotate(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate consecutive pairs ``(x[2i], x[2i+1])`` of the last dim by ``angles[..., i]`` (``-angles`` if
    ``inverse``); ``angles`` broadcasts against ``x``'s leading dims."""
    cos, sin = angles.cos(), angles.sin() * (-1.0 if inverse else 1.0)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ h * n ** -0.5


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """mHC's coefficients from ``mixes [s, (2 + hc) * hc]``: ``pre = sigmoid(.) + eps`` and ``post = 2 sigmoid(.)``
    (``[s, hc]``), and ``comb [s, hc, hc]``: a row softmax then alternate column and row normalisations (``iters``
    column steps in all) towards a doubly stochastic matrix."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[:, 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float):
    """V4's router (``scoring_func = sqrtsoftplus``, ``noaux_tc``) over ``logits [s, experts]``: the scores
    ``sqrt(softplus(logits))``; the ``k`` experts of the largest ``scores + bias`` (the bias steers the choice
    only); their weights the chosen scores scaled to sum to ``scaling``. Returns ``(chosen [s, k], weight [s, k],
    margin [s])``, ``margin`` the k-th biased score's lead over the next (how close the choice came to another,
    ``+inf`` when every expert is chosen)."""
    scores = F.softplus(logits).sqrt()
    ranked = (scores + bias).topk(min(k + 1, logits.shape[1]), dim=-1)
    chosen = ranked.indices[:, :k]
    margin = (ranked.values[:, k - 1] - ranked.values[:, k] if k < logits.shape[1]
              else torch.full((logits.shape[0],), float("inf")))
    weight = scores.gather(1, chosen)
    return chosen, weight / weight.sum(-1, keepdim=True) * scaling, margin


# -------------------------------------------------------------------------------------------------------- the model
class Reference:
    """The V4 forward for one token sequence. ``Reference(config, weights).logits(ids)`` is ``[len(ids), vocab]``
    float32: position ``t``'s next-token logits."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], *, indexer_quant: str = "fp8",
                 query_chunk: int = 256):
        self.c, self.query_chunk, self.indexer_quant = config, query_chunk, indexer_quant
        self.w = {k: v.float() for k, v in weights.items()}
        self.eps = config["rms_norm_eps"]

    # --- helpers
    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w[name].t()

    def _angles(self, ratio: int, positions: torch.Tensor) -> torch.Tensor:
        c = self.c
        if ratio:  # compressed layers: YaRN over compress_rope_theta; window-only layers: plain rope_theta
            return rope_angles(c["qk_rope_head_dim"], positions, c["compress_rope_theta"], c["rope_scaling"])
        return rope_angles(c["qk_rope_head_dim"], positions, c["rope_theta"], None)

    def _rope_tail(self, x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        rd = self.c["qk_rope_head_dim"]
        return torch.cat([x[..., :-rd], rotate(x[..., -rd:], angles, inverse)], -1)

    # --- compressor: one row per ``ratio`` tokens, softmax-gated pooling per channel
    def _compress(self, x: torch.Tensor, prefix: str, ratio: int, dim: int, angles_of) -> torch.Tensor:
        """Rows ``[s // ratio, dim]`` (normed and roped, before any quantisation). Row ``i`` pools tokens
        ``[i*ratio, (i+1)*ratio)``; at ratio 4 also the previous group's tokens, through the first half of the
        projections' channels (the current group uses the second half)."""
        s = x.shape[0]
        n = s // ratio
        if n == 0:
            return x.new_zeros(0, dim)
        kv = self._lin(x, prefix + "wkv.weight")[:n * ratio].unflatten(0, (n, ratio))
        score = self._lin(x, prefix + "wgate.weight")[:n * ratio].unflatten(0, (n, ratio)) + self.w[prefix + "ape"]
        if ratio == 4:
            prev_kv = torch.cat([kv.new_zeros(1, ratio, dim), kv[:-1, :, :dim]], 0)
            prev_score = torch.cat([score.new_full((1, ratio, dim), float("-inf")), score[:-1, :, :dim]], 0)
            kv = torch.cat([prev_kv, kv[:, :, dim:]], 1)
            score = torch.cat([prev_score, score[:, :, dim:]], 1)
        rows = (kv * score.softmax(1)).sum(1)
        rows = rms_norm(rows, self.w[prefix + "norm.weight"], self.eps)
        return self._rope_tail(rows, angles_of(torch.arange(n) * ratio))

    # --- indexer: the top ``index_topk`` compressed rows per query
    def _indexer(self, x: torch.Tensor, qr: torch.Tensor, angles: torch.Tensor, prefix: str) -> torch.Tensor:
        c = self.c
        s, ratio = x.shape[0], 4
        nh, hd = c["index_n_heads"], c["index_head_dim"]
        blk = 128 if self.indexer_quant == "fp8" else 32
        q = self._lin(qr, prefix + "wq_b.weight").unflatten(-1, (nh, hd))
        q = quant_sim(hadamard(self._rope_tail(q, angles.unsqueeze(1))), blk, self.indexer_quant)
        keys = self._compress(x, prefix + "compressor.", ratio, hd, lambda p: self._angles(ratio, p))
        keys = quant_sim(hadamard(keys), blk, self.indexer_quant)
        weights = self._lin(x, prefix + "weights_proj.weight") * (hd ** -0.5 * nh ** -0.5)
        score = (torch.einsum("shd,td->sht", q, keys).relu() * weights.unsqueeze(-1)).sum(1)
        visible = torch.arange(keys.shape[0]) < ((torch.arange(s) + 1) // ratio).unsqueeze(1)
        score = score.masked_fill(~visible, float("-inf"))
        k = min(c["index_topk"], keys.shape[0])
        if k == 0:
            return torch.full((s, 0), -1, dtype=torch.long)
        idx = score.topk(k, dim=-1).indices
        return torch.where(visible.gather(1, idx), idx, -1)

    # --- attention
    def _attention(self, x: torch.Tensor, i: int) -> torch.Tensor:
        c, w = self.c, self.w
        a = f"layers.{i}.attn."
        s = x.shape[0]
        ratio = c["compress_ratios"][i]
        H, hd, win = c["num_attention_heads"], c["head_dim"], c["window_size"]
        pos = torch.arange(s)
        ang = self._angles(ratio, pos)

        qr = rms_norm(self._lin(x, a + "wq_a.weight"), w[a + "q_norm.weight"], self.eps)
        q = rms_norm(self._lin(qr, a + "wq_b.weight").unflatten(-1, (H, hd)), None, self.eps)
        q = self._rope_tail(q, ang.unsqueeze(1))

        def fp8_nope(rows: torch.Tensor) -> torch.Tensor:
            rd = c["qk_rope_head_dim"]
            return torch.cat([quant_sim(rows[:, :-rd], 64, "fp8"), rows[:, -rd:]], -1)

        kv = fp8_nope(self._rope_tail(rms_norm(self._lin(x, a + "wkv.weight"), w[a + "kv_norm.weight"], self.eps),
                                      ang))
        # keys per query: the window (raw rows t-win+1 .. t), then compressed rows (offset by s in ``rows``)
        window = pos.unsqueeze(1) - win + 1 + torch.arange(win)
        idx = torch.where(window >= 0, window, -1)
        rows = kv
        if ratio:
            comp = fp8_nope(self._compress(x, a + "compressor.", ratio, hd, lambda p: self._angles(ratio, p)))
            rows = torch.cat([kv, comp], 0)
            if ratio == 4:
                chosen = self._indexer(x, qr, ang, a + "indexer.")
            else:
                j = torch.arange(comp.shape[0])
                chosen = torch.where(j < ((pos + 1) // ratio).unsqueeze(1), j, -1)
            idx = torch.cat([idx, torch.where(chosen >= 0, chosen + s, -1)], 1)

        out = torch.empty(s, H, hd)
        sink = w[a + "attn_sink"]
        for lo in range(0, s, self.query_chunk):
            hi = min(s, lo + self.query_chunk)
            ix = idx[lo:hi]
            keys = rows[ix.clamp_min(0)]  # [n, K, hd]
            logit = torch.einsum("nhd,nkd->nhk", q[lo:hi], keys) * hd ** -0.5
            logit = logit.masked_fill((ix < 0).unsqueeze(1), float("-inf"))
            m = logit.amax(-1, keepdim=True)
            p = torch.exp(logit - m)
            denom = p.sum(-1, keepdim=True) + torch.exp(sink.view(1, H, 1) - m)
            out[lo:hi] = torch.einsum("nhk,nkd->nhd", p / denom, keys)
        out = self._rope_tail(out, ang.unsqueeze(1), inverse=True)

        G, ol = c["o_groups"], c["o_lora_rank"]
        wo_a = w[a + "wo_a.weight"].view(G, ol, -1)
        o = torch.einsum("sgd,grd->sgr", out.reshape(s, G, -1), wo_a).flatten(1)
        return self._lin(o, a + "wo_b.weight")

    # --- MoE: sqrt-softplus router with a selection bias, top-k routed experts and one shared, clamped SwiGLU
    def _expert(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        lim = self.c["swiglu_limit"]
        gate = self._lin(x, prefix + "w1.weight").clamp(max=lim)
        up = self._lin(x, prefix + "w3.weight").clamp(-lim, lim)
        return F.silu(gate) * up

    def _moe(self, x: torch.Tensor, i: int) -> torch.Tensor:
        c = self.c
        f = f"layers.{i}.ffn."
        chosen, weight, margin = route(self._lin(x, f + "gate.weight"), self.w[f + "gate.bias"],
                                       c["num_experts_per_tok"], c["routed_scaling_factor"])
        self.route_margin = torch.minimum(self.route_margin, margin)
        y = self._lin(self._expert(x, f + "shared_experts."), f + "shared_experts.w2.weight")
        for e in range(c["n_routed_experts"]):
            tok, slot = torch.where(chosen == e)
            if tok.numel():
                h = self._expert(x[tok], f + f"experts.{e}.") * weight[tok, slot, None]
                y[tok] += self._lin(h, f + f"experts.{e}.w2.weight")
        return y

    # --- mHC around each sub-layer
    def _hc_pre(self, h: torch.Tensor, prefix: str):
        c = self.c
        flat = h.flatten(1)
        mixes = self._lin(flat, prefix + "_fn") * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre, post, comb = sinkhorn_split(mixes, self.w[prefix + "_scale"], self.w[prefix + "_base"], c["hc_mult"],
                                         c["hc_sinkhorn_iters"], c["hc_eps"])
        return (pre.unsqueeze(-1) * h).sum(1), post, comb

    @staticmethod
    def _hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # stream i: post_i * y + sum_j comb[j, i] * h_j
        return post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("sji,sjd->sid", comb, h)

    @torch.no_grad()
    def logits(self, ids) -> torch.Tensor:
        """``[len(ids), vocab]``; also sets ``self.route_margin [len(ids)]``: per position, the smallest gap over
        the layers between the last chosen expert's biased router score and the next one's. Where it is tiny, the
        expert choice is a near tie that rounding may decide either way."""
        c, w = self.c, self.w
        ids = torch.as_tensor(ids, dtype=torch.long)
        self.route_margin = torch.full((len(ids),), float("inf"))
        h = w["embed.weight"][ids].unsqueeze(1).repeat(1, c["hc_mult"], 1)
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            x, post, comb = self._hc_pre(h, p + "hc_attn")
            h = self._hc_post(self._attention(rms_norm(x, w[p + "attn_norm.weight"], self.eps), i), h, post, comb)
            x, post, comb = self._hc_pre(h, p + "hc_ffn")
            h = self._hc_post(self._moe(rms_norm(x, w[p + "ffn_norm.weight"], self.eps), i), h, post, comb)
        flat = h.flatten(1)
        mixes = self._lin(flat, "hc_head_fn") * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(mixes * w["hc_head_scale"] + w["hc_head_base"]) + c["hc_eps"]
        x = rms_norm((pre.unsqueeze(-1) * h).sum(1), w["norm.weight"], self.eps)
        return self._lin(x, "head.weight")


def served_logprobs(out: dict) -> list:
    """An SGLang ``/generate`` result's log-probabilities of its prompt tokens (where it was asked for them, with
    ``logprob_start_len`` 0; ``None`` for the first) and then of its output tokens, in sequence order."""
    meta = out["meta_info"]
    return [x[0] for x in meta.get("input_token_logprobs") or []] + [x[0] for x in meta["output_token_logprobs"]]


def agreement(ref: Reference, ids: list[int], served_logprobs: list[float | None], prompt_len: int, *,
              tol: float = 0.5, rel_tol: float = 0.05, tie: float = 0.02, gap: float = 0.5,
              median_bound: float = 0.06, max_excused: float = 0.05, min_exact: float = 0.85) -> dict:
    """Teacher-forced agreement of a served sequence (``ids``: the prompt, then the greedy output) with the
    reference. ``served_logprobs[i]`` is the engine's log-probability of ``ids[i]`` after ``ids[:i]`` (``None``
    where it gave none, as for the first token).

    Each position's error is ``|served - reference|`` on that log-probability. It must be at most ``tol + rel_tol
    * |reference|`` (a token the model finds unlikely has a large log-probability and a proportionally larger
    rounding error), except where the expert choice of the preceding position is a near tie (router margin below
    ``tie``): bf16 serving may pick the other expert there, which changes that position's output outright. At each
    greedy step, the served token must be the reference's argmax unless the reference puts it within ``gap`` of its
    top or the step is such a near tie. Over the whole sequence: the median error below ``median_bound``, at most
    ``max_excused`` of the positions excused, and the argmax served at ``min_exact`` of the steps or more. Returns
    the figures and ``failures`` (empty when it agrees)."""
    logits = ref.logits(ids)
    lp = logits.log_softmax(-1)
    margin = ref.route_margin
    n = len(ids)
    target = torch.as_tensor(ids[1:])
    ref_lp = lp[torch.arange(n - 1), target]  # entry i - 1: log p(ids[i] | ids[:i])
    served = torch.tensor([float("nan") if x is None else x for x in served_logprobs[1:n]])
    err = (served - ref_lp).abs()
    have = ~err.isnan()
    near_tie = margin[:n - 1] < tie
    over = have & (err > tol + rel_tol * ref_lp.abs())
    bad = over & ~near_tie
    failures = [f"position {i + 1}: served log p {float(served[i]):.3f}, reference {float(ref_lp[i]):.3f}"
                for i in torch.where(bad)[0].tolist()]
    steps = torch.arange(prompt_len - 1, n - 1)
    argmax = lp[steps].argmax(-1)
    exact = argmax == target[steps]
    behind = lp[steps].amax(-1) - ref_lp[steps]  # how far the served token is from the reference's best
    clear = (behind > gap) & ~near_tie[steps]
    failures += [f"step {int(s) - prompt_len + 1}: served token {int(target[s])}, reference {int(a)}"
                 for s, a in zip(steps[~exact & clear].tolist(), argmax[~exact & clear].tolist())]
    res = {"positions": int(have.sum()), "median_err": float(err[have].median()) if have.any() else 0.0,
           "near_ties": int((near_tie & have).sum()), "excused": int((over & near_tie).sum()),
           "steps": len(steps), "greedy_exact": int(exact.sum()),
           "max_behind": float(behind[~near_tie[steps]].max()) if len(steps) else 0.0}
    if res["median_err"] >= median_bound:
        failures.append(f"median |log p error| {res['median_err']:.3f} >= {median_bound}")
    if res["excused"] > max_excused * res["positions"]:
        failures.append(f"{res['excused']} of {res['positions']} positions excused as router near ties")
    if res["greedy_exact"] < min_exact * res["steps"]:
        failures.append(f"the reference's argmax served at {res['greedy_exact']} of {res['steps']} steps")
    return {**res, "failures": failures}
