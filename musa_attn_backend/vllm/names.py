"""The names vLLM knows our backend by (a leaf module: the package and its hooks both read them)."""

from .. import BACKEND_NAME

ENUM_NAME = BACKEND_NAME.upper()  # TILELANG_MUSA: the AttentionBackendEnum member
CLASS_PATH = "musa_attn_backend.vllm.backend.TileLangMusaBackend"
