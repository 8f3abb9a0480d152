"""Bearer-token auth of the lookup service's /v1/ API (/healthz and /metrics stay open for probes and
scrapers)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from index_service.context import json_response


def add_bearer_auth(app: FastAPI, token: str) -> None:
    """Every /v1/ request must carry `Authorization: Bearer <token>`, else 401."""
    expected = f"Bearer {token}".encode()
    refused = {"error": "missing or wrong bearer token (Authorization: Bearer ...)"}

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: no guessing by timing
                return json_response(refused, 401)
        return await call_next(request)
