"""Write the generated CUDA of a fixed list of the MoE and DeepSeek-V4 programs (the attention kernels:
``dump_kernels.py``), one file a program, for checking that a refactor of their program files leaves the code
as it was.

    python scripts/dump_programs.py OUT_DIR [--only SUBSTRING ...] [--runs N] [--tir] [--skip-existing]
    python scripts/dump_programs.py --compare OLD_DIR NEW_DIR

Each program is built by its launcher (so with the launcher's tiling and pass configs) while ``compile_cached``
is intercepted, under ``MUSA_ATTN_TARGET=sm_90a``, and lowered as ``dump_kernels.py`` lowers (for
``{"kind": "cuda", "arch": "sm_90a"}``); its device source (TileLang's codegen, before nvcc) is written to
``OUT_DIR/<name>.cu``. nvcc is not run. ``--tir`` writes each program's TIR instead (``<name>.tir.py``: seconds,
not minutes). Run it at two commits (both scripts may be copied into the older tree) and compare. TileLang reads
a program's source file again when it builds the program, so leave the tree unchanged while a dump runs (or
dump a copy of it).

``--compare`` reports each program as identical or different (the comparison of ``dump_kernels.py``, which
folds the names of TileLang's reduction workspaces and, with ``--runs``, allows for TileLang's run-to-run
variation of some barriers) and exits 1 if any differs or is missing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("MUSA_ATTN_TARGET", "sm_90a")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dump_kernels import cli  # noqa: E402

from musa_attn_backend import _tilelang, config  # noqa: E402
from musa_attn_backend.kernels.dsv4.model import tilelang_impl as model  # noqa: E402
from musa_attn_backend.kernels.dsv4.sparse import tilelang_impl as sparse  # noqa: E402
from musa_attn_backend.kernels.moe import tilelang_impl as moe  # noqa: E402

TARGET = "sm_90a"
BF16 = "bfloat16"
H, I = 4096, 2048  # the MoE shapes: hidden size, intermediate size; GEMM1 is (2I x H), GEMM2 (H x I)

# name -> the launcher call that builds the program (one or two configs a program)
PROGRAMS = {
    # the block-scaled grouped GEMMs: FP8 and FP4 weights, contiguous and masked layouts
    "moe_fp8_contiguous": lambda: moe.contiguous_kernel(2 * I, H),
    "moe_fp8_contiguous_s3": lambda: moe.contiguous_kernel(H, I, num_stages=moe.LARGE_M_STAGES[1]),
    "moe_fp8_masked": lambda: moe.masked_kernel(2 * I, H),
    "moe_fp4_contiguous_bytes": lambda: moe.contiguous_fp4_kernel(2 * I, H, packing="bytes"),
    "moe_fp4_contiguous_words_f32": lambda: moe.contiguous_fp4_kernel(H, I, packing="words", scale_dtype="float32"),
    "moe_fp4_masked_bytes": lambda: moe.masked_fp4_kernel(2 * I, H, packing="bytes"),
    "moe_fp4_masked_words_f32": lambda: moe.masked_fp4_kernel(H, I, packing="words", scale_dtype="float32"),
    "moe_fp4_contiguous_fp8": lambda: moe.contiguous_fp4_kernel(2 * I, H, packing="fp8"),
    "moe_fp4_contiguous_fp8_f32": lambda: moe.contiguous_fp4_kernel(H, I, packing="fp8", scale_dtype="float32"),
    "moe_fp4_masked_fp8": lambda: moe.masked_fp4_kernel(2 * I, H, packing="fp8"),
    "moe_fp4_masked_fp8_f32": lambda: moe.masked_fp4_kernel(H, I, packing="fp8", scale_dtype="float32"),
    # GEMM1 with the SwiGLU + FP8 quantisation epilogue
    "moe_fp8_contiguous_swiglu": lambda: moe.contiguous_swiglu_kernel(I, H, 10.0),
    "moe_fp8_masked_swiglu": lambda: moe.masked_swiglu_kernel(I, H, 10.0),
    "moe_fp8_masked_swiglu_nolimit": lambda: moe.masked_swiglu_kernel(I, H, None),
    # the glue
    "moe_swiglu_quant": lambda: moe.swiglu_quant_kernel(I, 10.0),
    "moe_swiglu_quant_nolimit": lambda: moe.swiglu_quant_kernel(3 * 128, None),
    "moe_quantize_scatter": lambda: moe.quantize_scatter_kernel(H, 6),
    "moe_quantize_scatter_g3": lambda: moe.quantize_scatter_kernel(3 * 128, 8),
    "moe_combine": lambda: moe.combine_kernel(H, 6),
    "moe_combine_b128": lambda: moe.combine_kernel(3 * 128, 8),
    # DeepSeek-V4's sparse attention: the portable, the scheduled and the paired programs (over the FP8 rows and
    # over a bf16 workspace, and its gather)
    "dsv4_portable_h64_extra_sink_split": lambda: sparse.sparse_mqa_kernel(64, True, True, True, BF16,
                                                                           program="portable"),
    "dsv4_portable_h128": lambda: sparse.sparse_mqa_kernel(128, False, False, False, BF16, program="portable"),
    "dsv4_sched_h64_extra_sink": lambda: sparse.sched_kernel(64, True, True, BF16),
    "dsv4_sched_h128": lambda: sparse.sched_kernel(128, False, False, BF16),
    "dsv4_paired_h64_extra_sink": lambda: sparse.paired_kernel(64, True, True, BF16),
    "dsv4_paired_h128": lambda: sparse.paired_kernel(128, False, False, BF16),
    "dsv4_paired_ws_h64_sink": lambda: sparse.paired_ws_kernel(64, True, BF16),
    "dsv4_workspace_rows": lambda: sparse.workspace_rows_kernel(),
    # DeepSeek-V4's model-side kernels
    "dsv4_mhc_pre": lambda: model.mhc_pre_kernel(4, 4096, 20, False, False, BF16),
    "dsv4_mhc_pre_head_norm": lambda: model.mhc_pre_kernel(4, 4096, 20, True, True, BF16),
}


def build(name: str):
    """``(prim_func, pass_configs)`` of program ``name`` as its launcher builds it for sm_90a."""
    got = []
    with config.override(target=TARGET), _tilelang.intercepting(
            lambda key, build, tgt, pass_configs: got.append((build(), pass_configs))):
        PROGRAMS[name]()
    assert len(got) == 1, (name, len(got))
    return got[0]


def main(argv=None) -> int:
    return cli(argv, __doc__, PROGRAMS, build)


if __name__ == "__main__":
    sys.exit(main())
