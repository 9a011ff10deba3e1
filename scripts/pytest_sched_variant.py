"""A pytest plugin (``-p pytest_sched_variant`` with ``scripts/`` on the path) that builds the scheduled V4 program as
``MUSA_ATTN_SCHED_VARIANT`` (see ``scripts/sched_variants.py``) in every test process, xdist workers included."""

import os


def pytest_configure(config):
    variant = os.environ.get("MUSA_ATTN_SCHED_VARIANT", "")
    if variant:
        from sched_variants import use

        use(variant)
