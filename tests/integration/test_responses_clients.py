"""The Responses API's clients against the fleet: the openai-agents SDK 0.24 with
its default model (a plain run, a required function tool, a pydantic
``output_type``, a streamed run), ``litellm.responses`` (1.110) and LangChain's
``use_responses_api``. tests/clients/responses_paths.py is what runs, and says what
it checks.

They run from a venv of their own, ``.venv-clients`` (``ci/clients-venv`` makes it),
so that their dependencies stay out of the test extra; without it this test skips.
Run with ``-s`` to see the script's summary."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gateway_server import gateway, port_of  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-clients" / "bin" / "python"
SCRIPT = ROOT / "tests" / "clients" / "responses_paths.py"
RUN_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.slow,  # with the other clients' runs, where CI makes their venvs
    pytest.mark.timeout(300),
    pytest.mark.skipif(not PYTHON.exists(),
                       reason=f"the clients' venv is absent ({PYTHON}): run ci/clients-venv"),
]


def test_the_agents_sdk_litellm_and_langchain_run_on_the_responses_api(
        gateway: Any, start_worker: Any, tmp_path: Path) -> None:
    start_worker()
    base_url = f"http://127.0.0.1:{port_of(gateway())}/v1"
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
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                 "https_proxy", "all_proxy", "no_proxy", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        env.pop(name, None)
    started = time.monotonic()
    done = subprocess.run([str(PYTHON), str(SCRIPT), base_url], env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    wall_s = time.monotonic() - started
    output = done.stdout + done.stderr
    print(f"\n{output}responses_paths.py: {wall_s:.1f} s")
    assert done.returncode == 0, f"responses_paths.py exited {done.returncode}:\n{output[-6000:]}"
    assert not any(tiktoken_cache.iterdir()), "tiktoken fetched an encoding"
