"""vLLM 0.33.0 DeepSeek-V4 fixtures for tests, run in a fresh interpreter with ``VLLM_TARGET_DEVICE=cpu`` (or on a
GPU): a tiny V4's engine config from a local ``config.json`` (no network), vLLM's own KV planning, allocation and
binding for a set of attention layers, and batches scheduled over them (block tables handed out as vLLM's pool
would: distinct block ids for every group, in random order).

Only vLLM's functions decide the cache geometry; this module only drives them.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass, field

import torch


def cpu_torch_linears() -> None:
    """On a CPU with AMX tiles, vLLM's linear layers take kernels from its compiled ``_C`` extension, which this
    package's test install of vLLM (``--no-deps``, pure Python) lacks (``convert_weight_packed``): answer "no AMX"
    there, so vLLM runs its torch path on any CPU, as on one without AMX."""
    try:
        torch.ops._C.convert_weight_packed  # noqa: B018 - present only with vLLM's compiled CPU ops
    except (AttributeError, RuntimeError):
        torch.cpu._is_amx_tile_supported = lambda: False


def engine_config(config: dict, **overrides):
    """The ``VllmConfig`` of a tiny V4 from ``config`` (written to a temporary model folder): FP8 KV, 256-token
    blocks, eager, dummy weights; ``overrides`` go to ``EngineArgs``. On a CPU, vLLM's linear layers run their
    torch path (:func:`cpu_torch_linears`)."""
    from vllm.engine.arg_utils import EngineArgs

    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        cpu_torch_linears()

    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    args = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype="fp8", block_size=256,
                max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks_override=1024,
                enforce_eager=True)
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def init_distributed() -> None:
    """A one-rank gloo group and model parallel state (tensor and pipeline size 1)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)


@dataclass
class Caches:
    """What vLLM's planning and allocation made: ``groups[g]`` = (spec, layer names, backend), the shared buffer
    and the layers bound to it."""

    groups: list
    buffer: torch.Tensor  # uint8 view of the whole allocation
    num_blocks: int
    layout: str


