"""The staged_ws program's synchronisation (``staged_ws_kernel``), modelled and run on the CPU as the paired
programs' are: the producer (a tile's rows into its K stage once that stage's last scores are done, then into the V
tiles once both groups' last ``P V`` is done), group 0 (scores, P and its factor published once group 1 is done
with the last ones, its ``P V``) and group 1 (its ``P V``), each making the program's barrier operations in the
program's order, for 0 to 9 tiles, in random interleavings. Every run must end, and:

- a K stage is refilled only after group 0 has read the tile before it, and read while it holds the tile expected;
- the V tiles are refilled only after both groups' ``P V`` of the tile before, and read for the tile expected;
- P (with its factor) is read by group 1 for the tile it was written for and never overwritten before that read;
- group 1 reads the rows' final scale only after group 0 has written it.

One arrival a group stands for the program's 128 (the program's arrival counts, checked in the CUDA it generates:
``tests/dsv4/test_dsv4_workspace.py``)."""

import random

import pytest

from musa_attn_backend.testing.protocol import STEP, MBarrier, first_failure, run_actors, wait

ARRIVALS = {"k_full": 1, "k_empty": 1, "v_full": 1, "v_empty": 2, "p_full": 1, "p_empty": 1, "done": 1}


class State:
    def __init__(self, tiles, broken="", overlap=False):
        self.tiles, self.broken, self.overlap = tiles, broken, overlap
        self.k_full = [MBarrier(1), MBarrier(1)]
        self.k_empty = [MBarrier(1), MBarrier(1)]
        self.v_full, self.v_empty = MBarrier(1), MBarrier(2)
        self.p_full, self.p_empty, self.done = MBarrier(1), MBarrier(1), MBarrier(1)
        self.k = [None, None]  # (tile, read by group 0)
        self.v = None  # (tile, groups done with it)
        self.p = None  # (tile, read by group 1)
        self.final = False


def producer(s):
    for it in range(s.tiles):
        st, par = it % 2, (it // 2) & 1
        if s.broken != "k_empty":
            yield from wait(s.k_empty[st], par ^ 1)
        assert s.k[st] is None or s.k[st][1], f"K stage {st} refilled with tile {it} while tile {s.k[st][0]} is read"
        s.k[st] = (it, False)
        yield STEP
        s.k_full[st].arrive()
        if s.broken != "v_empty":
            yield from wait(s.v_empty, (it & 1) ^ 1)
        assert s.v is None or s.v[1] == {0, 1}, f"V refilled with tile {it} while tile {s.v[0]} is read"
        s.v = (it, set())
        yield STEP
        s.v_full.arrive()


def read_v(s, it, w):
    assert s.v is not None and s.v[0] == it, f"V read for tile {it} while it holds {s.v}"


def scores(s, it):
    st, par = it % 2, (it // 2) & 1
    yield from wait(s.k_full[st], par)
    assert s.k[st][0] == it, f"K stage {st} read for tile {it} while it holds {s.k[st][0]}"


def group0(s):
    if s.overlap and s.tiles:
        yield from scores(s, 0)
    for it in range(s.tiles):
        st = it % 2
        if not s.overlap:
            yield from scores(s, it)
        yield STEP  # the scores (issued before, with OVERLAP), the flags' mask
        assert s.k[st][0] == it, f"K stage {st} read for tile {it} while it holds {s.k[st][0]}"
        s.k[st] = (it, True)
        s.k_empty[st].arrive()
        yield STEP  # the softmax
        if s.broken != "p_empty":
            yield from wait(s.p_empty, (it & 1) ^ 1)
        assert s.p is None or s.p[1], f"P of tile {s.p[0]} overwritten before group 1 read it"
        s.p = (it, False)
        s.p_full.arrive()
        yield from wait(s.p_full, it & 1)  # every thread of group 0 has stored its part
        yield from wait(s.v_full, it & 1)
        read_v(s, it, 0)
        yield STEP  # P V0
        if s.overlap and it + 1 < s.tiles:  # the next scores issued beside this P V0, before its release
            yield from scores(s, it + 1)
        read_v(s, it, 0)
        s.v[1].add(0)
        s.v_empty.arrive()
    s.final = True
    s.done.arrive()


def group1(s):
    for it in range(s.tiles):
        yield from wait(s.p_full, it & 1)
        assert s.p is not None and s.p[0] == it, f"group 1 read P {s.p} for tile {it}"
        yield STEP  # the rescale by P's factor
        yield from wait(s.v_full, it & 1)
        read_v(s, it, 1)
        yield STEP  # P V1
        read_v(s, it, 1)
        assert s.p[0] == it, f"P overwritten with tile {s.p[0]} during group 1's P V of tile {it}"
        s.v[1].add(1)
        s.v_empty.arrive()
        s.p = (it, True)
        s.p_empty.arrive()
    yield from wait(s.done, 0)
    assert s.final, "the rows' final scale read before group 0 wrote it"


def run(tiles, rng, broken="", overlap=False):
    s = State(tiles, broken, overlap)
    run_actors({"producer": producer(s), "group0": group0(s), "group1": group1(s)}, rng)


@pytest.mark.parametrize("overlap", [False, True], ids=["waited", "overlap"])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 4, 9])
def test_every_interleaving_ends_and_no_tile_is_overwritten_in_use(tiles, overlap):
    """Both orders of group 0's GEMMs (``OVERLAP``: the next tile's scores waited for and issued before this
    tile's ``P V0`` is released)."""
    rng = random.Random(tiles)
    for _ in range(300):
        run(tiles, rng, overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["waited", "overlap"])
@pytest.mark.parametrize("broken,what", [("v_empty", "V refilled"), ("p_empty", "overwritten before group 1")])
def test_the_model_catches_a_broken_protocol(broken, what, overlap):
    """Without the producer's wait for the V tiles, or group 0's for group 1's read of P, some interleaving
    overwrites a tile in use."""
    caught = first_failure(lambda tiles, rng, broken: run(tiles, rng, broken=broken, overlap=overlap), 4, broken,
                           seeds=2000)
    assert what in caught, caught


def test_the_k_stage_wait_is_implied_by_the_v_wait():
    """The producer refills K stage ``st`` with tile ``it + 2`` only after storing tile ``it + 1``'s V, which waits
    for both groups' ``P V`` of tile ``it``, after group 0 read tile ``it``'s K: the program's ``k_empty`` wait
    never blocks on its own (kept: it states the stage's hand-over where the stage is used)."""
    assert first_failure(lambda tiles, rng, broken: run(tiles, rng, broken=broken), 5, "k_empty", seeds=500) == ""
