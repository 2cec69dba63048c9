"""The settings every property-based fuzz test runs under (`tests/test_fuzz.py`,
`tests/hostile/test_rest_fuzz.py`).

In CI each test runs a fixed, derandomized set of examples with no example database, so that a
run is reproducible and a failure is the same failure on every machine; a few seconds each. For
a long run set `HLOSERVE_FUZZ_EXAMPLES`, e.g. `HLOSERVE_FUZZ_EXAMPLES=100000 pytest tests/test_fuzz.py`,
which also draws fresh random examples instead of the fixed ones. No per-example deadline: on a
shared CI machine a descheduled example would fail the run (Hypothesis reruns it, and calls a
fast rerun "flaky"); the example counts bound the time instead.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["FUZZ", "LONG_RUN"]

LONG_RUN = int(os.environ.get("HLOSERVE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=LONG_RUN or 300,
    derandomize=not LONG_RUN,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