def allocate(vc, layers: dict, device="cpu") -> Caches:
    """Plan, allocate and bind the KV caches of ``layers`` (name -> attention layer) with vLLM's engine-core and
    worker steps, as the model runner does."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import (AttentionGroup, allocate_kv_cache, bind_kv_cache, customize_attention_spec,
                                      map_kv_caches_to_kernel_blocks, prepare_kernel_block_sizes)

    specs = {}
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vc)
        if spec is not None:
            specs[name] = (customize_attention_spec(layer.get_attn_backend(), spec)
                           if isinstance(spec, AttentionSpec) else spec)
    register_all_kvcache_specs(vc)
    backends = {layer.get_attn_backend() for layer in layers.values()}
    layout = resolve_kv_cache_layout(vc, [[m.name for m in get_supported_kv_cache_layouts(backends)]],
                                     list(specs.values()))
    plan = get_global_kv_cache_groups(vc, [specs])
    (kcfg,) = get_kv_cache_configs(vc, [specs], [1 << 40], plan)
    kcfg.kv_cache_layout = vc.cache_config.kv_cache_layout
    attn_groups, groups = [], []
    for gid, g in enumerate(kcfg.kv_cache_groups):
        by = {}
        for n in g.layer_names:
            b, sp = layers[n].get_attn_backend(), g.kv_cache_spec
            sp = sp.kv_cache_specs[n] if isinstance(sp, UniformTypeKVCacheSpecs) else sp
            by.setdefault((b.full_cls_name(), sp), (b, sp, []))[2].append(n)
        attn_groups.append([AttentionGroup(b, ns, sp, gid) for b, sp, ns in by.values()])
        groups += [(sp, ns, b) for b, sp, ns in by.values()]
    kernel_blocks = prepare_kernel_block_sizes(kcfg, attn_groups)
    caches = allocate_kv_cache(kcfg, torch.device(device), layout, kernel_blocks)
    bind_kv_cache(caches, vc.compilation_config.static_forward_context, [], 1, kv_cache_groups=kcfg.kv_cache_groups,
                  layer_kv_caches=map_kv_caches_to_kernel_blocks(caches, [a for ags in attn_groups for a in ags]))
    storage = next(iter(caches.values())).untyped_storage()
    buf = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    return Caches(groups, buf, kcfg.num_blocks, layout.name)


@dataclass
class Scheduler:
    """Requests fed through steps: each group's block table hands out block ids no other group or request holds
    (vLLM's single pool), at random."""

    caches: Caches
    max_blocks: int  # block-table width
    seed: int = 0
    tables: dict = field(default_factory=dict)  # (group index, request) -> list of block ids
    _free: list = field(default_factory=list)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self._free = torch.randperm(self.caches.num_blocks - 1, generator=g).add(1).tolist()  # block 0: vLLM's null

    def _table(self, gi: int, req: int, upto_tokens: int) -> list:
        bs = self.caches.groups[gi][0].block_size
        t = self.tables.setdefault((gi, req), [])
        while len(t) * bs < upto_tokens:
            t.append(self._free.pop())
        return t

    def step(self, reqs: list, starts: list, lens: list, device="cpu"):
        """Metadata of one step: request ``reqs[i]`` runs ``lens[i]`` query tokens from position ``starts[i]``.
        Returns ``(common metadata per group, positions [T])``."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        seq = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        out = []
        for gi, (spec, _, _) in enumerate(self.caches.groups):
            bs = spec.block_size
            table = torch.full((len(reqs), self.max_blocks), -1, dtype=torch.int32)
            slots = []
            for i, r in enumerate(reqs):
                t = self._table(gi, r, int(seq[i]))
                table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
                p = torch.arange(starts[i], starts[i] + lens[i])
                slots.append(table[i].long()[p // bs] * bs + p % bs)
            out.append(CommonAttentionMetadata(
                query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
                num_reqs=len(reqs), num_actual_tokens=int(qsl[-1]), max_query_len=max(lens),
                max_seq_len=int(seq.max()), block_table_tensor=table.to(device),
                slot_mapping=torch.cat(slots).to(device), positions=pos.to(device)))
        return out, pos.to(device)


def skip_v4_package_init() -> None:
    """Make ``vllm.models.deepseek_v4``'s submodules importable without running its package ``__init__``: on the
    lent H200 vLLM is installed without its compiled extensions, and that ``__init__`` imports the whole model
    (its quantisation config pulls in the MoE stack, which calls compiled ops at import). An empty package object
    with the folder as its path stands in for it; the submodules (the attention layer, the compressor, the sparse
    MLA backend, the ops) import as they are."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("vllm.vllm_flash_attn") is not None and "vllm.vllm_flash_attn" not in sys.modules:
        try:
            importlib.import_module("vllm.vllm_flash_attn")
        except ImportError:  # its compiled extensions are absent: names resolve to functions that raise
            class _Absent(types.ModuleType):
                def __getattr__(self, attr):
                    if attr.startswith("__"):
                        raise AttributeError(attr)

                    def absent(*a, **k):
                        raise RuntimeError(f"vllm.vllm_flash_attn.{attr} is not available here")
                    return absent

            sys.modules["vllm.vllm_flash_attn"] = _Absent("vllm.vllm_flash_attn")
    import vllm._custom_ops as ops

    for attr in dir(ops):  # capability queries of absent compiled ops answer "not supported"
        fn = getattr(ops, attr)
        if "support" in attr and callable(fn) and not getattr(fn, "_absent_ok", False):
            def query(*a, _fn=fn, **k):
                try:
                    return _fn(*a, **k)
                except (AttributeError, RuntimeError, NotImplementedError):
                    return False
            query._absent_ok = True
            setattr(ops, attr, query)
    name = "vllm.models.deepseek_v4"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec("vllm.models")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "deepseek_v4")
    pkg = types.ModuleType(name)
    pkg.__path__ = [folder]
    pkg.__package__ = name
    sys.modules[name] = pkg
    # The engine config inspects the architecture's class, which lives in that package: a text-generation class
    # that imports stands in for it (nothing here builds the model, only its attention layers).
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.registry import ModelRegistry

    ModelRegistry.register_model("DeepseekV4ForCausalLM", LlamaForCausalLM)
