"""The scheduled sparse MQA program's synchronisation, modelled and run on the CPU: the three warp groups of
:mod:`musa_attn_backend.kernels.dsv4.sparse.sched_kernel` as three actors making the program's barrier
operations in the program's order (the producer, the scores group, the second group), over parts of real plans, in
thousands of random interleavings. Every run must end (no deadlock), and no shared buffer may be overwritten while
another group can still read what it held:

- a stage's K/V tile: the producer refills stage ``k % NS`` only after both consumers released tile ``k - NS``;
- P and the rescale factors: the scores group writes tile ``k``'s only after the second group has used tile
  ``k - 1``'s;
- the output scale (double-buffered by piece parity): written for piece ``p`` only after the second group read
  piece ``p - 2``'s;
- the query rows: the producer loads piece ``p``'s only after the scores group's last ``Q K^T`` of piece ``p - 1``.

And the clustered form (two blocks of six actors): each producer fills both blocks' stage, each consumer releases
on both blocks' ``empty``; a stage is read only once both producers' rows are in it, and a tile's rows (the local
arrival or the peer's bytes) never count toward another phase of a ``full`` barrier.

Barrier semantics: :mod:`musa_attn_backend.testing.protocol`."""

import random

import pytest

from musa_attn_backend.kernels.dsv4.sparse import schedule
from musa_attn_backend.testing.protocol import STEP, WAIT, MBarrier, Named, first_failure, run_actors, sync

NS = 2  # stages, as the program


class State:
    """The program's barriers and shared buffers for each block: one block, or with ``cluster`` the two head blocks
    of a part (each producer fills both blocks' stage; each consumer releases a stage on both blocks' barrier)."""

    def __init__(self, pieces, broken="", cluster=False):
        self.pieces = pieces  # [(token, first tile, end tile)]
        self.broken = broken  # a wait left out on purpose (to show the model catches it)
        self.cluster = cluster
        blocks = range(2 if cluster else 1)
        # one arrival stands for the producer's 128 threads; in a cluster the peer's bytes complete the phase too
        self.full = [[MBarrier(2 if cluster else 1) for _ in range(NS)] for _ in blocks]
        # the two consumer groups (of both blocks in a cluster, unless the remote arrivals are left out)
        consumers = 4 if cluster and broken != "local_empty" else 2
        self.empty = [[MBarrier(consumers) for _ in range(NS)] for _ in blocks]
        self.q_full, self.q_free = [MBarrier(1) for _ in blocks], [MBarrier(1) for _ in blocks]
        self.p_ready, self.p_free = [Named("P_READY") for _ in blocks], [Named("P_FREE") for _ in blocks]
        self.epi = [Named("EPILOGUE") for _ in blocks]
        # what each shared buffer holds, and who still needs it
        self.stage = [[None] * NS for _ in blocks]  # tile k
        self.made = [[set() for _ in range(NS)] for _ in blocks]  # the producers whose rows of it are stored
        self.released = [[set() for _ in range(NS)] for _ in blocks]  # groups done with the stage's tile
        self.p_tile, self.p_read = [None for _ in blocks], [True for _ in blocks]  # P_s: tile, read by group 1
        self.oscale = [[None, None] for _ in blocks]  # piece index in each half
        self.oscale_read = [[True, True] for _ in blocks]
        self.q_piece, self.q_reading = [None for _ in blocks], [False for _ in blocks]

    def peers(self, b):
        return (b, 1 - b) if self.cluster else (b,)


