"""The paired sparse MQA program's synchronisation, modelled and run on the CPU: the three warp groups of
:mod:`musa_attn_backend.kernels.dsv4.sparse.paired_kernel` as three actors making the program's barrier
operations in the program's order (the producer and the two math groups), for tokens of 1 to 9 pairs, in
thousands of random interleavings. Every run must end (no deadlock), and no shared buffer may be overwritten while
a group can still read what it held:

- a stage half (stage ``w`` holds tile ``2i + w``; left and right halves apart): the producer refills it only after
  every group that reads it has released the tile before (stage 0 left: group 0; stage 0 right: both; stage 1
  right: group 1; stage 1 left: both), and a group reads a half only once it holds the tile it expects;
- a group's P (``P_s[w]``): written for pair ``i`` only after the other group has used pair ``i - 1``'s, and read
  by the other group only once it holds pair ``i``'s;
- the row maxima (``m_s``, double-buffered by pair parity): each group reads the other's maximum of the same
  pair, and a slot is overwritten only after the other group has read it;
- the row sums of the epilogue: read once both are written.

Barrier semantics: :mod:`musa_attn_backend.testing.protocol`."""

import random

import pytest

from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk
from musa_attn_backend.testing.protocol import STEP, MBarrier, Named, first_failure, run_actors, sync, wait

# arrivals per stage half, in groups (the program counts threads: 128 a group)
LEFT = [pk.LEFT_ARRIVALS[st] // 128 for st in range(2)]
RIGHT = [pk.RIGHT_ARRIVALS[st] // 128 for st in range(2)]
# who reads each stage half: (stage, half) -> groups
READERS = {(0, "l"): {0}, (0, "r"): {0, 1}, (1, "r"): {1}, (1, "l"): {0, 1}}


class State:
    def __init__(self, pairs, broken="", rows_at_once=2):
        self.pairs, self.broken, self.rows_at_once = pairs, broken, rows_at_once
        self.full = {(st, h): MBarrier(1) for st in range(2) for h in "lr"}
        self.empty = {(st, "l"): MBarrier(LEFT[st]) for st in range(2)}
        self.empty.update({(st, "r"): MBarrier(RIGHT[st]) for st in range(2)})
        self.q_full = MBarrier(1)
        self.max_ready, self.epi = Named("MAX_READY"), Named("EPILOGUE")
        self.p_ready = [Named("P_READY0"), Named("P_READY1")]
        self.p_free = [Named("P_FREE0"), Named("P_FREE1")]
        self.half = {k: None for k in READERS}  # the tile each stage half holds
        self.released = {k: set(READERS[k]) for k in READERS}
        self.p = [None, None]  # the pair whose P each group's buffer holds
        self.p_read = [True, True]
        self.m = {}  # (parity, group) -> (pair, read by the other group)
        self.l = [None, None]


def producer(s):
    """Both rows' bytes held (``PRODUCER_ROWS_AT_ONCE`` 2): each half waited for, filled and announced in turn, the
    half freed first first. One row at a time (1): both halves waited for, then filled row by row, then both
    announced."""
    order = {0: ("l", "r"), 1: ("r", "l")}  # the half freed first, first
    for j in range(2 * s.pairs):
        st, par = j % 2, (j // 2) & 1
        if j == 0:
            s.q_full.arrive()
        groups = [order[st]] if s.rows_at_once == 1 else [(h,) for h in order[st]]
        for halves in groups:
            for h in halves:
                if s.broken != f"empty{st}{h}":
                    yield from wait(s.empty[st, h], par ^ 1)
            for h in halves:
                assert s.released[st, h] == READERS[st, h], \
                    f"stage {st}{h} refilled with tile {j} while tile {s.half[st, h]} is in use"
                s.half[st, h], s.released[st, h] = j, set()
                yield STEP
            for h in halves:
                s.full[st, h].arrive()


def release(s, st, h, w):
    s.released[st, h].add(w)
    s.empty[st, h].arrive()


def consumer(s, w):
    other = 1 - w
    first, second = ("l", "r") if w == 0 else ("r", "l")
    yield from wait(s.q_full, 0)
    for i in range(s.pairs):
        par, tile = i & 1, 2 * i + w
        for h in (first, second):  # Q K^T over both halves of this group's stage
            yield from wait(s.full[w, h], par)
            assert s.half[w, h] == tile, (w, h, s.half[w, h], tile)
        yield STEP
        release(s, w, second, w)  # the half the other group's P V still reads
        prev = s.m.get((par, w))
        assert prev is None or prev[1], f"group {w}'s maximum of pair {prev[0]} overwritten before it was read"
        s.m[par, w] = (i, False)
        yield from sync(s.max_ready, w)
        pair, _ = s.m[par, other]
        assert pair == i, f"group {w} read the other group's maximum of pair {pair} in pair {i}"
        s.m[par, other] = (pair, True)
        yield STEP  # softmax
        if i > 0 and s.broken != "p_free":
            yield from sync(s.p_free[w], w)
        assert s.p_read[w], f"group {w}'s P of pair {s.p[w]} overwritten before the other group used it"
        s.p[w], s.p_read[w] = i, False
        s.p_ready[w].arrive(w)
        yield STEP  # P V of this group's tile, P from registers
        assert s.half[w, first] == tile
        release(s, w, first, w)
        yield from sync(s.p_ready[other], w)
        assert s.p[other] == i and s.half[other, first] == 2 * i + other, (s.p[other], i)
        yield STEP  # P V of the other group's tile, its P from shared memory
        s.p_read[other] = True
        release(s, other, first, w)
        s.p_free[other].arrive(w)
    yield from sync(s.p_free[w], w)
    s.l[w] = True
    yield from sync(s.epi, w)
    assert s.l[other], "row sums read before both were written"
    yield STEP  # the output


def run(pairs, rng, broken="", rows_at_once=2):
    s = State(pairs, broken, rows_at_once)
    run_actors({"producer": producer(s), "group0": consumer(s, 0), "group1": consumer(s, 1)}, rng)


@pytest.mark.parametrize("rows_at_once", [2, 1])
@pytest.mark.parametrize("pairs", [1, 2, 3, 9])
def test_every_interleaving_ends_and_no_buffer_is_overwritten_in_use(pairs, rows_at_once):
    rng = random.Random(pairs)
    for _ in range(300):
        run(pairs, rng, rows_at_once=rows_at_once)


def test_the_stage_halves_are_released_by_whoever_reads_them():
    """The arrival counts the program gives the ``empty`` barriers are the number of groups reading each half."""
    for (st, h), readers in READERS.items():
        counts = pk.LEFT_ARRIVALS if h == "l" else pk.RIGHT_ARRIVALS
        assert counts[st] == 128 * len(readers), (st, h)


@pytest.mark.parametrize("rows_at_once", [2, 1])
@pytest.mark.parametrize("broken,what", [("p_free", ("P of pair", "P_FREE")), ("empty0r", ("stage 0r refilled",)),
                                         ("empty1l", ("stage 1l refilled",))])
def test_the_model_catches_a_broken_protocol(broken, what, rows_at_once):
    """Without a group's wait for its P to be free (some interleaving overwrites the P, or the other group's
    arrivals pile up on the barrier), or the producer's wait for a stage half both groups read (refilled while in
    use), the model fails."""
    caught = first_failure(lambda pairs, rng, broken: run(pairs, rng, broken=broken, rows_at_once=rows_at_once), 3,
                           broken, seeds=2000)
    assert any(w in caught for w in what), caught
