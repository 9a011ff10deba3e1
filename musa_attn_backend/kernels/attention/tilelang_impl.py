"""TileLang paged attention: dispatch to the prefill/extend and split-KV decode kernels.

The kernels themselves are built in the attention-kernel issue (#3); until then a GPU call says so
instead of silently falling back to the slow reference path.
"""

from __future__ import annotations


def paged_attention_tilelang(q, k_cache, v_cache, meta, **kwargs):
    raise NotImplementedError(
        "paged_attention: the TileLang attention kernels are not in this build yet; "
        "pass impl='reference' to run the PyTorch reference on this device"
    )
