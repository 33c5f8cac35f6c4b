"""Test-only: this process's wall clock runs ``TOKENFLEET_TEST_CLOCK_SKEW_S``
seconds off, as on a host whose clock is wrong.

A directory a test puts first on a child process's ``PYTHONPATH``: Python
imports ``sitecustomize`` at start, before any of the product's code, so every
``time.time()`` in that process (the product's, its libraries', logging's) is
off by the same amount; its monotonic clock is left alone, as a host's is.
"""

import os
import time

_skew_s = float(os.environ.get("TOKENFLEET_TEST_CLOCK_SKEW_S") or 0)
if _skew_s:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew_s
    time.time_ns = lambda: _time_ns() + int(_skew_s * 1e9)
