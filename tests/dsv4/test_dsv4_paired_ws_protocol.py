"""The pipelined schedule of the paired_ws program (``paired_ws_kernel.pipelined_macros``: FlashMLA's SM90 sparse
prefill order), modelled and run on the CPU as :mod:`test_dsv4_paired_protocol` models the paired program: the
producer (each half waited for, filled, announced; the half its group frees first first) and the two math groups
making the program's barrier operations in the program's order, for 1 to 9 pairs, in random interleavings. Every
run must end, and:

- a stage half is refilled only after every group reading it has released the tile before, and read only while it
  holds the tile the group expects (group 0 issues the next pair's ``Q K^T`` before releasing stage 1's left half
  from this pair's ``P V``: the case a producer holding rows could deadlock on);
- the maxima (group 0's of the pair, ``m_s[0]``; both groups', ``m_s[1]``) are read for the pair they were written
  for and never overwritten unread;
- each group's P (``P_s[w]``) is read by the other for the pair it was written for and never overwritten while the
  other group's ``P V`` may still read it (no barrier guards it: the order does);
- the row sums are read once both are written."""

import random

import pytest

from musa_attn_backend.kernels.dsv4.sparse import paired_ws_kernel as pw
from musa_attn_backend.kernels.dsv4.sparse import paired_kernel as pk
from musa_attn_backend.testing.protocol import STEP, MBarrier, Named, first_failure, run_actors, sync, wait

