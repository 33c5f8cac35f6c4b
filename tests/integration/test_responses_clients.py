"""The Responses API's clients against the fleet: the openai-agents SDK 0.24 with
its default model (a plain run, a required function tool, a pydantic
``output_type``, a streamed run), ``litellm.responses`` (1.110) and LangChain's
``use_responses_api``. tests/clients/responses_paths.py is what runs, and says what
it checks.

They run from the clients' venv (``client_venv``); without it this test skips.
Run with ``-s`` to see the script's summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from client_venv import needs_clients_venv, run_client_script
from gateway_server import gateway, port_of  # noqa: F401  (a fixture)

pytestmark = [
    pytest.mark.slow,  # with the other clients' runs, where CI makes their venvs
    pytest.mark.timeout(300),
    needs_clients_venv,
]


def test_the_agents_sdk_litellm_and_langchain_run_on_the_responses_api(
        gateway: Any, start_worker: Any, tmp_path: Path) -> None:
    start_worker()
    run_client_script("responses_paths.py", f"http://127.0.0.1:{port_of(gateway())}/v1", tmp_path)
