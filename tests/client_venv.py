"""Client libraries run from a venv of their own, ``.venv-clients`` (``ci/clients-venv``
makes it), so that their dependencies stay out of the test extra: a script of
tests/clients/ runs there against a gateway, with nothing allowed to download."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-clients" / "bin" / "python"
RUN_TIMEOUT_S = 120

needs_clients_venv = pytest.mark.skipif(
    not PYTHON.exists(), reason=f"the clients' venv is absent ({PYTHON}): run ci/clients-venv")


def run_client_script(name: str, base_url: str, tmp_path: Path) -> None:
    """tests/clients/``name`` against the gateway at ``base_url``; fails the test with
    its output unless it exits 0. Its summary is printed (``-s`` shows it)."""
    # Nothing may download: tiktoken's encodings would come from an empty folder (the
    # paths taken never load one), LangSmith's and the agents SDK's tracing stay off,
    # and litellm reads its price list from its own package.
    tiktoken_cache = tmp_path / "tiktoken"
    tiktoken_cache.mkdir()
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tiktoken_cache), "OPENAI_API_KEY": "",
           "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false",
           "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "OPENAI_AGENTS_DISABLE_TRACING": "1", "LITELLM_TELEMETRY": "False"}
    # The gateway is on 127.0.0.1: no proxy stands between, nor a base URL from outside.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                "https_proxy", "all_proxy", "no_proxy", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        env.pop(var, None)
    started = time.monotonic()
    done = subprocess.run([str(PYTHON), str(ROOT / "tests" / "clients" / name), base_url],
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall_s = time.monotonic() - started
    output = done.stdout + done.stderr
    print(f"\n{output}{name}: {wall_s:.1f} s")
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{output[-6000:]}"
    assert not any(tiktoken_cache.iterdir()), "tiktoken fetched an encoding"
