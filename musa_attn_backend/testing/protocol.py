"""A model of a warp-specialised program's synchronisation, for tests that run its warp groups as actors on the
CPU (``tests/dsv4/test_dsv4_sched_protocol.py``, ``tests/dsv4/test_dsv4_paired_protocol.py``): each actor is a
generator making the program's barrier operations in the program's order, yielding ``WAIT`` while it is blocked and
``STEP`` when it does work; :func:`run_actors` interleaves them at random and fails on a deadlock.

Barrier semantics modelled: an mbarrier completes its phase at its arrival count, ``wait(parity)`` passes once the
phase of that parity has completed (a fresh barrier's "previous" phase counts as completed); a named barrier
completes when both of its groups have arrived, and a group arriving twice in one generation is a protocol error
(the hardware would count the second arrival toward the first generation)."""

from __future__ import annotations

WAIT, STEP = "wait", "step"


class MBarrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def ready(self, parity):
        return (self.phase & 1) != parity  # the phase of this parity has completed


class Named:
    """A named barrier between two groups (one arrival per group completes a generation)."""

    def __init__(self, name):
        self.name, self.arrived, self.generation = name, set(), 0

    def arrive(self, group):
        assert group not in self.arrived, f"{self.name}: group {group} arrived twice in one generation"
        self.arrived.add(group)
        if len(self.arrived) == 2:
            self.arrived, self.generation = set(), self.generation + 1


def sync(bar, group):
    """``bar.sync``: arrive, then wait for the generation to complete."""
    bar.arrive(group)
    gen = bar.generation
    while bar.generation == gen and group in bar.arrived:
        yield WAIT


def wait(mbar, parity):
    """``mbarrier.wait(parity)``."""
    while not mbar.ready(parity):
        yield WAIT


def run_actors(actors: dict, rng, patience: int = 2000) -> None:
    """Step the actors (name -> generator) in a random order until all end; a deadlock (every actor left waiting
    ``patience`` turns in a row) fails."""
    idle = 0
    while actors:
        name = rng.choice(sorted(actors))
        try:
            got = next(actors[name])
        except StopIteration:
            del actors[name]
            idle = 0
            continue
        idle = idle + 1 if got == WAIT else 0
        if idle > patience:
            raise AssertionError(f"deadlock: {sorted(actors)} all waiting")


def first_failure(run, pieces, broken: str, seeds: int = 500) -> str:
    """The message of the first assertion ``run(pieces, rng, broken=broken)`` fails over ``seeds`` random
    interleavings ('' if none does): how a protocol test shows that leaving out a wait is caught."""
    import random

    for seed in range(seeds):
        try:
            run(pieces, random.Random(seed), broken=broken)
        except AssertionError as e:
            return str(e)
    return ""

