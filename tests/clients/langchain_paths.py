"""LangChain's OpenAI classes against the gateway: named chat messages, and a
completions ``.batch()`` of 20 prompts.

Run with the python of ``.venv-clients`` (``ci/clients-venv`` makes it), as
tests/integration/test_langchain.py does: ``python langchain_paths.py BASE_URL``,
BASE_URL being the gateway's ``http://host:port/v1``. Exits non-zero with a message
saying what differed; prints a short summary otherwise.

- ``ChatOpenAI.invoke`` of a system message and named human and AI messages
  (``HumanMessage(name=...)``, ``AIMessage(name=...)``): an AIMessage whose content
  is a string.
- ``OpenAI.batch`` (the completions LLM) of 20 prompts with ``batch_size=20``: LangChain
  sends them as a list in one /v1/completions request; each of the 20 answers is what
  ``invoke`` of that prompt alone gives (greedy decoding), so the choices came back in
  the prompts' order.

Nothing may go past the machine: an audit hook refuses any socket connection but to a
loopback address (tiktoken's encodings, LangSmith), so a download fails loudly.

Every request LangChain sends is recorded through an httpx event hook on the client
it is given, so the script checks what went over the wire, not only what came back.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import httpx
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAI
from offline import Fail, local_only

PROMPTS = [f"prompt {i}" for i in range(20)]


def recording_client(sent: list[tuple[str, dict[str, Any]]]) -> httpx.Client:
    """An httpx client that records each request's path and JSON body."""

    def record(request: httpx.Request) -> None:
        body = json.loads(request.content) if request.content else {}
        sent.append((request.url.path, body))

    def refuse_loudly(response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()
            print(f"the gateway answered {response.status_code} to {response.request.url}: "
                  f"{response.text}", file=sys.stderr)

    return httpx.Client(timeout=120, event_hooks={"request": [record],
                                                  "response": [refuse_loudly]})


def chat(base_url: str) -> str:
    sent: list[tuple[str, dict[str, Any]]] = []
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model="default", max_tokens=8,
                     temperature=0, max_retries=0, http_client=recording_client(sent))
    messages = [SystemMessage("be brief"), HumanMessage("hi", name="ann"),
                AIMessage("hello", name="researcher"), HumanMessage("go on", name="ann")]
    answer = llm.invoke(messages)
    if not isinstance(answer, AIMessage) or not isinstance(answer.content, str):
        raise Fail(f"ChatOpenAI.invoke gave {answer!r}, not an AIMessage with string content")
    if len(sent) != 1 or not sent[0][0].endswith("/chat/completions"):
        raise Fail(f"ChatOpenAI.invoke sent {[path for path, _ in sent]}, "
                   "not one /chat/completions request")
    names = [m.get("name") for m in sent[0][1]["messages"]]
    if names != [None, "ann", "researcher", "ann"]:
        raise Fail(f"the messages' names went as {names}, not [None, ann, researcher, ann]")
    print(f"chat: names {names[1:]} sent; answer {answer.content!r}")
    return answer.content


def completions_batch(base_url: str) -> list[str]:
    sent: list[tuple[str, dict[str, Any]]] = []

    def llm() -> OpenAI:
        return OpenAI(base_url=base_url, api_key="unused", model="default", max_tokens=4,
                      temperature=0, batch_size=20, max_retries=0,
                      http_client=recording_client(sent))

    batched = llm().batch(PROMPTS)
    if len(sent) != 1:
        raise Fail(f"OpenAI.batch of {len(PROMPTS)} prompts sent {len(sent)} requests, not one")
    path, body = sent[0]
    if not path.endswith("/completions") or body.get("prompt") != PROMPTS:
        raise Fail(f"OpenAI.batch sent {path} with prompt {body.get('prompt')!r}, "
                   f"not /completions with the {len(PROMPTS)} prompts as a list")
    if len(batched) != len(PROMPTS) or not all(isinstance(text, str) for text in batched):
        raise Fail(f"OpenAI.batch gave {batched!r}, not {len(PROMPTS)} strings")

    sent.clear()
    one = llm()
    alone = [one.invoke(prompt) for prompt in PROMPTS]
    if [body.get("prompt") for _, body in sent] != [[p] for p in PROMPTS]:
        raise Fail(f"OpenAI.invoke sent {[body.get('prompt') for _, body in sent]}")
    differ = [(i, batched[i], alone[i]) for i in range(len(PROMPTS)) if batched[i] != alone[i]]
    if differ:
        raise Fail("OpenAI.batch's answers differ from invoke's of the same prompt "
                   f"(index, batch, invoke): {differ}")
    print(f"completions: batch of {len(PROMPTS)} prompts in 1 request, each answer as "
          f"invoke's alone ({len(set(batched))} distinct); first three {batched[:3]!r}")
    return batched


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BASE_URL (the gateway's http://host:port/v1)",
              file=sys.stderr)
        return 2
    base_url = sys.argv[1]
    sys.addaudithook(local_only)
    try:
        chat(base_url)
        completions_batch(base_url)
    except Fail as failure:
        print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    except Exception as error:  # LangChain's or the client's: say which, with the trace
        traceback.print_exc()
        print(f"FAIL: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print("langchain paths: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
