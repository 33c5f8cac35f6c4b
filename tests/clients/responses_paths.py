"""The Responses API's clients against the gateway, as their users write them:
the openai-agents SDK with its default model (``Agent(model="name")`` calls
``/v1/responses``), litellm's ``responses()``, and LangChain's ``ChatOpenAI`` with
``use_responses_api=True``.

Run with the python of ``.venv-clients`` (``ci/clients-venv`` makes it), as
tests/integration/test_responses_clients.py does: ``python responses_paths.py
BASE_URL``, BASE_URL being the gateway's ``http://host:port/v1`` with a worker on
the tiny model (structured output on). Exits non-zero with a message saying what
differed; prints a short summary otherwise.

- agents: a plain run (a string out); a run with a function tool and
  ``tool_choice`` "required" (the tool is called with arguments of its schema,
  and its result is the run's output); ``output_type`` a pydantic model (an
  instance of it out); a streamed run (text deltas, then the final output, which
  is their concatenation).
- litellm: ``litellm.responses`` of a string input (a response with output text).
- LangChain: ``ChatOpenAI(use_responses_api=True).invoke`` (an AIMessage).

Every request goes to ``/v1/responses`` (recorded through an httpx event hook), and
nothing may go past the machine: an audit hook refuses any socket connection but to
a loopback address (tracing, litellm's price list, tiktoken), so a download fails
loudly.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any, Literal

import httpx
from offline import Fail, local_only

CALLED: list[dict[str, Any]] = []


def recorded(paths: list[str]) -> httpx.AsyncClient:
    async def record(request: httpx.Request) -> None:
        paths.append(request.url.path)

    async def refuse_loudly(response: httpx.Response) -> None:
        if response.status_code >= 400:
            await response.aread()
            print(f"the gateway answered {response.status_code} to {response.request.url}: "
                  f"{response.text}", file=sys.stderr)

    return httpx.AsyncClient(timeout=120, event_hooks={"request": [record],
                                                       "response": [refuse_loudly]})


async def agents_paths(base_url: str) -> None:
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)
    from openai import AsyncOpenAI
    from openai.types.responses import ResponseTextDeltaEvent
    from pydantic import BaseModel

    paths: list[str] = []
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                          http_client=recorded(paths)),
                              use_for_tracing=False)
    # The tiny model's text is random and seldom ends on its own: a stop string ends
    # it "completed" (out of tokens, a response is "incomplete", which the SDK raises).
    brief = ModelSettings(max_tokens=128, temperature=0, extra_body={"stop": [".", ","]})

    plain = await Runner.run(Agent(name="plain", instructions="Be brief.", model="default",
                                   model_settings=brief), "Say hello.")
    if not isinstance(plain.final_output, str) or not plain.final_output:
        raise Fail(f"a plain run's output is {plain.final_output!r}, not a string")
    print(f"agents: plain run: {plain.final_output!r}")

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        CALLED.append({"city": city})
        return f"sunny in {city}"

    tooled = await Runner.run(Agent(
        name="tools", model="default", tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
        tool_use_behavior="stop_on_first_tool"), "Weather in Oslo?")
    if len(CALLED) != 1 or tooled.final_output != f"sunny in {CALLED[0]['city']}":
        raise Fail(f"a run with a required tool called it {CALLED} and gave "
                   f"{tooled.final_output!r}")
    print(f"agents: tool run: called get_weather({CALLED[0]}), output {tooled.final_output!r}")

    class Flag(BaseModel):
        on: bool
        colour: Literal["red", "green"]

    typed = await Runner.run(Agent(name="typed", model="default", output_type=Flag,
                                   model_settings=ModelSettings(max_tokens=64)), "A flag.")
    if not isinstance(typed.final_output, Flag):
        raise Fail(f"output_type Flag gave {typed.final_output!r}")
    print(f"agents: output_type: {typed.final_output!r}")

    streamed = Runner.run_streamed(Agent(name="streamed", model="default",
                                         model_settings=brief), "Say hello.")
    deltas = [event.data.delta async for event in streamed.stream_events()
              if event.type == "raw_response_event"
              and isinstance(event.data, ResponseTextDeltaEvent)]
    if not deltas or "".join(deltas) != streamed.final_output:
        raise Fail(f"a streamed run gave deltas {deltas!r} and output "
                   f"{streamed.final_output!r}")
    print(f"agents: streamed run: {len(deltas)} deltas, output {streamed.final_output!r}")
    if not paths or any(not path.endswith("/responses") for path in paths):
        raise Fail(f"the agents SDK sent {sorted(set(paths))}, not only /v1/responses")


def litellm_path(base_url: str) -> None:
    import litellm

    answer = litellm.responses(model="openai/default", input="Say hello.", api_base=base_url,
                               api_key="unused", max_output_tokens=16)
    text = "".join(part.text for item in answer.output if item.type == "message"
                   for part in item.content if part.type == "output_text")
    if answer.status not in ("completed", "incomplete") or not text:
        raise Fail(f"litellm.responses gave status {answer.status!r}, text {text!r}")
    print(f"litellm: responses(): {text!r}")


def langchain_path(base_url: str) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    paths: list[str] = []

    def record(request: httpx.Request) -> None:
        paths.append(request.url.path)

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model="default", max_tokens=16,
                     temperature=0, max_retries=0, use_responses_api=True,
                     http_client=httpx.Client(timeout=120, event_hooks={"request": [record]}))
    answer = llm.invoke("Say hello.")
    if not isinstance(answer, AIMessage) or not answer.text:
        raise Fail(f"ChatOpenAI(use_responses_api=True).invoke gave {answer!r}")
    if paths != ["/v1/responses"]:
        raise Fail(f"ChatOpenAI(use_responses_api=True) sent {paths}")
    print(f"langchain: use_responses_api: {answer.text!r}")


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BASE_URL (the gateway's http://host:port/v1)",
              file=sys.stderr)
        return 2
    base_url = sys.argv[1]
    sys.addaudithook(local_only)
    try:
        asyncio.run(agents_paths(base_url))
        litellm_path(base_url)
        langchain_path(base_url)
    except Fail as failure:
        print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    except Exception as error:  # a library's or the client's: say which, with the trace
        traceback.print_exc()
        print(f"FAIL: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"responses paths: ok ({json.dumps({'tool_calls': len(CALLED)})})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
