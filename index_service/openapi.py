"""The lookup service's OpenAPI document: the answers' schemas (index_service.responses) in its
components, and the request bodies the handlers read themselves (they take the raw Request, so FastAPI
cannot infer them)."""

from __future__ import annotations

from fastapi import FastAPI

from index_service.context import JSON
from index_service.responses import COMPONENTS
from index_service.wire import MAX_TOP_K


def document_responses(app: FastAPI) -> None:
    """The answers' schemas in the OpenAPI document's components, which the routes' `responses=` refer
    to."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
        return app.openapi_schema

    app.openapi = openapi


def json_body(schema: dict) -> dict:
    """openapi_extra of a route whose body is JSON of this schema."""
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}


def binary_lookup_extra() -> dict:
    """openapi_extra of POST /v1/lookup/binary: its query parameters and the packed body (a new dict
    per app: FastAPI keeps references to it in the document)."""
    return {
        "parameters": [
            {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}},
            {"name": "lora_name", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "cache_salt", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "top_k", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K}},
        ], "requestBody": {
            "required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary",
                           "description": "token ids as packed little-endian uint32"}}}}}
