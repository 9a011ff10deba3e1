"""musa_attn_backend: TileLang attention and MoE kernels for SGLang and vLLM on MUSA and CUDA GPUs.

Importing the package is cheap: TileLang and the engines are imported only when a kernel or an adapter
needs them.
"""

__version__ = "0.1.0"

BACKEND_NAME = "tilelang_musa"
