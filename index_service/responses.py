"""The OpenAPI document's answers: the lookup answer (schemas/answers.py) and the other routes' answers
(schemas/service.py), the very structs the handlers encode, and the errors every route may give.
tests/unit/index_service/test_openapi.py checks real answers against these schemas."""

from __future__ import annotations

import msgspec

from schemas.answers import LookupAnswer
from schemas.service import Error, Health, Models, RouteAccepted, UsageAccepted

JSON = "application/json"


_TYPES = [Error, LookupAnswer, RouteAccepted, UsageAccepted, Health, Models]
_, COMPONENTS = msgspec.json.schema_components(_TYPES, ref_template="#/components/schemas/{name}")

ERRORS = {
    400: "malformed JSON or binary body",
    401: "missing or wrong bearer token",
    403: "the token lacks the scope this route needs",
    404: "unknown model, or no such path",
    405: "method not allowed on this path",
    413: "prompt or body larger than max_tokens allows",
    422: "a field missing, of the wrong type or out of range",
}


def ok(name: str, what: str, status: int = 200) -> dict[int, dict]:
    return {status: {"description": what, "content": {JSON: {"schema": ref(name)}}}}


def errors(*statuses: int) -> dict[int, dict]:
    return {s: {"description": ERRORS[s], "content": {JSON: {"schema": ref("Error")}}} for s in statuses}


def ref(name: str) -> dict[str, str]:
    assert name in COMPONENTS, name
    return {"$ref": f"#/components/schemas/{name}"}
