"""LangChain (langchain-openai 1.7.4) against the fleet: ``ChatOpenAI`` with named
messages (``HumanMessage(name=...)``, ``AIMessage(name=...)``), and the completions
``OpenAI`` LLM's ``.batch()`` of 20 prompts, sent as one /v1/completions request whose
20 answers come back in the prompts' order (each is what ``invoke`` of that prompt
alone gives). tests/clients/langchain_paths.py is what runs, and says what it checks.

LangChain runs from the clients' venv (``client_venv``); without it this test skips.
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


def test_langchain_named_messages_and_a_completions_batch_of_20(
        gateway: Any, start_worker: Any, tmp_path: Path) -> None:
    start_worker()
    run_client_script("langchain_paths.py", f"http://127.0.0.1:{port_of(gateway())}/v1", tmp_path)
