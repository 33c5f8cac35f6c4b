"""``tokenfleet worker``'s parent: which child deaths it restarts and which it does not."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tokenfleet.workers.supervisor import CONFIG_EXIT_CODE, Child, Supervisor


def _child(node: str, code: str) -> Child:
    return Child(node, [sys.executable, "-c", code], env={})


@pytest.mark.timeout(60)
def test_a_child_that_exits_with_a_configuration_error_is_not_restarted() -> None:
    starts: list[str] = []
    said: list[str] = []

    def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        starts.append(cmd[-1])
        return subprocess.Popen(cmd, **kwargs)

    wrong = _child("wrong", f"raise SystemExit({CONFIG_EXIT_CODE})")
    healthy = _child("healthy", "import time; time.sleep(60)")
    supervisor = Supervisor([wrong, healthy], max_restarts=5, say=said.append, popen=popen)
    code = supervisor.run()
    assert code == 2  # a setup mistake, as the command line's own
    assert starts.count(wrong.cmd[-1]) == 1  # never restarted
    assert not any("restarting" in line for line in said), said
    assert "a restart would not help" in said[-1]
    assert healthy.done  # the other workers were stopped, not left as a half-fleet


@pytest.mark.timeout(60)
def test_a_child_that_crashes_is_restarted_then_given_up_on() -> None:
    said: list[str] = []
    crashing = _child("crashing", "raise SystemExit(1)")
    supervisor = Supervisor([crashing], max_restarts=2, max_backoff_s=0.1, say=said.append)
    assert supervisor.run() == 1
    assert any("restarting in" in line for line in said) and "giving up" in said[-1], said
