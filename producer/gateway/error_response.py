"""An ``OpenAIError`` as the HTTP response the gateway answers: the one place
where a refusal the OpenAI layer decided becomes HTTP."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from tokenfleet.openai.errors import OpenAIError


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)
