"""The clustered 128-head program's synchronisation (:mod:`musa_attn_backend.kernels.dsv4.sparse.cluster_kernel`),
modelled and run on the CPU before any GPU run: two blocks (ranks 0 and 1) of three warp groups each, plus each
block's copies in flight (an SM-to-SM copy lands some time after its producer issued it), over parts of real plans
in random interleavings. Every run must end, and:

- a block's consumers read stage ``st`` for tile ``k`` only when both halves in that block hold tile ``k`` (its own
  producer's, stored; the peer's, landed);
- a producer overwrites its half of a stage, in its own block or (by a copy) in the peer's, only when that
  block's two consumer groups are done with the tile the stage held.

The scores / second groups' P, output-scale and query handshakes are the scheduled program's, modelled in
``test_dsv4_sched_protocol.py``; here one consumer step stands for a tile's work. Barrier semantics:
:mod:`musa_attn_backend.testing.protocol` (``rfull``'s arrivals: the peer's three copies, each landing)."""

import random

import pytest

from musa_attn_backend.kernels.dsv4.sparse.cluster_kernel import REMOTE_COPIES
from musa_attn_backend.testing.protocol import STEP, WAIT, MBarrier, first_failure, run_actors

from test_dsv4_sched_protocol import part_pieces  # noqa: E402 (pytest puts this folder on the path)

NS = 2


class Block:
    def __init__(self):
        self.full = [MBarrier(1) for _ in range(NS)]  # one arrival stands for the local producer's 128 threads
        self.rfull = [MBarrier(REMOTE_COPIES) for _ in range(NS)]
        self.empty = [MBarrier(4) for _ in range(NS)]  # both groups of both blocks
        self.half = [[None, None] for _ in range(NS)]  # tile each half of each stage holds (index: rank)
        self.done = [[-1, -1] for _ in range(NS)]  # the last tile each of this block's groups finished in the stage

    def free(self, st, r):
        """Whether half ``r`` of stage ``st`` may change: both groups done with the tile it holds."""
        k = self.half[st][r]
        return k is None or min(self.done[st]) >= k


class State:
    def __init__(self, pieces, broken=""):
        self.pieces, self.broken = pieces, broken
        self.blocks = [Block(), Block()]
        self.in_flight = [[], []]  # copies into block b: (stage, tile, rank of the half)
        self.producing = [True, True]


def producer(s, r):
    me, peer = s.blocks[r], s.blocks[1 - r]
    kp = 0
    for t, jb, je in s.pieces:
        for _ in range(jb, je):
            st = kp % NS
            if s.broken != "empty":
                while not me.empty[st].ready(((kp // NS) & 1) ^ 1):
                    yield WAIT
            for b in (me, peer):  # this half is about to change in both blocks
                assert b.free(st, r), f"rank {r} overwrites its half of stage {st} in use"
            me.half[st][r] = kp
            yield STEP
            for _ in range(REMOTE_COPIES):
                s.in_flight[1 - r].append((st, kp, r))
            me.full[st].arrive()
            kp += 1
    s.producing[r] = False


def copies(s, b):
    """The SM-to-SM copies into block ``b``, landing in issue order at random times; each arrives on ``rfull``."""
    blk = s.blocks[b]
    while s.producing[1 - b] or s.in_flight[b]:
        if not s.in_flight[b]:
            yield WAIT
            continue
        st, k, r = s.in_flight[b].pop(0)
        assert blk.free(st, r) or blk.half[st][r] == k, f"a copy into block {b} overwrites stage {st} in use"
        blk.half[st][r] = k
        blk.rfull[st].arrive()
        yield STEP


def consumer(s, r, group):
    me, peer = s.blocks[r], s.blocks[1 - r]
    k = 0
    for t, jb, je in s.pieces:
        for _ in range(jb, je):
            st = k % NS
            while not me.full[st].ready((k // NS) & 1):
                yield WAIT
            if s.broken != "rfull":
                while not me.rfull[st].ready((k // NS) & 1):
                    yield WAIT
            assert me.half[st] == [k, k], f"block {r} reads stage {st} for tile {k}, holding {me.half[st]}"
            yield STEP
            me.done[st][group] = k
            me.empty[st].arrive()
            peer.empty[st].arrive()
            k += 1


def run(pieces, rng, broken=""):
    s = State(pieces, broken)
    actors = {f"copies{b}": copies(s, b) for b in (0, 1)}
    for r in (0, 1):
        actors[f"producer{r}"] = producer(s, r)
        actors[f"scores{r}"] = consumer(s, r, 0)
        actors[f"second{r}"] = consumer(s, r, 1)
    run_actors(actors, rng, patience=5000)


@pytest.mark.parametrize("T,K1,K2,parts", [(1, 128, 1024, 66), (3, 128, 1024, 5), (7, 64, 64, 1),
                                           (64, 128, 1024, 66)])
def test_every_interleaving_ends_and_no_half_is_overwritten_in_use(T, K1, K2, parts):
    rng = random.Random(T * 11 + parts)
    runs = 0
    for seed in range(2):
        for pieces in part_pieces(T, K1, K2, parts, seed)[:4]:
            for _ in range(25):
                run(pieces, rng)
                runs += 1
    assert runs > 0


@pytest.mark.parametrize("broken,what", [("rfull", "reads stage"), ("empty", "overwrites")])
def test_the_model_catches_a_broken_cluster_protocol(broken, what):
    """Without the wait for the peer's copies a block reads a stage before the peer's half landed; without the
    wait for both blocks' release a producer overwrites a half still in use."""
    pieces = [(0, 0, 7), (1, 0, 3)]
    caught = first_failure(run, pieces, broken)
    assert what in caught, caught
