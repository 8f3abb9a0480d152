"""Bearer-token auth of the lookup service's /v1/ API (/healthz and /metrics stay open for probes and
scrapers)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from index_service.context import json_response


class BearerToken:
    """The token every /v1/ request must carry (`Authorization: Bearer <token>`), and the 401 if not."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    def accepts(self, given: bytes) -> bool:
        return hmac.compare_digest(given, self.expected)  # constant time: no guessing by timing

    @staticmethod
    def refusal():
        return json_response({"error": "missing or wrong bearer token (Authorization: Bearer ...)"}, 401)


def add_bearer_auth(app: FastAPI, token: BearerToken) -> None:
    """Every /v1/ request must carry the token, else 401 (the routers' lookups are checked where
    they are taken, before this middleware: index_service.hot_path.HotPath)."""

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if request.url.path.startswith("/v1/") and not token.accepts(
                request.headers.get("authorization", "").encode()):
            return token.refusal()
        return await call_next(request)
