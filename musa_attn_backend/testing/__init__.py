"""Test support shared by the tests, benchmarks, the tuner and the demo.

* :mod:`.batches`: random paged batches laid out the way each engine lays them out, and dense attention on
  unpaged tensors to compare with.
* :mod:`.numeric`: the one tolerance table (how close a kernel or the reference must be).
* :mod:`.toolchain`: the nvcc and Hopper target the build tests compile with.
"""

from .batches import PagedBatch, dense_attention, random_batch
from .numeric import assert_close, max_error, tolerance

__all__ = ["PagedBatch", "random_batch", "dense_attention", "assert_close", "max_error", "tolerance"]
