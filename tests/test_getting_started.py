"""Getting started, run as the page writes it.

The commands come from the code blocks of docs/getting-started.md's numbered
steps ("Your first fleet"), so the page and the fleet cannot drift apart: a
real redis-server, ``tokenfleet worker``, ``tokenfleet gateway``, ``tokenfleet
keys create``, ``curl``, OpenAI's client and the Python client, each checked
against the output the page shows. Only the ports change: the test's Redis and
gateway listen on free ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, stop_groups

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# Commands that serve until stopped: each runs in the background, as in a
# terminal of its own, and counts as started once the output shown is there.
SERVERS = ("redis-server", "tokenfleet worker", "tokenfleet gateway")
PAGE_REDIS_URL = "redis://127.0.0.1:6379/0"
PAGE_GATEWAY = "127.0.0.1:8000"
PAGE_HOST = "myhost"  # the host name in the page's worker names


def steps() -> list[tuple[str, str]]:
    """The code blocks of the numbered steps of "Your first fleet", in order, as
    (language, text). The blocks before step 1 install things: not run here."""
    section = PAGE.read_text().split("\n## Your first fleet\n", 1)[1].split("\n## ", 1)[0]
    numbered = section.split("\n### 1.", 1)[1]
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(numbered)]


def missing_lines(shown: str, actual: str) -> list[str]:
    """The lines of the output the page shows that the actual output lacks; in
    a shown line, '...' stands for any text (a time, a figure of this machine)."""
    lines = actual.splitlines()
    missing = []
    for want in shown.splitlines():
        parts = [p.strip() for p in want.split("...") if p.strip()]
        if parts and not any(_in_order(parts, line) for line in lines):
            missing.append(want)
    return missing


def _in_order(parts: list[str], line: str) -> bool:
    at = 0
    for part in parts:
        at = line.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


class Terminals:
    """The reader's terminals: one environment, servers left running."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.redis_port, self.gateway_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TOKENFLEET_", "OPENAI_")) or k.startswith("TOKENFLEET_TEST_")}
        bin_dir = str(Path(sys.executable).parent)  # `tokenfleet` and `python` of this venv
        self.env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                    "TOKENFLEET_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0"}
        self.servers: list[tuple[subprocess.Popen[bytes], Path]] = []

    def ports(self, text: str) -> str:
        """The page's text with this test's ports in place of the page's."""
        return (text.replace(PAGE_GATEWAY, f"127.0.0.1:{self.gateway_port}")
                .replace("--port 8000", f"--port {self.gateway_port}")
                .replace(PAGE_REDIS_URL, self.env["TOKENFLEET_REDIS_URL"])
                .replace(f"@{PAGE_HOST}", f"@{socket.gethostname()}"))

    def serve(self, command: str, shown: str) -> None:
        if command.split()[0] == "redis-server":
            command += f" --port {self.redis_port}"  # the page's Redis is on 6379
        log = self.cwd / f"server-{len(self.servers)}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(["bash", "-c", f"exec {self.ports(command)}"], env=self.env,
                                    cwd=self.cwd, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.servers.append((proc, log))
        expected = self.ports(shown)
        deadline = time.monotonic() + 240
        while missing_lines(expected, log.read_text(errors="replace")):
            assert proc.poll() is None, f"{command!r} ended:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, (
                f"{command!r} did not print {missing_lines(expected, log.read_text())} "
                f"within 240 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)

    def run(self, command: str) -> str:
        if command.startswith("export "):
            name = command.removeprefix("export ").split("=", 1)[0]
            done = self._bash(f'set -o pipefail; {command} && printf %s "${name}"')
            assert done.stdout, f"{command!r} set {name} to nothing: {done.stderr}"
            self.env[name] = done.stdout
            return ""
        return self._bash(command).stdout

    def python(self, code: str) -> str:
        done = subprocess.run([sys.executable, "-c", self.ports(code)], env=self.env,
                              cwd=self.cwd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def _bash(self, command: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["bash", "-c", self.ports(command)], env=self.env, cwd=self.cwd,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr}"
        return done

    def close(self) -> None:
        stop_groups([proc for proc, _ in reversed(self.servers)])  # Redis last


@pytest.fixture
def terminals(tmp_path: Path) -> Iterator[Terminals]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `apt-get install redis-server` "
                    "(.ci/run does this)")
    if shutil.which("curl") is None:
        pytest.skip("Getting started lists the models with curl: `apt-get install curl`")
    opened = Terminals(tmp_path)
    yield opened
    opened.close()


def test_the_steps_are_redis_a_worker_the_gateway_a_key_and_the_clients() -> None:
    """What the test below runs is what a reader needs: the page's steps name them."""
    code = "\n".join(text for language, text in steps() if language in ("bash", "python"))
    for needed in ("redis-server", "tokenfleet worker --model tiny", "tokenfleet gateway",
                   "tokenfleet keys create", 'model="tiny"', "from openai import OpenAI",
                   "FleetClient"):
        assert needed in code, needed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_getting_started_runs_as_written(terminals: Terminals) -> None:
    blocks = steps()
    ran = 0
    for i, (language, text) in enumerate(blocks):
        shown = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] in (
            "text", "json") else ""
        if language == "bash":
            out = ""
            for command in (line.strip() for line in text.splitlines()):
                if not command or command.startswith("#"):
                    continue
                if command.startswith(SERVERS):
                    terminals.serve(command, shown)
                else:
                    out += terminals.run(command)
            if shown and not any(line.strip().startswith(SERVERS) for line in text.splitlines()):
                _check(language, out, terminals.ports(shown))
        elif language == "python":
            out = terminals.python(text)
            # The text is the model's: greedy decoding may pick another token on
            # another CPU (a sum in another order), so only that there is one.
            assert out.strip(), f"the program printed nothing:\n{text}"
        else:
            continue
        ran += 1
    assert ran >= 5, f"only {ran} blocks ran: did the page's steps move?"


def _check(language: str, out: str, shown: str) -> None:
    if shown.lstrip().startswith(("{", "[")):
        assert json.loads(out) == json.loads(shown), out
    else:
        assert not missing_lines(shown, out), (missing_lines(shown, out), out)
