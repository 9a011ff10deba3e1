"""TileLang program: the masked layout's routing in one launch (the rule: :func:`.layer.route_masked_reference`, the
torch ops it replaces between the router and the first GEMM)::

    e[t, j]      = the local expert of choice j of token t (E: none; :func:`.reference.local_expert_ids`)
    repeat[t, j] = e[t, j] < E and e[t, i] == e[t, j] for some i < j
    merged[t, j] = 0 if repeat else the sum of weights[t, i] over the i with e[t, i] == e[t, j]   (float32)
    slot[t, j]   = E * n if e[t, j] == E or repeat, else e * n + (the choices before t * k + j, in flat order,
                   that name expert e and are not repeats)
    counts[e]    = the choices that name e and are not repeats

One block of ``threads`` threads walks the ``n * k`` choices in chunks of ``threads``, a thread a choice: it finds
its local expert and whether it repeats an earlier choice of its token (k reads of its token's row), publishes the
expert in shared memory, and counts the earlier choices of the chunk naming the same expert; the running count of
each expert (shared memory) gives the slot. The thread holding an expert's last choice of the chunk advances that
expert's count. The slots are those of the torch rule (deterministic, in flat order), and nothing is read or
written out of bounds (ids outside the map or the local range name no expert).
"""

import functools

from ..._tilelang import tl_lang as T


@functools.lru_cache(maxsize=None)
def build_route_masked(E: int, k: int, ids_dtype: str = "int32", weights_dtype: str = "float32",
                       has_map: bool = False, threads: int = 256):
    """``E``: the local experts; ``k``: choices a token; ``has_map``: ids go through ``expert_map`` (global ->
    local, -1: not local) first. The token count and the map's length are dynamic."""
    n, NM = T.dynamic("tokens"), T.dynamic("map_size")

    def local(g, expert_map):
        """The local expert (int32; ``E``: none) of global id ``g`` (int64)."""
        if has_map:
            size = T.Cast("int64", NM)
            mapped = expert_map[T.Cast("int32", T.max(T.min(g, size - 1), T.int64(0)))]
            g = T.if_then_else(T.And(g >= 0, g < size), T.Cast("int64", mapped), T.int64(-1))
        return T.if_then_else(T.And(g >= 0, g < T.int64(E)), T.Cast("int32", g), E)

    @T.prim_func
    def route_masked(
        ids: T.Tensor((n, k), ids_dtype),
        weights: T.Tensor((n, k), weights_dtype),
        expert_map: T.Tensor((NM,), "int32"),
        slot: T.Tensor((n, k), "int32"),
        merged: T.Tensor((n, k), "float32"),
        counts: T.Tensor((E,), "int32"),
    ):
        with T.Kernel(1, threads=threads) as _:
            tx = T.get_thread_binding()
            base = T.alloc_shared([E], "int32", scope="shared")  # each expert's choices so far
            loc = T.alloc_shared([threads], "int32", scope="shared")  # this chunk's experts (E: none)
            e = T.alloc_var("int32")
            rank = T.alloc_var("int32")
            last = T.alloc_var("int32")
            rep = T.alloc_var("int32")
            w = T.alloc_var("float32")
            for i in T.serial(T.ceildiv(E, threads)):
                if i * threads + tx < E:
                    base[i * threads + tx] = 0
            T.sync_threads()
            for ch in T.serial(T.ceildiv(n * k, threads)):
                c = ch * threads + tx
                active = T.min(n * k - ch * threads, threads)
                e = E
                if c < n * k:
                    t = c // k
                    j = c % k
                    e = local(T.Cast("int64", ids[t, j]), expert_map)
                    rep = 0
                    w = T.float32(0)
                    for i in T.serial(k):
                        if local(T.Cast("int64", ids[t, i]), expert_map) == e:
                            w = w + T.Cast("float32", weights[t, i])
                            if i < j:
                                rep = 1
                    if T.And(rep == 1, e < E):  # a repeat: dropped, its weight in the first choice's
                        merged[t, j] = T.float32(0)
                        e = E
                    else:  # the weights of every choice naming e (none: every choice naming none), as torch's
                        merged[t, j] = w
                loc[tx] = e
                T.sync_threads()
                rank = 0
                last = 1
                if e < E:
                    for u in T.serial(active):
                        if loc[u] == e:
                            if u < tx:
                                rank = rank + 1
                            if u > tx:
                                last = 0
                if c < n * k:
                    slot[c // k, c % k] = T.if_then_else(e < E, e * n + base[T.min(e, E - 1)] + rank, E * n)
                T.sync_threads()
                if T.And(e < E, last == 1):
                    base[e] = base[e] + rank + 1
                T.sync_threads()
            for i in T.serial(T.ceildiv(E, threads)):
                if i * threads + tx < E:
                    counts[i * threads + tx] = base[i * threads + tx]

    return route_masked