def producer(s, b=0):
    kp = 0
    for pc, (t, jb, je) in enumerate(s.pieces):
        for j in range(jb, je):
            st = kp % NS
            if j == jb:
                if pc > 0 and s.broken != "q_free":
                    while not s.q_free[b].ready((pc - 1) & 1):
                        yield WAIT
                assert not s.q_reading[b], "the query rows reloaded while the scores group reads them"
                s.q_piece[b] = pc
                s.q_full[b].arrive()
            while not s.empty[b][st].ready(((kp // NS) & 1) ^ 1):
                yield WAIT
            for x in s.peers(b):  # this producer's rows go into these blocks' stage
                if s.stage[x][st] != kp:
                    if s.stage[x][st] is not None:
                        assert s.released[x][st] == {0, 1}, \
                            f"block {x}'s stage {st} refilled while tile {s.stage[x][st]} is in use"
                    s.stage[x][st], s.made[x][st], s.released[x][st] = kp, set(), set()
                s.made[x][st].add(b)
            yield STEP
            for x in s.peers(b):  # the local arrival, and the bytes completing on the peer's barrier
                assert s.full[x][st].phase == kp // NS, f"tile {kp}'s rows counted toward another phase"
                s.full[x][st].arrive()
            kp += 1


def _release(s, b, st, group):
    s.released[b][st].add(group)
    for x in s.peers(b) if s.broken != "local_empty" else (b,):
        s.empty[x][st].arrive()


def scores(s, b=0):
    k = 0
    for pc, (t, jb, je) in enumerate(s.pieces):
        while not s.q_full[b].ready(pc & 1):
            yield WAIT
        assert s.q_piece[b] == pc
        for j in range(jb, je):
            st = k % NS
            while not s.full[b][st].ready((k // NS) & 1):
                yield WAIT
            assert s.stage[b][st] == k and s.made[b][st] == set(s.peers(b)), (s.stage[b][st], k, s.made[b][st])
            s.q_reading[b] = True
            yield STEP  # Q K^T
            s.q_reading[b] = False
            if j == je - 1:
                s.q_free[b].arrive()
            if k > 0 and s.broken != "p_free":
                yield from sync(s.p_free[b], 0)
            assert s.p_read[b], f"P of tile {s.p_tile[b]} overwritten before group 1 used it"
            s.p_tile[b], s.p_read[b] = k, False
            s.p_ready[b].arrive(0)
            yield STEP  # P V
            _release(s, b, st, 0)
            k += 1
        half = pc % 2
        assert s.oscale_read[b][half], f"output scale of piece {s.oscale[b][half]} overwritten before group 1 read it"
        s.oscale[b][half], s.oscale_read[b][half] = pc, False
        yield from sync(s.epi[b], 0)
        yield STEP  # the output's left half
    if k > 0 and s.broken != "p_free":
        yield from sync(s.p_free[b], 0)


def second(s, b=0):
    k2 = 0
    for pc, (t, jb, je) in enumerate(s.pieces):
        for j in range(jb, je):
            st = k2 % NS
            yield from sync(s.p_ready[b], 1)
            assert s.p_tile[b] == k2 and s.stage[b][st] == k2, (s.p_tile[b], k2, s.stage[b][st])
            yield STEP  # P V
            s.p_read[b] = True
            _release(s, b, st, 1)
            s.p_free[b].arrive(1)
            k2 += 1
        yield from sync(s.epi[b], 1)
        assert s.oscale[b][pc % 2] == pc
        s.oscale_read[b][pc % 2] = True
        yield STEP  # the output's right half


def run(pieces, rng, broken="", cluster=False):
    s = State(pieces, broken, cluster)
    actors = {}
    for b in range(2 if cluster else 1):
        actors.update({f"producer{b}": producer(s, b), f"scores{b}": scores(s, b), f"second{b}": second(s, b)})
    run_actors(actors, rng)


def part_pieces(T, K1, K2, parts, seed):
    g = __import__("torch").Generator().manual_seed(seed)
    torch = __import__("torch")
    l1 = torch.randint(0, K1 + 1, (T,), generator=g)
    l2 = torch.randint(0, K2 + 1, (T,), generator=g) if K2 else None
    plan = schedule.plan_sparse_mqa(T, K1, l1, K2, l2, parts=parts)
    return [p for p in schedule.visits(plan) if p]


@pytest.mark.parametrize("T,K1,K2,parts", [(1, 128, 2048, 132), (3, 128, 512, 5), (40, 640, 0, 3), (7, 64, 64, 1),
                                           (128, 128, 512, 132)])
@pytest.mark.parametrize("cluster", [False, True])
def test_every_interleaving_ends_and_no_buffer_is_overwritten_in_use(T, K1, K2, parts, cluster):
    """Also the clustered form's: the two blocks' producers each fill both blocks' stage, so no block's stage is
    refilled before both its groups released it, and a tile's rows never count toward another phase."""
    rng = random.Random(T * 7 + parts)
    runs = 0
    for seed in range(3):
        for pieces in part_pieces(T, K1, K2, parts, seed)[:6]:
            for _ in range(30):
                run(pieces, rng, cluster=cluster)
                runs += 1
    assert runs > 0


@pytest.mark.parametrize("broken,what", [("p_free", "P of tile"), ("q_free", "query rows")])
def test_the_model_catches_a_broken_protocol(broken, what):
    """Without the scores group's wait for P free, some interleaving overwrites P before group 1 used it; without
    the producer's wait for the query rows to be free, it reloads them while the scores group reads them (or the
    scores group meets another piece's rows)."""
    pieces = [(0, 0, 6), (1, 0, 3), (2, 0, 1)]
    caught = first_failure(run, pieces, broken)
    assert what in caught, caught


def test_the_model_catches_a_cluster_whose_consumers_release_only_their_own_block():
    """In the clustered form, with each consumer arriving on its own block's ``empty`` only, a producer refills the
    peer's stage while the peer's groups still read it."""
    pieces = [(0, 0, 6), (1, 0, 3), (2, 0, 1)]
    caught = first_failure(lambda p, rng, broken: run(p, rng, broken, cluster=True), pieces, "local_empty")
    assert "refilled while" in caught or "another phase" in caught, caught
