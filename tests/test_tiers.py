"""The README's test command is the fast tier: a bare `python -m pytest` leaves
out the tests marked slow, faults or vllm and says how many; a path or -m
names tests whatever their tier (tests/conftest.py, LATER_TIERS)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A slow module (every test of it marked) beside a fast one.
FILES = "tests/test_first_hour.py tests/test_clock.py"


def collect(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_bare_run_leaves_out_the_later_tiers_and_says_how_to_run_them() -> None:
    # testpaths narrowed to two files: no path given, as in the README's command.
    out = collect("-o", f"testpaths={FILES}")
    assert "test_clock.py::" in out and "test_first_hour.py::" not in out
    assert "tests of the slow, faults and vllm tiers left out: " \
           "python -m pytest -m 'slow or faults or vllm' runs them" in out


def test_a_path_or_a_mark_runs_the_tests_it_names_whatever_their_tier() -> None:
    assert "test_first_hour.py::" in collect("tests/test_first_hour.py")
    out = collect("-o", f"testpaths={FILES}", "-m", "slow")
    assert "test_first_hour.py::" in out and "test_clock.py::" not in out
    assert "left out" not in out
