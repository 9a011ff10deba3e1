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

Barrier semantics: :mod:`musa_attn_backend.testing.protocol`."""

import random

import pytest

from musa_attn_backend.kernels.dsv4.sparse import schedule
from musa_attn_backend.testing.protocol import STEP, WAIT, MBarrier, Named, first_failure, run_actors, sync

NS = 2  # stages, as the program


class State:
    def __init__(self, pieces, broken=""):
        self.pieces = pieces  # [(token, first tile, end tile)]
        self.broken = broken  # a wait left out on purpose (to show the model catches it)
        self.full = [MBarrier(1) for _ in range(NS)]  # one arrival stands for the producer's 128 threads
        self.empty = [MBarrier(2) for _ in range(NS)]  # the two consumer groups
        self.q_full, self.q_free = MBarrier(1), MBarrier(1)
        self.p_ready, self.p_free, self.epi = Named("P_READY"), Named("P_FREE"), Named("EPILOGUE")
        # what each shared buffer holds, and who still needs it
        self.stage = [None] * NS  # tile k
        self.released = [set() for _ in range(NS)]  # groups done with the stage's tile
        self.p_tile, self.p_read = None, True  # P_s: tile, read by group 1 yet
        self.oscale = [None, None]  # piece index in each half
        self.oscale_read = [True, True]
        self.q_piece, self.q_reading = None, False


def producer(s):
    kp = 0
    for pc, (t, jb, je) in enumerate(s.pieces):
        for j in range(jb, je):
            st = kp % NS
            if j == jb:
                if pc > 0 and s.broken != "q_free":
                    while not s.q_free.ready((pc - 1) & 1):
                        yield WAIT
                assert not s.q_reading, "the query rows reloaded while the scores group reads them"
                s.q_piece = pc
                s.q_full.arrive()
            while not s.empty[st].ready(((kp // NS) & 1) ^ 1):
                yield WAIT
            if s.stage[st] is not None:
                assert s.released[st] == {0, 1}, f"stage {st} refilled while tile {s.stage[st]} is in use"
            s.stage[st], s.released[st] = kp, set()
            yield STEP
            s.full[st].arrive()
            kp += 1


def scores(s):
    k = 0
    for pc, (t, jb, je) in enumerate(s.pieces):
        while not s.q_full.ready(pc & 1):
            yield WAIT
        assert s.q_piece == pc
        for j in range(jb, je):
            st = k % NS
            while not s.full[st].ready((k // NS) & 1):
                yield WAIT
            assert s.stage[st] == k
            s.q_reading = True
            yield STEP  # Q K^T
            s.q_reading = False
            if j == je - 1:
                s.q_free.arrive()
            if k > 0 and s.broken != "p_free":
                yield from sync(s.p_free, 0)
            assert s.p_read, f"P of tile {s.p_tile} overwritten before group 1 used it"
            s.p_tile, s.p_read = k, False
            s.p_ready.arrive(0)
            yield STEP  # P V
            s.released[st].add(0)
            s.empty[st].arrive()
            k += 1
        half = pc % 2
        assert s.oscale_read[half], f"output scale of piece {s.oscale[half]} overwritten before group 1 read it"
        s.oscale[half], s.oscale_read[half] = pc, False
        yield from sync(s.epi, 0)
        yield STEP  # the output's left half
    if k > 0 and s.broken != "p_free":
        yield from sync(s.p_free, 0)


def second(s):
    k2 = 0
    for pc, (t, jb, je) in enumerate(s.pieces):
        for j in range(jb, je):
            st = k2 % NS
            yield from sync(s.p_ready, 1)
            assert s.p_tile == k2 and s.stage[st] == k2, (s.p_tile, k2, s.stage[st])
            yield STEP  # P V
            s.p_read = True
            s.released[st].add(1)
            s.empty[st].arrive()
            s.p_free.arrive(1)
            k2 += 1
        yield from sync(s.epi, 1)
        assert s.oscale[pc % 2] == pc
        s.oscale_read[pc % 2] = True
        yield STEP  # the output's right half


def run(pieces, rng, broken=""):
    s = State(pieces, broken)
    run_actors({"producer": producer(s), "scores": scores(s), "second": second(s)}, rng)


def part_pieces(T, K1, K2, parts, seed):
    g = __import__("torch").Generator().manual_seed(seed)
    torch = __import__("torch")
    l1 = torch.randint(0, K1 + 1, (T,), generator=g)
    l2 = torch.randint(0, K2 + 1, (T,), generator=g) if K2 else None
    plan = schedule.plan_sparse_mqa(T, K1, l1, K2, l2, parts=parts)
    return [p for p in schedule.visits(plan) if p]


@pytest.mark.parametrize("T,K1,K2,parts", [(1, 128, 2048, 132), (3, 128, 512, 5), (40, 640, 0, 3), (7, 64, 64, 1),
                                           (128, 128, 512, 132)])
def test_every_interleaving_ends_and_no_buffer_is_overwritten_in_use(T, K1, K2, parts):
    rng = random.Random(T * 7 + parts)
    runs = 0
    for seed in range(3):
        for pieces in part_pieces(T, K1, K2, parts, seed)[:6]:
            for _ in range(30):
                run(pieces, rng)
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
