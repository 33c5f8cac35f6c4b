"""The routes vLLM's server has besides the API, which benchmark tools probe
(``/health``, ``/version``), and the answer to a path the gateway does not
serve: a 404 in OpenAI's shape (``unknown_url``), so OpenAI's client raises
``NotFoundError`` naming it; a path served with another method is a 405 in the
same shape. A route's own 404 or 413 (the jobs API) keeps FastAPI's shape.

In process, no Redis: the app's lifespan is not run, and the state the
routes read is stubbed where one is reached."""

from __future__ import annotations

import asyncio
import importlib.metadata
import socket
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from tokenfleet.gateway.app import create_app
from tokenfleet.shared.settings import Settings

UNSERVED = [("POST", "/v1/embeddings"), ("POST", "/v1/moderations"),
            ("POST", "/v1/audio/speech"), ("GET", "/nope"), ("GET", "/v1/jobs/abc/extra")]


def dead_redis_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there


def app_with(auth: str, **settings: Any) -> Any:
    return create_app(Settings(redis_url=dead_redis_url(), gateway_auth=auth, **settings))


def ask(app: Any, *requests: tuple[str, str], **kwargs: Any) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return [await http.request(method, path, **kwargs) for method, path in requests]
    return asyncio.run(go())


def test_health_is_healthz_and_version_is_the_installed_one() -> None:
    health, healthz, version = ask(app_with("off"), ("GET", "/health"), ("GET", "/healthz"),
                                   ("GET", "/version"))
    assert health.status_code == healthz.status_code == 200
    assert health.json() == healthz.json()
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("tokenfleet")}


def test_health_and_version_need_no_key_and_an_unserved_path_is_asked_for_one() -> None:
    app = app_with("on")
    app.state.keybook = object()  # never read: no key is sent
    health, version, embeddings = ask(app, ("GET", "/health"), ("GET", "/version"),
                                      ("POST", "/v1/embeddings"))
    assert health.status_code == 200 and version.status_code == 200
    # Without a key a stranger learns nothing of which paths exist.
    assert embeddings.status_code == 401
    assert embeddings.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("method", "path"), UNSERVED)
def test_a_path_no_route_serves_is_404_unknown_url_in_openais_shape(method: str,
                                                                     path: str) -> None:
    (response,) = ask(app_with("off"), (method, path), json={"model": "m", "input": "hi"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "unknown_url" and error["param"] is None
    assert f"({method} {path})" in error["message"]
    assert "does not serve" in error["message"]
    assert response.headers["x-should-retry"] == "false"


def test_a_served_path_with_another_method_is_405_in_openais_shape_listing_the_methods() -> None:
    chat, files = ask(app_with("off"), ("GET", "/v1/chat/completions"),
                      ("DELETE", "/v1/files"))
    assert chat.status_code == 405 and chat.headers["allow"] == "POST"
    error = chat.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert "GET /v1/chat/completions" in error["message"]
    # /v1/files has two routes: the answer names both methods, not the first route's.
    assert files.status_code == 405 and files.headers["allow"] == "GET, POST"
    assert "(allowed: GET, POST)" in files.json()["error"]["message"]


def test_a_routes_own_http_errors_keep_fastapis_shape() -> None:
    settings = Settings(redis_url=dead_redis_url(), gateway_auth="off", max_payload_bytes=10)
    app = create_app(settings)
    app.state.fleet = SimpleNamespace(settings=settings)  # what submit reads before the body
    (too_large,) = ask(app, ("POST", "/v1/jobs"), content=b"x" * 100)
    assert too_large.status_code == 413
    assert "TOKENFLEET_MAX_PAYLOAD_BYTES" in too_large.json()["detail"]


def test_openais_client_raises_not_found_naming_the_path() -> None:
    app = app_with("off")

    async def embed() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        async with openai.AsyncOpenAI(base_url="http://gw/v1", api_key="none",
                                      http_client=http, max_retries=0) as client:
            await client.embeddings.create(model="m", input="hi")

    with pytest.raises(openai.NotFoundError) as raised:
        asyncio.run(embed())
    assert "POST /v1/embeddings" in str(raised.value)
    assert raised.value.code == "unknown_url"
