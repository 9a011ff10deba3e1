"""DeepSeek-V4's compressors on the GPU: the TileLang programs against the reference on the same inputs, over
several calls (chunks and decode steps), in both engines' state layouts (vLLM's packed paged state with ape
stored, NaN between its blocks; SGLang's rings holding the tail), ratio 4 and 128, both widths, the Hadamard and
both indexer scales. Tolerances: the rows the writer quantises ``rtol = atol = 1e-4`` where they are float32 (the
kernel's exp differs from torch's in the last bits), one bf16 step where they are rounded to bf16 (a value near a
rounding boundary may round the other way); the state bit for bit (a copy and one float32 add); the cache read back
within one e4m3 step of the reference's (a value at a rounding boundary may round the other way)."""

import pytest
import torch

from musa_attn_backend.kernels import dsv4
from musa_attn_backend.kernels.dsv4 import layout as L
from musa_attn_backend.testing.dsv4_compress import make_case, run_calls

pytestmark = pytest.mark.gpu


SCHEDULES = {4: [[13, 11, 1, 1, 1, 1, 1, 9], [5, 1, 1, 1, 30, 1, 1, 0], [0, 0, 8, 1, 1, 1, 1, 1]],
             128: [[200, 57, 1, 1, 70], [130, 1, 125, 1, 1], [1, 1, 1, 300, 0]]}


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("layout", ["paged", "ring"])
@pytest.mark.parametrize("d,rotate,scale", [(512, False, "pow2"), (128, True, "exact"), (128, False, "pow2")])
def test_compress_kernel_matches_the_reference(gpu_device, ratio, layout, d, rotate, scale):
    ref_case = make_case(ratio, d, layout, SCHEDULES[ratio], gpu_device, seed=ratio + d)
    got_case = make_case(ratio, d, layout, SCHEDULES[ratio], gpu_device, seed=ratio + d)
    ref_rows = [r for _, _, r in run_calls(ref_case, "reference", rotate, scale)]
    got_rows = [r for _, _, r in run_calls(got_case, "tilelang", rotate, scale)]
    ref_state, got_state, ref_cache, got_cache = ref_case.state, got_case.state, ref_case.cache, got_case.cache
    for r, g in zip(ref_rows, got_rows):
        assert torch.equal(torch.isnan(r), torch.isnan(g))
        fin = ~torch.isnan(r)
        rtol = 1e-4 if scale == "exact" else 2.0 ** -7  # one bf16 step is at most 2^-7 of the value
        assert torch.allclose(g[fin], r[fin], rtol=rtol, atol=1e-4), (g[fin] - r[fin]).abs().max()
    assert torch.equal(torch.isnan(got_state), torch.isnan(ref_state))
    assert torch.equal(got_state.nan_to_num(), ref_state.nan_to_num())
    n = got_cache.shape[0] * got_cache.shape[1]
    slots = torch.arange(n, device=gpu_device)
    read = dsv4.read_kv_v4 if d == L.D else dsv4.read_index_k
    a, b = read(got_cache, slots).float(), read(ref_cache, slots).float()
    tile = 64 if d == L.D else 128
    nope = L.D_NOPE if d == L.D else d
    amax = b[:, :nope].abs().view(n, -1, tile).amax(-1, keepdim=True)
    assert ((a - b)[:, :nope].abs().view(n, -1, tile) <= amax / 14 + 1e-6).all()