LEFT = [pk.LEFT_ARRIVALS[st] // 128 for st in range(2)]
RIGHT = [pk.RIGHT_ARRIVALS[st] // 128 for st in range(2)]
READERS = {(0, "l"): {0}, (0, "r"): {0, 1}, (1, "r"): {1}, (1, "l"): {0, 1}}


class State:
    def __init__(self, pairs, broken=""):
        self.pairs, self.broken = pairs, broken
        self.full = {(st, h): MBarrier(1) for st in range(2) for h in "lr"}
        self.empty = {(st, "l"): MBarrier(LEFT[st]) for st in range(2)}
        self.empty.update({(st, "r"): MBarrier(RIGHT[st]) for st in range(2)})
        self.q_full = MBarrier(1)
        self.bunch = [Named("BUNCH0"), Named("BUNCH1")]
        self.s_ready = [Named("S0_READY"), Named("S1_READY")]
        self.epi = Named("EPILOGUE")
        self.half = {k: None for k in READERS}
        self.released = {k: set(READERS[k]) for k in READERS}
        self.m = [None, None]  # (pair, read) of m_s[0] and m_s[1]
        self.p = [None, None]  # (pair, read) of P_s[0] and P_s[1]
        self.l = [None, None]


def producer(s):
    for j in range(2 * s.pairs):
        st, par = j % 2, (j // 2) & 1
        if j == 0:
            s.q_full.arrive()
        for h in (("l", "r") if st == 0 else ("r", "l")):
            if s.broken != f"empty{st}{h}":
                yield from wait(s.empty[st, h], par ^ 1)
            assert s.released[st, h] == READERS[st, h], \
                f"stage {st}{h} refilled with tile {j} while tile {s.half[st, h]} is in use"
            s.half[st, h], s.released[st, h] = j, set()
            yield STEP
            s.full[st, h].arrive()


def release(s, st, h, w):
    s.released[st, h].add(w)
    s.empty[st, h].arrive()


def holds(s, st, h, tile):
    assert s.half[st, h] == tile, f"stage {st}{h} read for tile {tile} while it holds {s.half[st, h]}"


def write(slots, k, pair, what):
    prev = slots[k]
    assert prev is None or prev[1], f"{what} of pair {prev[0]} overwritten before it was read"
    slots[k] = (pair, False)


def read(slots, k, pair, what):
    assert slots[k] is not None and slots[k][0] == pair, f"{what}: pair {slots[k]} read in pair {pair}"
    slots[k] = (pair, True)


def scores0(s, par, tile):
    """Group 0's ``Q K^T`` of stage 0, both halves waited for; the scores' read of the right half ends."""
    for h in ("l", "r"):
        yield from wait(s.full[0, h], par)
        holds(s, 0, h, tile)
    yield STEP


def group0(s):
    yield from wait(s.q_full, 0)
    yield from scores0(s, 0, 0)
    release(s, 0, "r", 0)
    for i in range(s.pairs):
        tile = 2 * i
        write(s.m, 0, i, "group 0's maximum")
        s.bunch[0].arrive(0)
        yield STEP  # softmax on its own maximum
        holds(s, 0, "l", tile)  # its own P V
        yield STEP
        release(s, 0, "l", 0)
        yield from sync(s.bunch[1], 0)
        read(s.m, 1, i, "both groups' maximum")
        write(s.p, 0, i, "group 0's P")
        s.s_ready[0].arrive(0)
        yield from sync(s.s_ready[1], 0)
        read(s.p, 1, i, "group 1's P (group 0's P V)")
        s.p[1] = (i, False)  # still being read by the P V in flight
        holds(s, 1, "l", tile + 1)
        if i + 1 < s.pairs:  # the next pair's scores, issued while the P V runs
            yield from scores0(s, (i + 1) & 1, tile + 2)
            holds(s, 1, "l", tile + 1)
            s.p[1] = (i, True)  # the P V is done (wait_wgmma(1))
            release(s, 1, "l", 0)
            release(s, 0, "r", 0)  # the next scores are done
        else:
            yield STEP
            holds(s, 1, "l", tile + 1)
            s.p[1] = (i, True)
            release(s, 1, "l", 0)
    s.l[0] = True
    yield from sync(s.epi, 0)
    assert s.l[1], "row sums read before both were written"


def group1(s):
    yield from wait(s.q_full, 0)
    for i in range(s.pairs):
        par, tile = i & 1, 2 * i + 1
        for h in ("r", "l"):
            yield from wait(s.full[1, h], par)
            holds(s, 1, h, tile)
        yield STEP
        release(s, 1, "l", 1)  # group 0's P V still reads stage 1's left half
        yield from sync(s.bunch[0], 1)
        read(s.m, 0, i, "group 0's maximum")
        write(s.m, 1, i, "both groups' maximum")
        s.bunch[1].arrive(1)
        yield STEP  # softmax, its own P V issued
        holds(s, 1, "r", tile)
        write(s.p, 1, i, "group 1's P")
        yield from sync(s.s_ready[0], 1)
        read(s.p, 0, i, "group 0's P (group 1's P V)")
        s.p[0] = (i, False)  # still being read by the P V in flight
        holds(s, 0, "r", tile - 1)
        s.s_ready[1].arrive(1)
        yield STEP
        release(s, 1, "r", 1)
        yield STEP
        holds(s, 0, "r", tile - 1)
        s.p[0] = (i, True)
        release(s, 0, "r", 1)
    s.l[1] = True
    yield from sync(s.epi, 1)
    assert s.l[0], "row sums read before both were written"


def run(pairs, rng, broken=""):
    s = State(pairs, broken)
    run_actors({"producer": producer(s), "group0": group0(s), "group1": group1(s)}, rng)


@pytest.mark.parametrize("pairs", [1, 2, 3, 9])
def test_every_interleaving_ends_and_no_buffer_is_overwritten_in_use(pairs):
    rng = random.Random(pairs)
    for _ in range(300):
        run(pairs, rng)


def test_the_model_is_the_programs_barrier_layout():
    """The program's barriers as modelled: the halves' release counts (the paired program's), distinct named
    barriers beside the epilogue's."""
    for (st, h), readers in READERS.items():
        counts = pk.LEFT_ARRIVALS if h == "l" else pk.RIGHT_ARRIVALS
        assert counts[st] == 128 * len(readers), (st, h)
    ids = [pw.EPILOGUE, pw.BUNCH0, pw.BUNCH1, pw.S0_READY, pw.S1_READY]
    assert len(set(ids)) == len(ids) and min(ids) > 0 and max(ids) < 16


@pytest.mark.parametrize("broken,what", [("empty0r", "stage 0r refilled"), ("empty1l", "stage 1l refilled")])
def test_the_model_catches_a_broken_protocol(broken, what):
    """Without the producer's wait for a half both groups read, some interleaving refills it in use."""
    caught = first_failure(lambda pairs, rng, broken: run(pairs, rng, broken=broken), 3, broken, seeds=2000)
    assert what in caught, caught
