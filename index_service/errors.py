"""One error shape: the errors FastAPI and Starlette raise themselves (no such path, wrong method, a
validation FastAPI would do) answer {"error": "..."} like the handlers' own, not {"detail": ...}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from index_service.context import json_response


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    where = f"{request.method} {request.url.path[:200]}"
    if exc.status_code == 404:
        error = f"no such path: {where} (the API is listed at /docs and /openapi.json)"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow") or "?"
        error = f"method not allowed: {where} (allowed: {allowed})"
    else:
        error = f"{exc.detail} ({where})"
    r = json_response({"error": error}, exc.status_code)
    r.headers.update(exc.headers or {})  # 405's Allow
    return r


async def validation_error(request: Request, exc: RequestValidationError) -> Response:
    problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
    return json_response({"error": f"invalid request: {problems[:1000]}"}, 422)


def one_error_shape(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
